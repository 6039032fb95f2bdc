//! `stagefs sync` behaviour over real files: what is copied, what is kept, torn-write detection,
//! failures named in the output with a non-zero exit, and the `--every` loop's last pass.
#![allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)

use stagefs_test_support::{test, Need};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_stagefs");

/// A temporary name as a sync on this node writes it, for writer `pid` (see stagefs_sync::temp).
fn temp_of_this_node(pid: u32, name: &str) -> String {
    let boot: String = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap()
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(16)
        .collect();
    let ns = std::fs::read_link("/proc/self/ns/pid").unwrap();
    let ns: String = ns
        .to_string_lossy()
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    format!(".stagefs-tmp.thishost.{boot}-{ns}.{pid}.12345.0123456789abcdef.{name}")
}

/// The uid of a test account (the harness runs these tests only where the accounts exist).
fn test_user(name: &str) -> u32 {
    stagefs_test_support::uid_of(name).unwrap()
}

/// `cmd` run as `uid` (its group is the same number, as useradd makes it).
fn as_user(uid: u32, cmd: &str) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".into(),
        cmd.into(),
    ]);
    c
}

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

fn delete_removes_extras_and_leftover_temporaries_are_cleaned() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(src.join("keep")).unwrap();
    std::fs::write(src.join("keep/k"), b"k").unwrap();
    std::fs::create_dir_all(dst.join("gone/deep")).unwrap();
    std::fs::write(dst.join("gone/deep/g"), b"g").unwrap();
    std::fs::write(dst.join("old"), b"o").unwrap();
    // A temporary from a crashed run on this node (pid that cannot exist: above pid_max's 2^22
    // limit).
    let leftover = temp_of_this_node(99_999_999, "old");
    std::fs::write(dst.join(&leftover), b"partial").unwrap();

    let o = sync(&src, &dst, &[]);
    assert!(o.status.success());
    assert!(dst.join("old").exists(), "without --delete extras stay");
    assert!(!dst.join(&leftover).exists());
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

fn failures_are_named_and_exit_nonzero() {
    // As root nothing is denied, so give SRC a file whose path *inside* the trees exceeds
    // PATH_MAX (4096): the walk reaches it a directory at a time, but no path beneath a root
    // can name it. (A long absolute DST path no longer fails: DST is reached beneath its root
    // descriptor, so only the part inside DST counts.)
    use std::ffi::CString;
    use std::os::fd::{FromRawFd, OwnedFd};
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("s");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("ok"), b"fine").unwrap();
    let seg = CString::new("d".repeat(200)).unwrap();
    let f = CString::new("f").unwrap();
    let mut dir = OwnedFd::from(std::fs::File::open(&src).unwrap());
    // 21 levels of 200 bytes: 4220 bytes below SRC. Built from descriptors, as no path call
    // could reach the deeper levels.
    for _ in 0..21 {
        use std::os::fd::AsRawFd;
        // SAFETY: `dir` is an open directory and `seg` a NUL-terminated name, both live
        // across the calls; a descriptor returned by openat is owned by nothing else.
        dir = unsafe {
            assert_eq!(libc::mkdirat(dir.as_raw_fd(), seg.as_ptr(), 0o755), 0);
            let fd = libc::openat(dir.as_raw_fd(), seg.as_ptr(), libc::O_DIRECTORY);
            assert!(fd >= 0);
            OwnedFd::from_raw_fd(fd)
        };
    }
    {
        use std::os::fd::AsRawFd;
        // SAFETY: as above; the new file's descriptor is owned (and closed) at once.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                f.as_ptr(),
                libc::O_CREAT | libc::O_WRONLY,
                0o644,
            )
        };
        assert!(fd >= 0);
        // SAFETY: `fd` was just returned by openat and is owned by nothing else.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    drop(dir);
    let dst = t.path().join("dst");
    let o = sync(&src, &dst, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("FAILED"), "{err}");
    assert!(err.contains("File name too long"), "{err}");
    // The other files were still copied.
    assert_eq!(std::fs::read(dst.join("ok")).unwrap(), b"fine");
}

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
fn type_changes_replace_the_destination_entry() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(src.join("x")).unwrap();
    std::fs::write(src.join("x/inner"), b"i").unwrap();
    std::fs::write(src.join("y"), b"now a file").unwrap();
    std::fs::create_dir_all(dst.join("y/old")).unwrap();
    std::fs::write(dst.join("x"), b"was a file").unwrap();
    // A directory in DST is only removed for a file with --delete (see
    // sync_without_delete_keeps_directory_in_the_way_of_a_file).
    let o = sync(&src, &dst, &["--delete"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(dst.join("x/inner")).unwrap(), b"i");
    assert_eq!(std::fs::read(dst.join("y")).unwrap(), b"now a file");
}

/// Regression: `sync SRC DST --delete` with SRC inside DST deleted SRC itself and the
/// rest of DST. Now refused, with nothing touched; without --delete it runs and never writes
/// into or over SRC.
fn sync_delete_refuses_src_inside_dst() {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("dst");
    let src = dst.join("out");
    std::fs::create_dir_all(src.join("out")).unwrap();
    std::fs::write(src.join("model.pt"), b"weights").unwrap();
    // An entry named like SRC's own directory: its copy would land inside SRC.
    std::fs::write(src.join("out/inner"), b"inner").unwrap();
    std::fs::write(dst.join("earlier-run.log"), b"keep me").unwrap();

    let o = sync(&src, &dst, &["--delete"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("lies inside destination"),
        "{}",
        stderr(&o)
    );
    assert_eq!(std::fs::read(src.join("model.pt")).unwrap(), b"weights");
    assert_eq!(
        std::fs::read(dst.join("earlier-run.log")).unwrap(),
        b"keep me"
    );

    let o = sync(&src, &dst, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::read(dst.join("model.pt")).unwrap(), b"weights");
    assert!(
        stderr(&o).contains("is the source directory"),
        "{}",
        stderr(&o)
    );
    // SRC is as it was: nothing written into it (no dst/out/inner copied over SRC/inner).
    let mut names: Vec<_> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["model.pt", "out"]);
    assert_eq!(
        std::fs::read(dst.join("earlier-run.log")).unwrap(),
        b"keep me"
    );

    // DST inside SRC stays refused, with or without --delete.
    for extra in [&[][..], &["--delete"][..]] {
        let o = sync(&dst, &src.join("x"), extra);
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        assert!(stderr(&o).contains("inside source"), "{}", stderr(&o));
    }
}

/// Regression: sync deleted any file in DST named `.stagefs-tmp.*`, even without
/// --delete, and skipped such files in SRC. Only names of stagefs's exact pattern are
/// temporaries now.
fn sync_removes_only_its_own_temporaries() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::write(src.join(".stagefs-tmp.notes"), b"a user's file in SRC").unwrap();
    for name in [
        ".stagefs-tmp.mine",
        ".stagefs-tmp.1.2.3",
        ".stagefs-tmp.1.2.",
    ] {
        std::fs::write(dst.join(name), b"a user's file in DST").unwrap();
    }
    let ours = temp_of_this_node(99_999_999, "ckpt.pt");
    std::fs::write(dst.join(&ours), b"partial").unwrap();
    let o = sync(&src, &dst, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        !dst.join(&ours).exists(),
        "a crashed run's temporary is removed"
    );
    for name in [".stagefs-tmp.mine", ".stagefs-tmp.1.2."] {
        assert_eq!(
            std::fs::read(dst.join(name)).unwrap(),
            b"a user's file in DST",
            "{name}"
        );
    }
    assert_eq!(
        std::fs::read(dst.join(".stagefs-tmp.notes")).unwrap(),
        b"a user's file in SRC"
    );
    // `.stagefs-tmp.1.2.3` has an old version's (pid.seq.name) shape: kept until it is an
    // hour old, even with --delete; the others are no temporaries, and --delete removes them
    // as it removes any file SRC lacks.
    let o = sync(&src, &dst, &["--delete"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(dst.join(".stagefs-tmp.1.2.3").exists());
    assert!(!dst.join(".stagefs-tmp.mine").exists());
    assert!(dst.join(".stagefs-tmp.notes").exists());
}

/// Regression: two nodes syncing into one DST judged each other's temporaries by a pid on their
/// own node, and deleted live ones. A temporary written on another node (another boot id or
/// pid namespace) is left alone while it is young, whatever its pid means here.
fn sync_keeps_live_temporaries_of_another_node() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::write(src.join("ckpt.pt"), b"from this node").unwrap();
    // Node B's copy of the same file, in progress: its pid 99999999 cannot exist here.
    let theirs =
        ".stagefs-tmp.nodeb.fedcba9876543210-4026531836.99999999.777.00112233445566ff.ckpt.pt";
    std::fs::write(dst.join(theirs), b"node B, half written").unwrap();
    for extra in [&[][..], &["--delete"][..]] {
        let o = sync(&src, &dst, extra);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            stderr(&o).contains("0 leftover temporaries removed"),
            "{}",
            stderr(&o)
        );
    }
    assert_eq!(
        std::fs::read(dst.join(theirs)).unwrap(),
        b"node B, half written"
    );
    assert_eq!(
        std::fs::read(dst.join("ckpt.pt")).unwrap(),
        b"from this node"
    );

    // Two real passes at once into one DST, each in its own pid namespace (to each other, two
    // nodes): neither removes the other's temporaries, so neither fails a rename.
    let run = |jobs: &str| {
        Command::new("unshare")
            .args(["--pid", "--fork", "--mount-proc"])
            .arg(BIN)
            .arg("sync")
            .arg(&src)
            .arg(&dst)
            .args(["-q", "-j", jobs])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    const SIZE: usize = 32 << 20;
    for round in 0..2u8 {
        // New versions of every file, so that both passes copy all of them.
        for i in 0..4u8 {
            let p = src.join(format!("big{i}"));
            std::fs::write(&p, vec![i ^ round; SIZE]).unwrap();
            let f = std::fs::File::options().write(true).open(&p).unwrap();
            let when = std::time::SystemTime::now() - Duration::from_secs(10 + u64::from(round));
            f.set_modified(when).unwrap();
        }
        // A copies one file at a time; B starts (and plans) once A's first temporary is in
        // DST, so B's plan meets A's live temporary. Both pass pid 1 in their namespaces.
        let a = run("1");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !std::fs::read_dir(&dst).unwrap().any(|e| {
            let n = e.unwrap().file_name();
            let n = n.to_string_lossy();
            n.starts_with(".stagefs-tmp.") && n.contains(".big")
        }) {
            assert!(
                std::time::Instant::now() < deadline,
                "A never started copying"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let b = run("4");
        for (who, c) in [("A", a), ("B", b)] {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "round {round}, {who}: {}", stderr(&o));
        }
        assert_eq!(
            std::fs::read(dst.join("big2")).unwrap(),
            vec![2 ^ round; SIZE]
        );
    }
}

/// Regression: sync opened SRC files by path after planning, so a symlink swapped in
/// mid-run was followed (a root-run sync copied /etc/shadow into DST). Two real users: the
/// victim syncs a SRC that holds a shared drop directory (sticky, world-writable, as shared
/// scratch dirs are); the attacker swaps their file there for a symlink to the victim's
/// private file while the pass runs.
fn sync_does_not_follow_symlink_swapped_in_mid_run() {
    let (victim, attacker) = (test_user("stagefs-test"), test_user("stagefs-test2"));
    let t = tempfile::tempdir().unwrap();
    let base = t.path();
    std::fs::set_permissions(base, PermissionsExt::from_mode(0o755)).unwrap();
    let bin = base.join("stagefs");
    std::fs::copy(BIN, &bin).unwrap();
    let (src, dst, private) = (base.join("src"), base.join("dst"), base.join("private"));
    std::fs::create_dir_all(src.join("shared")).unwrap();
    std::fs::create_dir_all(&private).unwrap();
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::write(private.join("secret"), b"VICTIM SECRET").unwrap();
    std::fs::set_permissions(private.join("secret"), PermissionsExt::from_mode(0o600)).unwrap();
    // First in plan order and never settling: holds the pass in its copy for ~8 s.
    std::fs::write(src.join("a_busy.log"), b"busy").unwrap();
    for p in [
        &src,
        &dst,
        &private,
        &private.join("secret"),
        &src.join("a_busy.log"),
    ] {
        std::os::unix::fs::chown(p, Some(victim), Some(victim)).unwrap();
    }
    std::fs::set_permissions(src.join("shared"), PermissionsExt::from_mode(0o1777)).unwrap();
    let drop_file = src.join("shared/drop.txt");
    let o = as_user(attacker, "sh")
        .arg("-c")
        .arg(format!("echo harmless > {}", drop_file.display()))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));

    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, busy) = (Arc::clone(&stop), src.join("a_busy.log"));
        std::thread::spawn(move || {
            use std::io::Write;
            while !stop.load(Ordering::Relaxed) {
                let mut f = std::fs::File::options().append(true).open(&busy).unwrap();
                f.write_all(b".").unwrap();
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let child = as_user(victim, bin.to_str().unwrap())
        .arg("sync")
        .arg(&src)
        .arg(&dst)
        .args(["-j", "1"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Planning takes milliseconds; the busy file holds the pass for seconds after it.
    std::thread::sleep(Duration::from_millis(2500));
    let swap = format!(
        "cd {} && ln -s {} drop.new && mv -fT drop.new drop.txt",
        src.join("shared").display(),
        private.join("secret").display()
    );
    let o = as_user(attacker, "sh")
        .arg("-c")
        .arg(&swap)
        .output()
        .unwrap();
    assert!(o.status.success(), "swap failed: {}", stderr(&o));
    let out = child.wait_with_output().unwrap();
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let err = stderr(&out);
    let copied = std::fs::read(dst.join("shared/drop.txt")).ok();
    assert_ne!(copied.as_deref(), Some(&b"VICTIM SECRET"[..]), "{err}");
    assert!(
        err.contains("shared/drop.txt: a symlink is now on its path"),
        "the swap did not land between planning and copying: {err}"
    );
    assert!(copied.is_none(), "{err}");
}

/// A sync run as root would have copied a user's setuid bit onto a root-owned copy: a
/// root-owned setuid program of the user's making. Copies never carry setuid/setgid.
fn sync_as_root_never_creates_setuid_files() {
    let user = test_user("stagefs-test");
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(&src).unwrap();
    let prog = src.join("prog");
    std::fs::write(&prog, b"#!/bin/sh\nid\n").unwrap();
    std::os::unix::fs::chown(&prog, Some(user), Some(user)).unwrap();
    std::fs::set_permissions(&prog, PermissionsExt::from_mode(0o6755)).unwrap();
    let o = sync(&src, &dst, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = std::fs::metadata(dst.join("prog")).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o755);
    assert_eq!(m.uid(), 0);
    // And the next pass does not copy it again for the missing bits.
    let o = sync(&src, &dst, &[]);
    assert!(stderr(&o).contains("1 unchanged"), "{}", stderr(&o));
}

/// Without --delete, a directory in DST is never removed to make room for a file: it may hold
/// files synced earlier that SRC no longer has. The path fails, named, and nothing is lost.
fn sync_without_delete_keeps_directory_in_the_way_of_a_file() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("results"), b"now a file").unwrap();
    std::fs::write(src.join("other"), b"o").unwrap();
    std::fs::create_dir_all(dst.join("results")).unwrap();
    std::fs::write(dst.join("results/epoch1.json"), b"synced yesterday").unwrap();
    let o = sync(&src, &dst, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("not removed without --delete"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read(dst.join("results/epoch1.json")).unwrap(),
        b"synced yesterday"
    );
    assert_eq!(std::fs::read(dst.join("other")).unwrap(), b"o");
}

/// The lab group the victim and the attacker share in the race test. A gid that no account
/// has: setpriv hands it out as a supplementary group, which needs no /etc/group entry, so the
/// test changes nothing on the machine.
const LAB_GID: u32 = 64_321;

/// Set (to the race directory) when this test binary is run as the attacker's swapper.
const SWAPPER_ENV: &str = "STAGEFS_TEST_SWAPPER";

/// `cmd` run as `uid` with its own group and the lab group, as a lab member's login is.
fn as_lab_member(uid: u32, cmd: &Path) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        format!("--groups={LAB_GID}"),
    ])
    .arg(cmd);
    c
}

/// Everything about the entries under `dir` (names, inodes, owners, modes, times, contents),
/// and about `dir` itself: a file created there and removed again still moves its mtime.
fn snapshot(dir: &Path) -> Vec<String> {
    use std::os::unix::ffi::OsStringExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let m = std::fs::symlink_metadata(&d).unwrap();
        out.push(format!(
            "{} dir ino {} uid {} mode {:o} mtime {}.{} ctime {}.{}",
            d.display(),
            m.ino(),
            m.uid(),
            m.mode(),
            m.mtime(),
            m.mtime_nsec(),
            m.ctime(),
            m.ctime_nsec()
        ));
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p);
                continue;
            }
            // A link's target, never what it points to (which may not exist).
            let data = if m.file_type().is_symlink() {
                std::fs::read_link(&p).unwrap().into_os_string().into_vec()
            } else {
                std::fs::read(&p).unwrap()
            };
            out.push(format!(
                "{} ino {} uid {} mode {:o} ctime {}.{} data {:?}",
                p.display(),
                m.ino(),
                m.uid(),
                m.mode(),
                m.ctime(),
                m.ctime_nsec(),
                String::from_utf8_lossy(&data)
            ));
        }
    }
    out.sort();
    out
}

/// The attacker (run as `stagefs-test2` by the race test): swaps `DST/sub` between the real
/// directory and a symlink to the victim's `~/.ssh` as fast as it can, with
/// `renameat2(RENAME_EXCHANGE)` against a spare slot of its own, so that at every instant
/// `DST/sub` is one or the other. Stops when `DIR/stop` exists, or after two minutes in any
/// case. Prints the number of swaps.
fn swapper_main(dir: &Path) -> std::process::ExitCode {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let (dst_sub, spare_sub) = (dir.join("lab/dst/sub"), dir.join("lab/spare/sub"));
    let target = dir.join("home/.ssh");
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).unwrap();
    let (a, b) = (c(&dst_sub), c(&spare_sub));
    let stop = dir.join("stop");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let (mut swaps, mut rearmed) = (0u64, 0u64);
    for i in 0u64.. {
        if i % 64 == 0 && (stop.exists() || std::time::Instant::now() > deadline) {
            break;
        }
        // SAFETY: both arguments are NUL-terminated strings that outlive the call, and
        // AT_FDCWD makes them plain paths.
        let r = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                a.as_ptr(),
                libc::AT_FDCWD,
                b.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if r == 0 {
            swaps += 1;
        }
        // The victim's sync replaces a symlink it finds at DST/sub by a fresh directory; once
        // both slots hold directories, put a new symlink into the spare slot.
        let is_dir = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir());
        let spare_is_dir = is_dir(&spare_sub);
        let spare_missing = std::fs::symlink_metadata(&spare_sub).is_err();
        if spare_missing || (spare_is_dir && is_dir(&dst_sub)) {
            if spare_is_dir {
                let _ = std::fs::rename(&spare_sub, dir.join(format!("lab/spare/old{i}")));
            }
            if std::os::unix::fs::symlink(&target, &spare_sub).is_ok() {
                rearmed += 1;
            }
        }
    }
    println!("{swaps} swaps, {rearmed} symlinks planted");
    std::process::ExitCode::SUCCESS
}

/// Rewrites the victim's job outputs for pass `pass`: new contents and mtimes (in the past, so
/// that the copies need not wait for them to settle), a new directory with a file, the
/// previous pass's directory gone (for --delete to remove), a symlink to the new directory,
/// and `flip`, a file in even passes (run with --delete, which replaces a directory by it) and
/// a directory in odd ones: every kind of change sync makes in DST/sub.
fn write_outputs(src: &Path, victim: u32, pass: usize) {
    let when = std::time::SystemTime::now() - Duration::from_secs(10);
    let sub = src.join("sub");
    let new_dir = sub.join(format!("d{pass}"));
    std::fs::create_dir_all(&new_dir).unwrap();
    std::fs::set_permissions(&new_dir, PermissionsExt::from_mode(0o775)).unwrap();
    std::os::unix::fs::chown(&new_dir, Some(victim), Some(victim)).unwrap();
    if pass > 0 {
        let _ = std::fs::remove_dir_all(sub.join(format!("d{}", pass - 1)));
    }
    let link = sub.join("latest");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(format!("d{pass}"), &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(victim), Some(victim)).unwrap();
    let flip = sub.join("flip");
    let _ = std::fs::remove_file(&flip);
    let _ = std::fs::remove_dir_all(&flip);
    let flip = if pass.is_multiple_of(2) {
        flip
    } else {
        std::fs::create_dir(&flip).unwrap();
        std::os::unix::fs::chown(&flip, Some(victim), Some(victim)).unwrap();
        flip.join("inner")
    };
    let mut files = vec![
        (flip, format!("flip pass {pass}\n")),
        (
            sub.join("authorized_keys"),
            format!("ssh-ed25519 ATTACKER-KEY pass {pass}\n"),
        ),
        (new_dir.join("g"), format!("new in pass {pass}\n")),
        (src.join("top.log"), format!("top pass {pass}\n")),
    ];
    for i in 0..4 {
        files.push((sub.join(format!("f{i}")), format!("f{i} pass {pass}\n")));
    }
    for (p, data) in files {
        std::fs::write(&p, data).unwrap();
        std::os::unix::fs::chown(&p, Some(victim), Some(victim)).unwrap();
        let f = std::fs::File::options().write(true).open(&p).unwrap();
        f.set_modified(when).unwrap();
    }
}

/// Hardening issue, item 3: `stagefs sync` reached DST by path, so a member of the lab group
/// (DST group-writable, as lab directories on /bigdata are) who swapped `DST/sub` between a
/// directory and a symlink to the victim's `~/.ssh` while the victim's sync ran got a file of
/// theirs into `~/.ssh/authorized_keys` (and, with --delete, could have the victim's keys
/// deleted). Two real users in a shared group, a swapper process of the attacker's, 100
/// passes (every other one with --delete): the victim's home must not change at all (no file
/// written, renamed, deleted or re-moded there, not even for a moment: its directories' times
/// are compared too), and the swaps must really have met the passes.
fn regression_sync_wrote_through_a_symlink_swapped_into_dst() {
    const PASSES: usize = 100;
    let started = std::time::Instant::now();
    let (victim, attacker) = (test_user("stagefs-test"), test_user("stagefs-test2"));
    let t = tempfile::tempdir().unwrap();
    let base = t.path();
    std::fs::set_permissions(base, PermissionsExt::from_mode(0o755)).unwrap();
    // Both programs where both users can run them.
    let bin = base.join("stagefs");
    std::fs::copy(BIN, &bin).unwrap();
    let me = base.join("swapper");
    std::fs::copy(std::env::current_exe().unwrap(), &me).unwrap();
    for p in [&bin, &me] {
        std::fs::set_permissions(p, PermissionsExt::from_mode(0o755)).unwrap();
    }
    // The victim's home with its keys; the victim's job outputs on scratch.
    let (home, ssh) = (base.join("home"), base.join("home/.ssh"));
    std::fs::create_dir_all(&ssh).unwrap();
    std::fs::write(ssh.join("authorized_keys"), b"ssh-ed25519 VICTIM-OWN-KEY\n").unwrap();
    std::fs::write(ssh.join("id_ed25519"), b"VICTIM PRIVATE KEY\n").unwrap();
    let src = base.join("scratch/out");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::set_permissions(src.join("sub"), PermissionsExt::from_mode(0o775)).unwrap();
    for p in [
        home.clone(),
        ssh.clone(),
        ssh.join("authorized_keys"),
        ssh.join("id_ed25519"),
        base.join("scratch"),
        src.clone(),
        src.join("sub"),
    ] {
        std::os::unix::fs::chown(&p, Some(victim), Some(victim)).unwrap();
    }
    std::fs::set_permissions(&ssh, PermissionsExt::from_mode(0o700)).unwrap();
    for f in ["authorized_keys", "id_ed25519"] {
        std::fs::set_permissions(ssh.join(f), PermissionsExt::from_mode(0o600)).unwrap();
    }
    // The lab's directory, group-writable and setgid; the victim's DST in it, likewise; the
    // attacker's own directory beside it.
    let (lab, dst, spare) = (
        base.join("lab"),
        base.join("lab/dst"),
        base.join("lab/spare"),
    );
    for (d, uid, mode) in [
        (&lab, 0, 0o2775),
        (&dst, victim, 0o2775),
        (&spare, attacker, 0o755),
    ] {
        std::fs::create_dir(d).unwrap();
        std::os::unix::fs::chown(d, Some(uid), Some(LAB_GID)).unwrap();
        std::fs::set_permissions(d, PermissionsExt::from_mode(mode)).unwrap();
    }
    std::os::unix::fs::chown(&spare, Some(attacker), Some(attacker)).unwrap();

    let log = base.join("sync.log");
    let pass_as_victim = |extra: &[&str]| {
        let err = std::fs::File::create(&log).unwrap();
        let mut child = as_lab_member(victim, &bin)
            .arg("sync")
            .arg(&src)
            .arg(&dst)
            .args(["-q", "-j", "4"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("a pass ran over 20 s");
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        (status, std::fs::read_to_string(&log).unwrap())
    };

    // A first pass before the attack: DST/sub exists as a real directory.
    write_outputs(&src, victim, 0);
    let (status, err) = pass_as_victim(&[]);
    assert!(status.success(), "{err}");
    assert!(std::fs::symlink_metadata(dst.join("sub")).unwrap().is_dir());
    let before = snapshot(&home);

    /// Kills the swapper if the test fails before stopping it.
    struct Swapper(Option<std::process::Child>);
    impl Drop for Swapper {
        fn drop(&mut self) {
            if let Some(mut c) = self.0.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let mut swapper = Swapper(Some(
        as_lab_member(attacker, &me)
            .env(SWAPPER_ENV, base)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let (mut met, mut other, mut clean) = (0, 0, 0);
    let mut first_other = String::new();
    let mut outcome = Ok(());
    for pass in 1..=PASSES {
        write_outputs(&src, victim, pass);
        let extra: &[&str] = if pass.is_multiple_of(2) {
            &["--delete"]
        } else {
            &[]
        };
        let (status, err) = pass_as_victim(extra);
        if snapshot(&home) != before {
            outcome = Err(format!(
                "pass {pass}: the victim's home changed through DST/sub:\n{:#?}\n(sync said: {err})",
                snapshot(&home)
            ));
            break;
        }
        // Paths that met the swap fail, named (exit 1); so may others the attacker moved away
        // (a directory gone by the time it is fsynced). Anything else is a bug.
        match status.code() {
            Some(0) => clean += 1,
            Some(1) if err.contains("not followed") => met += 1,
            Some(1) if err.contains("FAILED") => {
                if other == 0 {
                    first_other = err;
                }
                other += 1;
            }
            _ => {
                outcome = Err(format!("pass {pass}: {status}: {err}"));
                break;
            }
        }
    }
    std::fs::write(base.join("stop"), b"").unwrap();
    let out = swapper.0.take().unwrap().wait_with_output().unwrap();
    let swaps = String::from_utf8_lossy(&out.stdout).into_owned();
    if let Err(e) = outcome {
        panic!("{e}\n(swapper: {swaps})");
    }
    eprintln!(
        "{PASSES} passes in {:.1} s: {met} refused a swapped-in symlink, {other} failed otherwise, \
         {clean} clean; swapper: {swaps}{first_other}",
        started.elapsed().as_secs_f64()
    );
    assert!(
        met > 0,
        "no pass met a swap: the test proved nothing ({swaps})"
    );

    // Unattacked, a pass puts everything in place; the home is as it was.
    let (status, err) = pass_as_victim(&["--delete"]);
    assert!(status.success(), "{err}");
    assert!(std::fs::symlink_metadata(dst.join("sub")).unwrap().is_dir());
    assert_eq!(
        std::fs::read_link(dst.join("sub/latest")).unwrap(),
        Path::new(&format!("d{PASSES}"))
    );
    for rel in ["sub/authorized_keys", "sub/f3", "sub/flip", "top.log"] {
        assert_eq!(
            std::fs::read(dst.join(rel)).unwrap(),
            std::fs::read(src.join(rel)).unwrap(),
            "{rel}"
        );
    }
    assert_eq!(snapshot(&home), before);
}

fn main() -> std::process::ExitCode {
    if let Some(dir) = std::env::var_os(SWAPPER_ENV) {
        return swapper_main(Path::new(&dir));
    }
    stagefs_test_support::run(vec![
        test!(copies_tree_keeps_mode_mtime_and_symlinks_then_skips_unchanged),
        test!(verify_catches_same_size_and_mtime_with_other_bytes),
        test!(delete_removes_extras_and_leftover_temporaries_are_cleaned),
        test!(failures_are_named_and_exit_nonzero),
        test!(bad_arguments_get_clear_errors),
        test!(file_written_during_copy_is_never_installed_torn),
        test!(every_runs_a_last_pass_on_signal),
        test!(type_changes_replace_the_destination_entry),
        test!(sync_delete_refuses_src_inside_dst),
        test!(sync_removes_only_its_own_temporaries),
        test!(sync_keeps_live_temporaries_of_another_node, Need::Root),
        test!(
            sync_does_not_follow_symlink_swapped_in_mid_run,
            Need::Root,
            Need::Accounts
        ),
        test!(
            sync_as_root_never_creates_setuid_files,
            Need::Root,
            Need::Accounts
        ),
        test!(sync_without_delete_keeps_directory_in_the_way_of_a_file),
        test!(
            regression_sync_wrote_through_a_symlink_swapped_into_dst,
            Need::Root,
            Need::Accounts
        ),
    ])
}
