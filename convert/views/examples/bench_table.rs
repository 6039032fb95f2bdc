//! Parquet column → `.npy` bytes throughput of the table views, one thread.
//!
//! `cargo run --release -p stagefs-views --example bench_table -- FILE.parquet COLUMN [ROUNDS]`
//! renders `<COLUMN>.npy` in full through `View::read_at` (8 MiB reads, as `convert` does)
//! from a freshly opened table each round (footer parse included) and prints GB/s of array data.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use stagefs_views::{DirSource, ViewOptions, ViewSet};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let file = args
        .next()
        .ok_or("usage: bench_table FILE.parquet COLUMN [ROUNDS]")?;
    let column = args
        .next()
        .ok_or("usage: bench_table FILE.parquet COLUMN [ROUNDS]")?;
    let rounds: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(3);
    let path = Path::new(&file);
    let dir = path.parent().ok_or("no parent directory")?;
    let name = path.file_name().ok_or("no file name")?;
    let rel = Path::new(name).join(format!("{column}.npy"));
    let mut buf = vec![0u8; 8 << 20];
    for _ in 0..rounds {
        let t = Instant::now();
        let set = ViewSet::new(Arc::new(DirSource::new(dir)), ViewOptions::default())?;
        let view = set.open(&rel)?;
        let mut off = 0;
        while off < view.len() {
            let n = view.read_at(off, &mut buf)?;
            if n == 0 {
                break;
            }
            std::hint::black_box(&buf[..n]);
            off += n as u64;
        }
        let secs = t.elapsed().as_secs_f64();
        println!("{:.3}", view.len() as f64 / secs / 1e9);
    }
    Ok(())
}
