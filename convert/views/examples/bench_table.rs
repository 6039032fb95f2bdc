//! Parquet column → `.npy` bytes throughput of the table views.
//!
//! `cargo run --release -p stagefs-views --example bench_table -- FILE.parquet COLUMN [ROUNDS] [THREADS]`
//! renders `<COLUMN>.npy` in full through `View::read_at` from a freshly opened table each
//! round (footer parse included) and prints GB/s of array data, one line per round.
//! THREADS = 1 (default): 8 MiB reads in order, one thread. THREADS = 0 (all cores) or N:
//! the file cut into `chunk_len` pieces rendered in parallel, as `convert --to npy` does.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use stagefs_views::{DirSource, View, ViewOptions, ViewSet};

const USAGE: &str = "usage: bench_table FILE.parquet COLUMN [ROUNDS] [THREADS]";

fn sequential(view: &dyn View) -> Result<(), stagefs_views::ViewError> {
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0;
    while off < view.len() {
        let n = view.read_at(off, &mut buf)?;
        if n == 0 {
            break;
        }
        std::hint::black_box(&buf[..n]);
        off += n as u64;
    }
    Ok(())
}

fn parallel(view: &dyn View) -> Result<(), stagefs_views::ViewError> {
    let len = view.len();
    let chunk = view.chunk_len().max(1 << 20);
    (0..len.div_ceil(chunk)).into_par_iter().try_for_each(|i| {
        let off = i * chunk;
        let mut buf = vec![0u8; chunk.min(len - off) as usize];
        view.read_at(off, &mut buf)?;
        std::hint::black_box(&buf);
        Ok(())
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let file = args.next().ok_or(USAGE)?;
    let column = args.next().ok_or(USAGE)?;
    let rounds: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(3);
    let threads: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let path = Path::new(&file);
    let dir = path.parent().ok_or("no parent directory")?;
    let name = path.file_name().ok_or("no file name")?;
    let rel = Path::new(name).join(format!("{column}.npy"));
    for _ in 0..rounds {
        let t = Instant::now();
        let set = ViewSet::new(Arc::new(DirSource::new(dir)), ViewOptions::default())?;
        let view = set.open(&rel)?;
        if threads == 1 {
            sequential(view.as_ref())?;
        } else {
            pool.install(|| parallel(view.as_ref()))?;
        }
        let secs = t.elapsed().as_secs_f64();
        println!("{:.3}", view.len() as f64 / secs / 1e9);
    }
    Ok(())
}
