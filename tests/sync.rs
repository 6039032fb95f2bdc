//! `stagefs sync` behaviour over real files: what is copied, what is kept, torn-write detection,
//! failures named in the output with a non-zero exit, and the `--every` loop's last pass.
#![allow(clippy::unwrap_used)] // tests may unwrap (COMMON.md)

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_stagefs");

fn sync(src: &Path, dst: &Path, extra: &[&str]) -> Output {
    Command::new(BIN)
        .arg("sync")
        .arg(src)
        .arg(dst)
        .args(extra)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn copies_tree_keeps_mode_mtime_and_symlinks_then_skips_unchanged() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(src.join("a/b")).unwrap();
    std::fs::write(src.join("a/b/x.bin"), vec![7u8; 100_000]).unwrap();
    std::fs::write(src.join("script.sh"), "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(src.join("script.sh"), PermissionsExt::from_mode(0o751)).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", src.join("outside")).unwrap();
    std::os::unix::fs::symlink("a/b/x.bin", src.join("inside")).unwrap();

    let o = sync(&src, &dst, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("4 copied"), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(dst.join("a/b/x.bin")).unwrap(),
        vec![7u8; 100_000]
    );
    let (s, d) = (
        std::fs::metadata(src.join("script.sh")).unwrap(),
        std::fs::metadata(dst.join("script.sh")).unwrap(),
    );
    assert_eq!(d.mode() & 0o7777, 0o751);
    assert_eq!((s.mtime(), s.mtime_nsec()), (d.mtime(), d.mtime_nsec()));
    // Symlinks are copied as links, not followed.
    let l = std::fs::symlink_metadata(dst.join("outside")).unwrap();
    assert!(l.file_type().is_symlink());
    assert_eq!(
        std::fs::read_link(dst.join("outside")).unwrap(),
        Path::new("/etc/hostname")
    );

    let o = sync(&src, &dst, &[]);
    assert!(o.status.success());
    assert!(stderr(&o).contains("0 copied"), "{}", stderr(&o));
    assert!(stderr(&o).contains("4 unchanged"), "{}", stderr(&o));
}

#[test]
fn verify_catches_same_size_and_mtime_with_other_bytes() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("f"), b"AAAA").unwrap();
    assert!(sync(&src, &dst, &[]).status.success());
    // Corrupt the copy but keep its size and mtime.
    let mtime = std::fs::metadata(dst.join("f"))
        .unwrap()
        .modified()
        .unwrap();
    std::fs::write(dst.join("f"), b"BBBB").unwrap();
    let f = std::fs::File::options()
        .write(true)
        .open(dst.join("f"))
        .unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    let o = sync(&src, &dst, &[]);
    assert!(
        stderr(&o).contains("0 copied"),
        "size+mtime alone cannot see it"
    );
    assert_eq!(std::fs::read(dst.join("f")).unwrap(), b"BBBB");
    let o = sync(&src, &dst, &["--verify"]);
    assert!(stderr(&o).contains("1 copied"), "{}", stderr(&o));
    assert_eq!(std::fs::read(dst.join("f")).unwrap(), b"AAAA");
}

#[test]
fn delete_removes_extras_and_leftover_temporaries_are_cleaned() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(src.join("keep")).unwrap();
    std::fs::write(src.join("keep/k"), b"k").unwrap();
    std::fs::create_dir_all(dst.join("gone/deep")).unwrap();
    std::fs::write(dst.join("gone/deep/g"), b"g").unwrap();
    std::fs::write(dst.join("old"), b"o").unwrap();
    // A temporary from a crashed run (pid that cannot exist: above pid_max's 2^22 limit).
    std::fs::write(dst.join(".stagefs-tmp.99999999.0.old"), b"partial").unwrap();

    let o = sync(&src, &dst, &[]);
    assert!(o.status.success());
    assert!(dst.join("old").exists(), "without --delete extras stay");
    assert!(!dst.join(".stagefs-tmp.99999999.0.old").exists());
    assert!(
        stderr(&o).contains("1 leftover temporaries removed"),
        "{}",
        stderr(&o)
    );

    let o = sync(&src, &dst, &["--delete"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!dst.join("old").exists());
    assert!(!dst.join("gone").exists());
    assert_eq!(std::fs::read(dst.join("keep/k")).unwrap(), b"k");
}

#[test]
fn failures_are_named_and_exit_nonzero() {
    // As root nothing is denied, so make a destination path exceed PATH_MAX (4096) while the
    // source path stays within it.
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("s");
    let mut deep = src.clone();
    let seg = "d".repeat(200);
    while deep.as_os_str().len() < 3900 {
        deep.push(&seg);
    }
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::write(deep.join("f"), b"x").unwrap();
    std::fs::write(src.join("ok"), b"fine").unwrap();
    let mut dst = t.path().join("dst");
    for _ in 0..2 {
        dst.push("e".repeat(200));
    }
    let o = sync(&src, &dst, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("FAILED"), "{err}");
    assert!(err.contains("File name too long"), "{err}");
    // The other files were still copied.
    assert_eq!(std::fs::read(dst.join("ok")).unwrap(), b"fine");
}

#[test]
fn bad_arguments_get_clear_errors() {
    let t = tempfile::tempdir().unwrap();
    let o = sync(&t.path().join("missing"), &t.path().join("d"), &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("missing"), "{}", stderr(&o));
    std::fs::create_dir_all(t.path().join("s")).unwrap();
    let o = sync(&t.path().join("s"), &t.path().join("s/inner"), &[]);
    assert!(stderr(&o).contains("inside source"), "{}", stderr(&o));
}

/// A checkpoint rewritten in place while passes run: the destination must always hold one
/// complete version (every byte equal to the version number), never a mix.
#[test]
fn file_written_during_copy_is_never_installed_torn() {
    const SIZE: usize = 8 << 20;
    const CHUNK: usize = 256 << 10;
    const PASSES: usize = 15;
    let t = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(&src).unwrap();
    let ckpt = src.join("ckpt.bin");
    std::fs::write(&ckpt, vec![0u8; SIZE]).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, ckpt) = (Arc::clone(&stop), ckpt.clone());
        std::thread::spawn(move || {
            use std::io::{Seek, Write};
            let mut f = std::fs::File::options().write(true).open(&ckpt).unwrap();
            let mut v: u8 = 1;
            while !stop.load(Ordering::Relaxed) {
                f.seek(std::io::SeekFrom::Start(0)).unwrap();
                for _ in 0..SIZE / CHUNK {
                    f.write_all(&[v; CHUNK]).unwrap();
                    std::thread::sleep(Duration::from_millis(2));
                }
                v = v.wrapping_add(1).max(1);
                // Every third version is followed by a pause longer than the 1 s a file must
                // stay unchanged before it is copied, so that some passes can succeed.
                let pause = if v.is_multiple_of(3) { 1500 } else { 50 };
                std::thread::sleep(Duration::from_millis(pause));
            }
        })
    };
    let (mut installed, mut retried, mut failed) = (0, 0, 0);
    for _ in 0..PASSES {
        let o = Command::new(BIN)
            .arg("sync")
            .arg(&src)
            .arg(&dst)
            .stdout(Stdio::null())
            .output()
            .unwrap();
        let err = stderr(&o);
        if err.contains(" 1 copied") {
            installed += 1;
        }
        if !err.contains(" 0 retried") {
            retried += 1;
        }
        if !o.status.success() {
            failed += 1;
            assert!(err.contains("changed while being copied"), "{err}");
        }
        if let Ok(data) = std::fs::read(dst.join("ckpt.bin")) {
            assert_eq!(data.len(), SIZE);
            let first = data[0];
            let torn = data.iter().position(|&b| b != first);
            assert!(
                torn.is_none(),
                "torn copy: byte 0 is version {first}, byte {} is version {}",
                torn.unwrap_or(0),
                data[torn.unwrap_or(0)]
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    eprintln!(
        "torn-write test: {PASSES} passes, {installed} installed a version, {retried} retried a \
         copy, {failed} gave up (file kept changing); torn copies: 0"
    );
    assert!(installed > 0, "no pass ever copied the checkpoint");
}

/// `--every` keeps passing until SIGUSR1, then runs a last pass that picks up late files.
#[test]
fn every_runs_a_last_pass_on_signal() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("early"), b"1").unwrap();
    let child = Command::new(BIN)
        .arg("sync")
        .arg(&src)
        .arg(&dst)
        .args(["--every", "1h"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !dst.join("early").exists() {
        assert!(std::time::Instant::now() < deadline, "first pass never ran");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(src.join("late"), b"2").unwrap();
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("SIGUSR1: running a last pass"),
        "{}",
        stderr(&out)
    );
    assert_eq!(std::fs::read(dst.join("late")).unwrap(), b"2");
}

/// A path that changed type (file <-> directory) in the source is replaced in the destination.
#[test]
fn type_changes_replace_the_destination_entry() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(src.join("x")).unwrap();
    std::fs::write(src.join("x/inner"), b"i").unwrap();
    std::fs::write(src.join("y"), b"now a file").unwrap();
    std::fs::create_dir_all(dst.join("y/old")).unwrap();
    std::fs::write(dst.join("x"), b"was a file").unwrap();
    let o = sync(&src, &dst, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(dst.join("x/inner")).unwrap(), b"i");
    assert_eq!(std::fs::read(dst.join("y")).unwrap(), b"now a file");
}
