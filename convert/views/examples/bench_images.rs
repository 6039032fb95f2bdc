//! Decode + resize + center crop throughput of the image views' renderer.
//!
//! `cargo run --release -p stagefs-views --example bench_images -- DIR [SIZE] [ROUNDS] [fast]
//! [threads=N] [memory]` renders every `.jpg`/`.png` in DIR and prints `images/s` per round.
//! Each image's file is read inside the timed loop (file I/O included, as `convert` does it)
//! unless `memory` is given. With `threads=N` the files are split over N threads (each
//! rendering its share), for the scaling figure. bench/bench_images.py drives it; under
//! `valgrind --tool=callgrind` one round gives instruction counts, valid on a loaded machine.

use std::path::PathBuf;
use std::time::Instant;

use stagefs_views::image::decode::{render_with, DecodeSettings};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: bench_images DIR [SIZE] [ROUNDS] [fast] [threads=N] [memory]";
    let dir = args.first().ok_or(usage)?;
    let size: u32 = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(224);
    let rounds: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(3);
    let fast = args.iter().any(|a| a == "fast");
    let memory = args.iter().any(|a| a == "memory");
    let threads: usize = args
        .iter()
        .find_map(|a| a.strip_prefix("threads="))
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1)
        .max(1);
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e == "jpg" || e == "jpeg" || e == "png")
        })
        .collect();
    files.sort();
    let preloaded: Vec<Vec<u8>> = if memory {
        files.iter().map(std::fs::read).collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    let settings = DecodeSettings {
        fast,
        ..DecodeSettings::default()
    };
    let per_thread = files.len().div_ceil(threads);
    for _ in 0..rounds {
        let t = Instant::now();
        std::thread::scope(|scope| {
            for part in 0..threads {
                let (files, preloaded, settings) = (&files, &preloaded, &settings);
                scope.spawn(move || {
                    let mut out = vec![0u8; (size * size * 3) as usize];
                    let lo = (part * per_thread).min(files.len());
                    let hi = ((part + 1) * per_thread).min(files.len());
                    for i in lo..hi {
                        let owned;
                        let bytes: &[u8] = if memory {
                            &preloaded[i]
                        } else {
                            owned = std::fs::read(&files[i]).unwrap_or_default();
                            &owned
                        };
                        if let Err(e) = render_with(bytes, size, settings, &mut out) {
                            eprintln!("{}: {e}", files[i].display());
                        }
                    }
                });
            }
        });
        let secs = t.elapsed().as_secs_f64();
        println!("{:.1}", files.len() as f64 / secs);
    }
    Ok(())
}
