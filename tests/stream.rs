//! `stagefs stream` as a user runs it: real processes on generated `.npy` files, the JSON report
//! checked against the files, and the error paths (truncated file, bad device, no CUDA).

// Tests may unwrap: a failed unwrap is a failed test with its reason.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output};

use stagefs_npy::{DType, NpyHeader};

fn stagefs(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stagefs"))
        .arg("stream")
        .args(args)
        .output()
        .unwrap()
}

fn write_npy(path: &Path, dtype: DType, shape: &[u64]) -> u64 {
    let header = NpyHeader::new(dtype, shape.to_vec());
    let mut bytes = header.encode();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    bytes.extend((0..header.data_len()).map(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u8
    }));
    std::fs::write(path, bytes).unwrap();
    header.data_len()
}

fn report(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn streams_every_byte_to_the_host_device_and_verifies_it() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.npy");
    let b = dir.path().join("b.npy");
    let bytes = write_npy(&a, DType::F32, &[1000, 7]) + write_npy(&b, DType::U8, &[333, 3, 4]);
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let r = report(&stagefs(&[
        a,
        b,
        "--device",
        "cpu",
        "--batch-rows",
        "64",
        "--epochs",
        "2",
        "--shuffle",
        "--seed",
        "9",
        "--verify",
        "--json",
        "--ring",
        "3",
    ]));
    assert_eq!(r["bytes"], 2 * bytes);
    assert_eq!(
        r["batches"],
        2 * (1000u64.div_ceil(64) + 333u64.div_ceil(64))
    );
    assert_eq!(r["batch_bytes"], 64 * 28);
    assert!(r["verified_batches"].as_u64().unwrap() >= 1);
    assert_eq!(r["verify_mismatches"], serde_json::json!([]));
    assert!(r["device_wait_share"].as_f64().unwrap() >= 0.0);

    // The human report names the figures a user looks for.
    let out = stagefs(&[a, "--device", "cpu", "--verify"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for needle in [
        "GB/s",
        "batches/s",
        "device waited on data",
        "readers waited on storage",
        "match the files",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

#[test]
fn truncated_file_fails_with_a_message_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.npy");
    write_npy(&path, DType::I64, &[100, 10]);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(4000).unwrap();
    let out = stagefs(&[path.to_str().unwrap(), "--device", "cpu"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cut.npy") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn bad_device_choices_are_clear_errors_never_crashes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.npy");
    write_npy(&path, DType::U8, &[10]);
    let p = path.to_str().unwrap();

    let out = stagefs(&[p, "--device", "gpu7"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected `cpu`, `auto` or a GPU number"));

    let out = stagefs(&["--bench-peak", "--device", "cpu"]);
    assert_eq!(out.status.code(), Some(1));

    let out = stagefs(&[p, "--device", "cpu", "--consume-gbps", "0"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--consume-gbps"));

    // GPU 0: without the cuda feature a rebuild hint; with it, either a GPU works or the
    // missing driver is reported — never a panic (exit code 101).
    let out = stagefs(&[p, "--device", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(101), "panicked: {err}");
    if cfg!(feature = "cuda") {
        assert!(
            out.status.success() || err.contains("CUDA") || err.contains("GPU"),
            "{err}"
        );
    } else {
        assert_eq!(out.status.code(), Some(1));
        assert!(err.contains("--features cuda"), "{err}");
    }

    // `auto` falls back to host memory when there is no GPU.
    let out = stagefs(&[p, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `stagefs stream --json | head -c 1`: the reader goes away before the report is written; the
/// command ended with a panic ("failed printing to stdout: Broken pipe", exit 101). It now ends
/// as coreutils do, by SIGPIPE, without a word on stderr.
#[test]
fn regression_a_closed_pipe_ends_the_report_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.npy");
    write_npy(&path, DType::U8, &[1000, 64]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_stagefs"))
        .args([
            "stream",
            path.to_str().unwrap(),
            "--device",
            "cpu",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader is gone before anything is written
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.signal(), Some(libc::SIGPIPE), "{status:?}: {err}");
}
