//! Single-core decode + resize + center crop throughput of the image views' renderer.
//!
//! `cargo run --release -p stagefs-views --example bench_images -- DIR [SIZE] [ROUNDS]`
//! renders every `.jpg` in DIR (files read into memory first, so only decoding is timed) on
//! the calling thread and prints `images/s` per round. bench/bench_images.py drives it.

use std::time::Instant;

use stagefs_views::image::decode::render;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or("usage: bench_images DIR [SIZE] [ROUNDS]")?;
    let size: u32 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(224);
    let rounds: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(3);
    let mut files: Vec<_> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "jpg"))
        .collect();
    files.sort();
    let data: Vec<Vec<u8>> = files.iter().map(std::fs::read).collect::<Result<_, _>>()?;
    let mut out = vec![0u8; (size * size * 3) as usize];
    for _ in 0..rounds {
        let t = Instant::now();
        for bytes in &data {
            render(bytes, size, &mut out)?;
        }
        let secs = t.elapsed().as_secs_f64();
        println!("{:.1}", data.len() as f64 / secs);
    }
    Ok(())
}
