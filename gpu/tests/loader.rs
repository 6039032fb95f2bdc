//! Loader tests on the host-memory device (real asynchronous copy streams, with a slow copy to
//! widen every race) and on the CPU device: every row of every source arrives aligned, in the
//! epoch's order; slots come back when batches are dropped, after an early stop, and when a batch
//! outlives its loader; a hostile header never yields an array.

// Tests may unwrap: a failed unwrap is a failed test with its reason.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use stagefs_gpu::{CpuDevice, Device, HostDevice, Loader, LoaderConfig, Source, StreamError};
use stagefs_npy::{DType, NpyHeader};

/// A `.npy` of `rows` rows of `row_bytes` bytes, row r filled with bytes (r * 7 + i) % 251.
fn write_rows(dir: &Path, name: &str, rows: u64, row_bytes: u64) -> PathBuf {
    let mut file = NpyHeader::new(DType::U8, vec![rows, row_bytes]).encode();
    for r in 0..rows {
        file.extend((0..row_bytes).map(|i| ((r * 7 + i) % 251) as u8));
    }
    let path = dir.join(name);
    std::fs::write(&path, file).unwrap();
    path
}

fn row(r: u64, row_bytes: u64) -> Vec<u8> {
    (0..row_bytes).map(|i| ((r * 7 + i) % 251) as u8).collect()
}

fn config(batch_size: u64, ring: usize, shuffle: bool) -> LoaderConfig {
    LoaderConfig {
        batch_size,
        ring,
        readers: 3,
        shuffle,
        seed: 9,
        ..LoaderConfig::default()
    }
}

/// Runs one epoch on `loader`; checks every part of every batch; returns the rows seen.
fn check_epoch<D: Device>(
    loader: &Loader<D>,
    epoch: u64,
    bytes: impl Fn(&stagefs_gpu::LoadedBatch<D>, usize) -> Vec<u8>,
) -> Vec<u64> {
    let order = loader.order(epoch);
    let mut seen = Vec::new();
    for (i, batch) in loader.epoch(epoch).unwrap().enumerate() {
        let batch = batch.unwrap();
        let b = loader.config().batch_size as usize;
        assert_eq!(batch.rows(), &order[i * b..((i + 1) * b).min(order.len())]);
        for (p, part) in batch.parts().iter().enumerate() {
            let rb = loader.sources()[p].row_bytes;
            let want: Vec<u8> = batch.rows().iter().flat_map(|&r| row(r, rb)).collect();
            assert_eq!(part.shape, [batch.rows().len() as u64, rb]);
            assert_eq!(bytes(&batch, p), want, "batch {i} part {p}");
        }
        seen.extend_from_slice(batch.rows());
    }
    seen
}

#[test]
fn host_device_batches_hold_every_row_of_every_source_aligned() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_rows(dir.path(), "a.npy", 97, 5000); // read row by row
    let b = write_rows(dir.path(), "b.npy", 97, 8); // held in memory
    let device = Arc::new(HostDevice::with_copy_delay(Duration::from_millis(1)).unwrap());
    let sources = vec![Source::npy(&a).unwrap(), Source::npy(&b).unwrap()];
    let loader = Loader::new(device, sources, config(10, 3, true)).unwrap();
    for epoch in 0..3 {
        let mut seen = check_epoch(&loader, epoch, |batch, p| {
            let part = &batch.parts()[p];
            let mut all = vec![0u8; part.offset + part.len];
            batch.wait_on_consumer_stream().unwrap();
            batch
                .device()
                .copy_to_host(batch.device_buffer(), &mut all)
                .unwrap();
            all[part.offset..].to_vec()
        });
        seen.sort_unstable();
        assert_eq!(seen, (0..97).collect::<Vec<_>>());
    }
    let s = loader.stats();
    assert_eq!(s.batches, 30);
    assert_eq!(s.bytes, 3 * 97 * 5008);
}

#[test]
fn cpu_device_batches_are_read_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_rows(dir.path(), "a.npy", 50, 1000);
    let loader = Loader::new(
        Arc::new(CpuDevice::new()),
        vec![Source::npy(&a).unwrap()],
        config(7, 2, false),
    )
    .unwrap();
    let seen = check_epoch(&loader, 0, |batch, p| batch.host_part(p).to_vec());
    assert_eq!(seen, (0..50).collect::<Vec<_>>());
}

#[test]
fn slots_come_back_after_an_early_stop_and_batches_outlive_the_loader() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_rows(dir.path(), "a.npy", 64, 64);
    let loader = Loader::new(
        Arc::new(CpuDevice::new()),
        vec![Source::npy(&a).unwrap()],
        config(4, 2, true),
    )
    .unwrap();
    for _ in 0..10 {
        let mut epoch = loader.epoch(0).unwrap();
        drop(epoch.next_batch().unwrap().unwrap());
        let _held = epoch.next_batch().unwrap().unwrap();
        // Both slots are out (one held, one read ahead or waiting): dropping the epoch must
        // bring back the one it holds.
    }
    // A lost slot would leave the next full epoch waiting forever: run it under a watchdog.
    let loader = Arc::new(loader);
    let (tx, rx) = std::sync::mpsc::channel();
    let l = loader.clone();
    std::thread::spawn(move || {
        let mut batches = 0;
        for batch in l.epoch(0).unwrap() {
            drop(batch.unwrap());
            batches += 1;
        }
        let _ = tx.send(batches);
    });
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(30)),
        Ok(16),
        "slots were lost"
    );
    // Only one epoch at a time.
    let running = loader.epoch(1).unwrap();
    assert!(matches!(
        loader.epoch(2).map(|_| ()),
        Err(StreamError::Config(_))
    ));
    drop(running);
    let mut epoch = loader.epoch(3).unwrap();
    let kept = epoch.next_batch().unwrap().unwrap();
    let second = epoch.next_batch().unwrap().unwrap();
    assert!(matches!(
        epoch.next_batch(),
        Some(Err(StreamError::RingHeld { ring: 2 }))
    ));
    drop(second);
    drop(epoch);
    drop(loader); // the last reference: the kept batch holds the ring
    let want: Vec<u8> = kept.rows().iter().flat_map(|&r| row(r, 64)).collect();
    assert_eq!(kept.host_part(0), &want[..]);
}

#[test]
fn npy_shape_product_wrapping_to_0_fails_in_stream() {
    let dir = tempfile::tempdir().unwrap();
    // 2^32 rows of 2^32 bytes: rows × row bytes is 2^64, which wraps to 0 in u64 — the file
    // (a header, no data) once looked like a valid empty stream.
    let path = dir.path().join("wrap.npy");
    std::fs::write(
        &path,
        NpyHeader::new(DType::U8, vec![1 << 32, 1 << 32]).encode(),
    )
    .unwrap();
    let err = Source::npy(&path).unwrap_err();
    assert!(err.to_string().contains("wrap.npy"), "{err}");
    assert!(err.to_string().contains("too large"), "{err}");
    // The same sizes given to a raw source.
    let err = Source::raw(&path, 0, 1 << 32, 1 << 32).unwrap_err();
    assert!(matches!(err, StreamError::TooLarge { .. }), "{err}");
    let err = Source::raw(&path, u64::MAX, 1, 1).unwrap_err();
    assert!(matches!(err, StreamError::TooLarge { .. }), "{err}");
}

#[test]
fn mismatched_rows_and_bad_settings_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_rows(dir.path(), "a.npy", 10, 4);
    let b = write_rows(dir.path(), "b.npy", 11, 4);
    let cpu = || Arc::new(CpuDevice::new());
    let src = |p: &PathBuf| Source::npy(p).unwrap();
    let err = Loader::new(cpu(), vec![src(&a), src(&b)], config(4, 2, false))
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("a.npy") && err.to_string().contains("b.npy"),
        "{err}"
    );
    for bad in [
        LoaderConfig {
            batch_size: 0,
            ..config(4, 2, false)
        },
        LoaderConfig {
            ring: 0,
            ..config(4, 2, false)
        },
        LoaderConfig {
            rank: 3,
            world_size: 3,
            ..config(4, 2, false)
        },
    ] {
        let cfg = format!("{bad:?}");
        let r = Loader::new(cpu(), vec![src(&a)], bad);
        assert!(matches!(r.err(), Some(StreamError::Config(_))), "{cfg}");
    }
}
