//! The CUDA device (feature `cuda`). Without a driver — CI — it must fail cleanly, never panic;
//! with a GPU it streams a file and every batch copied back from device memory matches the file.

// Tests may unwrap: a failed unwrap is a failed test with its reason.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use stagefs_gpu::{CudaDevice, DeviceError, Source, StreamConfig, Streamer};
use stagefs_npy::{DType, NpyHeader};
use stagefs_test_support::{test, Need};

fn cuda_device_opens_or_reports_why_not() {
    match CudaDevice::new(0) {
        Ok(_) => {}
        Err(e @ DeviceError::DriverMissing(_)) => {
            eprintln!("{e}");
            assert!(e.to_string().contains("libcuda"), "{e}")
        }
        Err(e) => assert!(e.to_string().contains("CUDA"), "{e}"),
    }
    // No machine has GPU number 4096.
    assert!(CudaDevice::new(4096).is_err());
}

fn every_batch_on_the_gpu_matches_the_file() {
    let device = CudaDevice::new(0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.npy");
    let header = NpyHeader::new(DType::F32, vec![10_000, 33]);
    let mut bytes = header.encode();
    let start = bytes.len();
    bytes.extend((0..header.data_len()).map(|i| (i * 7 + i / 251) as u8));
    std::fs::write(&path, &bytes).unwrap();
    let cfg = StreamConfig {
        batch_rows: 999,
        ring: 3,
        readers: 2,
        epochs: 2,
        shuffle_seed: Some(5),
    };
    let streamer =
        Streamer::new(Arc::new(device), vec![Source::npy(&path).unwrap()], &cfg).unwrap();
    let mut n = 0;
    while let Some(batch) = streamer.next_batch() {
        let batch = batch.unwrap();
        let m = batch.meta();
        let want = &bytes[start + m.rows.start as usize * 132..start + m.rows.end as usize * 132];
        assert_eq!(batch.copy_to_host().unwrap(), want, "rows {:?}", m.rows);
        n += 1;
    }
    assert_eq!(n, 2 * 11);
}

fn main() -> std::process::ExitCode {
    // Without a GPU (CI) the first test checks the clean "no driver" error; the second needs a
    // GPU and is skipped visibly (scripts/gpu-check.sh runs it on a GPU machine).
    stagefs_test_support::run(vec![
        test!(cuda_device_opens_or_reports_why_not),
        test!(every_batch_on_the_gpu_matches_the_file, Need::Gpu),
    ])
}
