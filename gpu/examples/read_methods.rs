//! How the loader should read `.npy` rows: positioned reads (`pread`, one per run of consecutive
//! rows — what `Loader` does) or a memory map (`memmap2`) and a copy. Gathers one epoch of
//! batches of `--batch` rows in shuffled or file order from a file in the page cache and prints
//! load-independent counts (system calls, page faults) next to CPU seconds (user, system).
//!
//! ```sh
//! cargo run --release -p stagefs-gpu --example read_methods -- FILE.npy [--batch 256] [--shuffle]
//! valgrind --tool=callgrind target/release/examples/read_methods FILE.npy --method pread
//! ```

// An example may unwrap: a failure is a message and a non-zero exit.
#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::os::unix::fs::FileExt;

use stagefs_npy::NpyHeader;

fn usage() -> ! {
    eprintln!("usage: read_methods FILE.npy [--batch N] [--shuffle] [--method pread|mmap|both]");
    std::process::exit(2)
}

/// (user s, system s, minor faults, major faults) of this process so far.
fn usage_now() -> (f64, f64, i64, i64) {
    // SAFETY: getrusage fills the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (s(ru.ru_utime), s(ru.ru_stime), ru.ru_minflt, ru.ru_majflt)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| usage());
    let (mut batch, mut shuffle, mut method) = (256usize, false, "both".to_string());
    while let Some(a) = args.next() {
        match a.as_str() {
            "--batch" => {
                batch = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| usage())
            }
            "--shuffle" => shuffle = true,
            "--method" => method = args.next().unwrap_or_else(|| usage()),
            _ => usage(),
        }
    }
    let file = File::open(&path).unwrap();
    let mut head = vec![0u8; 4096];
    let n = file.read_at(&mut head, 0).unwrap();
    let (header, data_start) = NpyHeader::parse(&head[..n]).unwrap();
    let rows = header.shape[0];
    let row_bytes = header.checked_row_bytes().unwrap() as usize;
    let mut order: Vec<u64> = (0..rows).collect();
    if shuffle {
        stagefs_gpu::plan::shuffle(&mut order, 1);
    }
    let mut buf = vec![0u8; batch * row_bytes];
    println!(
        "{path}: {rows} rows of {row_bytes} B, batches of {batch}, {} order",
        if shuffle { "shuffled" } else { "file" }
    );
    let mut report = |name: &str, syscalls: u64, run: &mut dyn FnMut(&mut [u8])| {
        let before = usage_now();
        for _ in 0..order.len().div_ceil(batch) {
            run(&mut buf);
        }
        let after = usage_now();
        println!(
            "{name:6} {syscalls:9} syscalls  {:8} minor + {} major faults  {:.3} s user  {:.3} s system",
            after.2 - before.2,
            after.3 - before.3,
            after.0 - before.0,
            after.1 - before.1
        );
    };
    if method == "pread" || method == "both" {
        // The loader's way: one pread per run of consecutive rows.
        let mut calls = 0u64;
        for chunk in order.chunks(batch) {
            let mut k = 0;
            while k < chunk.len() {
                let mut n = 1;
                while k + n < chunk.len() && chunk[k + n] == chunk[k] + n as u64 {
                    n += 1;
                }
                calls += 1;
                k += n;
            }
        }
        let mut batches = order.chunks(batch);
        report("pread", calls, &mut |buf| {
            let chunk = batches.next().unwrap();
            let mut k = 0;
            while k < chunk.len() {
                let mut n = 1;
                while k + n < chunk.len() && chunk[k + n] == chunk[k] + n as u64 {
                    n += 1;
                }
                let off = data_start as u64 + chunk[k] * row_bytes as u64;
                file.read_exact_at(&mut buf[k * row_bytes..(k + n) * row_bytes], off)
                    .unwrap();
                k += n;
            }
        });
    }
    if method == "mmap" || method == "both" {
        // SAFETY: the file is not modified while mapped (a benchmark input).
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let data = &map[data_start..];
        let mut batches = order.chunks(batch);
        report("mmap", 1, &mut |buf| {
            let chunk = batches.next().unwrap();
            for (k, &r) in chunk.iter().enumerate() {
                let r = r as usize;
                buf[k * row_bytes..(k + 1) * row_bytes]
                    .copy_from_slice(&data[r * row_bytes..(r + 1) * row_bytes]);
            }
        });
    }
}
