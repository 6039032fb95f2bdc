//! Pipeline tests on the host-memory device: every byte of every batch equals the file, in
//! order and shuffled, across dtypes, shapes, ring sizes and reader counts; partial last batches;
//! truncated files; slow readers, slow consumers and slow copies. Every test body runs under a
//! watchdog so a deadlock fails the test instead of hanging CI.

// Tests may unwrap: a failed unwrap is a failed test with its reason.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use stagefs_gpu::{HostDevice, ReadAt, Source, StreamConfig, StreamError, Streamer};
use stagefs_npy::{DType, NpyHeader};

/// Runs `body` on its own thread and fails if it has not finished within `secs` seconds.
fn watchdog(secs: u64, body: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let handle = std::thread::spawn(move || {
        body();
        let _ = tx.send(());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(()) => handle.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("test did not finish in {secs} s: deadlock?")
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = handle.join() {
                std::panic::resume_unwind(panic);
            }
        }
    }
}

/// Deterministic bytes (an LCG), valid for every dtype (bools are 0 or 1).
fn data_bytes(len: usize, seed: u64, dtype: DType) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let b = (x >> 56) as u8;
            if dtype == DType::Bool {
                b & 1
            } else {
                b
            }
        })
        .collect()
}

/// Writes a `.npy` file; returns its path and its data bytes (after the header).
fn write_npy(dir: &Path, name: &str, dtype: DType, shape: &[u64], seed: u64) -> (PathBuf, Vec<u8>) {
    let header = NpyHeader::new(dtype, shape.to_vec());
    let data = data_bytes(header.data_len() as usize, seed, dtype);
    let mut file = header.encode();
    file.extend_from_slice(&data);
    let path = dir.join(name);
    std::fs::write(&path, file).unwrap();
    (path, data)
}

fn config(batch_rows: u64, ring: usize, readers: usize) -> StreamConfig {
    StreamConfig {
        batch_rows,
        ring,
        readers,
        ..StreamConfig::default()
    }
}

/// Streams everything; returns each batch's (source, rows, shape, bytes) in delivery order.
type Got = Vec<(usize, std::ops::Range<u64>, Vec<u64>, Vec<u8>)>;

fn collect(streamer: &Streamer<HostDevice>) -> Got {
    let mut out = Vec::new();
    while let Some(batch) = streamer.next_batch() {
        let batch = batch.unwrap();
        let m = batch.meta().clone();
        assert_eq!(batch.len(), m.len);
        out.push((m.source, m.rows, m.shape, batch.data().unwrap().to_vec()));
    }
    assert!(streamer.next_batch().is_none(), "the stream stays ended");
    out
}

#[test]
fn every_byte_arrives_in_order_for_many_dtypes_shapes_rings_and_readers() {
    watchdog(120, || {
        let dir = tempfile::tempdir().unwrap();
        let cases: &[(DType, &[u64])] = &[
            (DType::U8, &[1000]),
            (DType::F32, &[37, 5]),
            (DType::I64, &[100, 3, 2]),
            (DType::F64, &[1]),
            (DType::Bool, &[17, 4]),
            (DType::F16, &[9, 224]),
            (DType::I32, &[0, 3]),
        ];
        for (i, (dtype, shape)) in cases.iter().enumerate() {
            let (path, data) = write_npy(dir.path(), &format!("a{i}.npy"), *dtype, shape, i as u64);
            let row_bytes = NpyHeader::new(*dtype, shape.to_vec()).row_bytes() as usize;
            for &(batch_rows, ring, readers) in
                &[(1, 1, 1), (3, 2, 1), (7, 3, 3), (64, 5, 2), (1 << 20, 2, 2)]
            {
                let device = Arc::new(HostDevice::new().unwrap());
                let streamer = Streamer::new(
                    device,
                    vec![Source::npy(&path).unwrap()],
                    &config(batch_rows, ring, readers),
                )
                .unwrap();
                let got = collect(&streamer);
                let rows = shape[0];
                assert_eq!(
                    got.len() as u64,
                    rows.div_ceil(batch_rows),
                    "{dtype:?} {shape:?} b={batch_rows}"
                );
                let mut joined = Vec::new();
                let mut next_row = 0;
                for (src, r, batch_shape, bytes) in &got {
                    assert_eq!(*src, 0);
                    assert_eq!(r.start, next_row, "batches in file order");
                    next_row = r.end;
                    assert!(
                        r.end - r.start == batch_rows || r.end == rows,
                        "only the last batch is partial"
                    );
                    assert_eq!(batch_shape[0], r.end - r.start);
                    assert_eq!(&batch_shape[1..], &shape[1..]);
                    assert_eq!(bytes.len(), (r.end - r.start) as usize * row_bytes);
                    joined.extend_from_slice(bytes);
                }
                assert_eq!(
                    joined, data,
                    "{dtype:?} {shape:?} batch_rows={batch_rows} ring={ring} readers={readers}"
                );
                let stats = streamer.stats();
                assert_eq!(stats.bytes, data.len() as u64);
                assert_eq!(stats.batches, got.len() as u64);
            }
        }
    });
}

#[test]
fn partial_last_batch_has_the_remaining_rows() {
    watchdog(30, || {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = write_npy(dir.path(), "p.npy", DType::F32, &[10, 3], 1);
        let streamer = Streamer::new(
            Arc::new(HostDevice::new().unwrap()),
            vec![Source::npy(&path).unwrap()],
            &config(4, 2, 1),
        )
        .unwrap();
        let got = collect(&streamer);
        let sizes: Vec<_> = got.iter().map(|g| g.2[0]).collect();
        assert_eq!(sizes, [4, 4, 2]);
        assert_eq!(got[2].3, data[8 * 12..]);
    });
}

#[test]
fn shuffled_batches_match_their_rows_cover_everything_and_repeat_for_a_seed() {
    watchdog(60, || {
        let dir = tempfile::tempdir().unwrap();
        let (pa, da) = write_npy(dir.path(), "a.npy", DType::I16, &[101, 3], 5);
        let (pb, db) = write_npy(dir.path(), "b.npy", DType::U8, &[50], 6);
        let run = |seed: u64| {
            let cfg = StreamConfig {
                batch_rows: 8,
                ring: 3,
                readers: 2,
                epochs: 2,
                shuffle_seed: Some(seed),
            };
            let sources = vec![Source::npy(&pa).unwrap(), Source::npy(&pb).unwrap()];
            let streamer =
                Streamer::new(Arc::new(HostDevice::new().unwrap()), sources, &cfg).unwrap();
            collect(&streamer)
        };
        let got = run(42);
        let per_epoch = 101usize.div_ceil(8) + 50usize.div_ceil(8);
        assert_eq!(got.len(), 2 * per_epoch);
        for epoch in got.chunks(per_epoch) {
            let mut seen = BTreeSet::new();
            for (src, rows, _, bytes) in epoch {
                let (data, row_bytes) = if *src == 0 { (&da, 6) } else { (&db, 1) };
                let want = &data[rows.start as usize * row_bytes..rows.end as usize * row_bytes];
                assert_eq!(bytes, want, "source {src} rows {rows:?}");
                assert!(seen.insert((*src, rows.start)), "each batch once per epoch");
            }
            assert_eq!(seen.len(), per_epoch);
        }
        let order = |g: &Got| {
            g.iter()
                .map(|(s, r, _, _)| (*s, r.start))
                .collect::<Vec<_>>()
        };
        let file_order: Vec<_> = (0..13)
            .map(|i| (0, i * 8))
            .chain((0..7).map(|i| (1, i * 8)))
            .collect();
        assert_ne!(order(&got)[..per_epoch], file_order[..], "shuffled");
        assert_ne!(
            order(&got)[..per_epoch],
            order(&got)[per_epoch..],
            "each epoch has its own order"
        );
        assert_eq!(order(&got), order(&run(42)), "same seed, same order");
        assert_ne!(order(&got), order(&run(43)), "another seed, another order");
    });
}

#[test]
fn epochs_repeat_the_data_and_row_ranges_cut_it() {
    watchdog(30, || {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = write_npy(dir.path(), "e.npy", DType::U16, &[40, 2], 9);
        let source = Source::npy(&path).unwrap().rows(10..25).unwrap();
        let cfg = StreamConfig {
            batch_rows: 4,
            ring: 2,
            readers: 1,
            epochs: 3,
            shuffle_seed: None,
        };
        let streamer =
            Streamer::new(Arc::new(HostDevice::new().unwrap()), vec![source], &cfg).unwrap();
        let joined: Vec<u8> = collect(&streamer).into_iter().flat_map(|g| g.3).collect();
        let want = &data[10 * 4..25 * 4];
        assert_eq!(joined, [want, want, want].concat());

        let err = Source::npy(&path).unwrap().rows(30..41).unwrap_err();
        assert!(matches!(err, StreamError::RowRange { .. }), "{err}");
    });
}

#[test]
fn raw_byte_ranges_stream_like_npy_rows() {
    watchdog(30, || {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raw.bin");
        let data = data_bytes(1000, 3, DType::U8);
        std::fs::write(&path, &data).unwrap();
        let source = Source::raw(&path, 100, 10, 77).unwrap();
        let streamer = Streamer::new(
            Arc::new(HostDevice::new().unwrap()),
            vec![source],
            &config(8, 3, 2),
        )
        .unwrap();
        let joined: Vec<u8> = collect(&streamer).into_iter().flat_map(|g| g.3).collect();
        assert_eq!(joined, data[100..870]);
        assert!(matches!(
            Source::raw(&path, 100, 10, 91),
            Err(StreamError::Truncated { .. })
        ));
    });
}

#[test]
fn truncated_file_is_a_clear_error_naming_the_file() {
    watchdog(30, || {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = write_npy(dir.path(), "t.npy", DType::F32, &[100, 8], 2);
        let full = std::fs::metadata(&path).unwrap().len();
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(full - 1000)
            .unwrap();
        let err = Source::npy(&path).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, StreamError::Truncated { .. }), "{msg}");
        assert!(msg.contains("t.npy") && msg.contains("truncated"), "{msg}");

        // A header cut short is a header error, also naming the file.
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(30)
            .unwrap();
        let msg = Source::npy(&path).unwrap_err().to_string();
        assert!(
            msg.contains("t.npy") && msg.contains("truncated .npy header"),
            "{msg}"
        );

        std::fs::write(&path, b"definitely not numpy").unwrap();
        let msg = Source::npy(&path).unwrap_err().to_string();
        assert!(msg.contains("not a .npy file"), "{msg}");
    });
}

#[test]
fn file_truncated_while_streaming_fails_the_stream_then_ends_it() {
    watchdog(30, || {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = write_npy(dir.path(), "s.npy", DType::U8, &[4096, 16], 4);
        let source = Source::npy(&path).unwrap();
        let header_len = std::fs::metadata(&path).unwrap().len() - data.len() as u64;
        // Shrink the file to half its rows after the header was checked.
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(header_len + 2048 * 16)
            .unwrap();
        let streamer = Streamer::new(
            Arc::new(HostDevice::new().unwrap()),
            vec![source],
            &config(256, 3, 2),
        )
        .unwrap();
        let mut good = 0;
        let err = loop {
            match streamer.next_batch() {
                Some(Ok(batch)) => {
                    let m = batch.meta();
                    assert_eq!(
                        batch.data().unwrap(),
                        &data[m.rows.start as usize * 16..m.rows.end as usize * 16]
                    );
                    good += 1;
                }
                Some(Err(e)) => break e,
                None => panic!("a truncated file must not end the stream silently"),
            }
        };
        assert!(good <= 8, "no batch past the truncation point is delivered");
        assert!(matches!(err, StreamError::Truncated { .. }), "{err}");
        assert!(err.to_string().contains("s.npy"));
        assert!(streamer.next_batch().is_none());
    });
}

/// A reader that sleeps before every read: storage slower than the consumer.
struct SlowFile {
    file: std::fs::File,
    delay: Duration,
}

impl ReadAt for SlowFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        std::thread::sleep(self.delay);
        std::os::unix::fs::FileExt::read_at(&self.file, buf, offset)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}

#[test]
fn reader_slower_than_consumer_delivers_everything_and_reports_io_bound() {
    watchdog(60, || {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = write_npy(dir.path(), "slow.npy", DType::F32, &[400, 4], 7);
        let reader = Arc::new(SlowFile {
            file: std::fs::File::open(&path).unwrap(),
            delay: Duration::from_millis(10),
        });
        let source = Source::npy_from_reader(path.clone(), reader).unwrap();
        let streamer = Streamer::new(
            Arc::new(HostDevice::new().unwrap()),
            vec![source],
            &config(16, 2, 1),
        )
        .unwrap();
        let joined: Vec<u8> = collect(&streamer).into_iter().flat_map(|g| g.3).collect();
        assert_eq!(joined, data);
        let stats = streamer.stats();
        assert!(
            stats.consumer_wait_share() > stats.ring_full_share(),
            "the consumer should wait on the reader: {stats:?}"
        );
        assert!(stats.verdict().starts_with("I/O-bound"), "{stats:?}");
    });
}

#[test]
fn consumer_slower_than_reader_blocks_the_reader_and_reports_consumer_bound() {
    watchdog(60, || {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = write_npy(dir.path(), "fast.npy", DType::I64, &[300, 2], 8);
        let streamer = Streamer::new(
            Arc::new(HostDevice::new().unwrap()),
            vec![Source::npy(&path).unwrap()],
            &config(15, 3, 2),
        )
        .unwrap();
        let mut joined = Vec::new();
        while let Some(batch) = streamer.next_batch() {
            let batch = batch.unwrap();
            std::thread::sleep(Duration::from_millis(20));
            joined.extend_from_slice(batch.data().unwrap());
        }
        assert_eq!(joined, data);
        let stats = streamer.stats();
        assert!(
            stats.ring_full_share() > stats.consumer_wait_share(),
            "readers should wait on the ring: {stats:?}"
        );
    });
}

#[test]
fn slow_copies_never_let_a_reader_overwrite_a_buffer_still_being_copied_or_used() {
    watchdog(60, || {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = write_npy(dir.path(), "c.npy", DType::U8, &[64, 1024], 11);
        for (copy_ms, kernel_ms) in [(3, 0), (0, 3)] {
            let device =
                Arc::new(HostDevice::with_copy_delay(Duration::from_millis(copy_ms)).unwrap());
            let streamer =
                Streamer::new(device, vec![Source::npy(&path).unwrap()], &config(2, 2, 2)).unwrap();
            // The consumer launches an asynchronous "kernel" per batch and releases the batch at
            // once, as a GPU training loop does: only the events keep the ring from reusing the
            // buffers too early.
            let (tx, rx) = mpsc::channel();
            while let Some(batch) = streamer.next_batch() {
                let batch = batch.unwrap();
                let (tx, rows) = (tx.clone(), batch.meta().rows.clone());
                batch
                    .launch(move |bytes| {
                        std::thread::sleep(Duration::from_millis(kernel_ms));
                        tx.send((rows, bytes.to_vec())).unwrap();
                    })
                    .unwrap();
            }
            drop(streamer);
            drop(tx);
            let got: Vec<_> = rx.iter().collect();
            assert_eq!(got.len(), 32);
            for (rows, bytes) in got {
                assert_eq!(
                    bytes,
                    data[rows.start as usize * 1024..rows.end as usize * 1024],
                    "rows {rows:?}"
                );
            }
        }
    });
}

#[test]
fn batches_held_together_stay_intact_and_verify_against_the_file() {
    watchdog(30, || {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = write_npy(dir.path(), "h.npy", DType::F64, &[60, 2], 12);
        let streamer = Streamer::new(
            Arc::new(HostDevice::new().unwrap()),
            vec![Source::npy(&path).unwrap()],
            &config(5, 3, 2),
        )
        .unwrap();
        let mut row = 0usize;
        for _ in 0..4 {
            // Hold all three ring slots at once, then release them together.
            let held: Vec<_> = (0..3)
                .map(|_| streamer.next_batch().unwrap().unwrap())
                .collect();
            for b in &held {
                assert_eq!(b.copy_to_host().unwrap(), data[row * 16..(row + 5) * 16]);
                assert!(b.verify().unwrap().matches());
                row += 5;
            }
        }
        assert!(streamer.next_batch().is_none());
    });
}

#[test]
fn asking_for_a_batch_while_holding_the_whole_ring_is_an_error_not_a_deadlock() {
    watchdog(30, || {
        let dir = tempfile::tempdir().unwrap();
        let (path, data) = write_npy(dir.path(), "r.npy", DType::U8, &[10, 4], 14);
        let streamer = Streamer::new(
            Arc::new(HostDevice::new().unwrap()),
            vec![Source::npy(&path).unwrap()],
            &config(2, 2, 1),
        )
        .unwrap();
        let first = streamer.next_batch().unwrap().unwrap();
        let second = streamer.next_batch().unwrap().unwrap();
        let err = streamer.next_batch().unwrap().err().unwrap();
        assert!(matches!(err, StreamError::RingHeld { ring: 2 }), "{err}");
        assert_eq!(first.data().unwrap(), &data[..8]);
        drop(first);
        let third = streamer.next_batch().unwrap().unwrap();
        assert_eq!(second.data().unwrap(), &data[8..16]);
        assert_eq!(third.data().unwrap(), &data[16..24]);
    });
}

#[test]
fn dropping_the_streamer_mid_stream_stops_its_threads() {
    watchdog(30, || {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = write_npy(dir.path(), "d.npy", DType::U8, &[10_000, 64], 13);
        for ring in [1, 2, 4] {
            let cfg = StreamConfig {
                batch_rows: 10,
                ring,
                readers: 3,
                epochs: 5,
                shuffle_seed: Some(1),
            };
            let streamer = Streamer::new(
                Arc::new(HostDevice::new().unwrap()),
                vec![Source::npy(&path).unwrap()],
                &cfg,
            )
            .unwrap();
            for _ in 0..3 {
                drop(streamer.next_batch().unwrap().unwrap());
            }
            drop(streamer);
        }
    });
}

#[test]
fn bad_settings_are_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = write_npy(dir.path(), "b.npy", DType::U8, &[10], 1);
    let dev = || Arc::new(HostDevice::new().unwrap());
    let err = |r: Result<Streamer<HostDevice>, StreamError>| {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    };
    assert!(err(Streamer::new(
        dev(),
        vec![Source::npy(&path).unwrap()],
        &config(0, 2, 1)
    ))
    .contains("batch rows"));
    assert!(err(Streamer::new(
        dev(),
        vec![Source::npy(&path).unwrap()],
        &config(1, 0, 1)
    ))
    .contains("ring"));
    assert!(err(Streamer::new(dev(), vec![], &config(1, 2, 1))).contains("no sources"));
    let scalar = dir.path().join("s.npy");
    std::fs::write(
        &scalar,
        [NpyHeader::new(DType::F32, vec![]).encode(), vec![0; 4]].concat(),
    )
    .unwrap();
    assert!(matches!(
        Source::npy(&scalar),
        Err(StreamError::Scalar { .. })
    ));
    assert!(matches!(
        Source::npy(dir.path().join("missing.npy")),
        Err(StreamError::Io { .. })
    ));
}
