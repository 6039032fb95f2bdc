//! Real FUSE mounts of a generated tree: bytes, metadata, concurrency, read-only-ness, source
//! changes, cache corruption, a full scratch, a killed daemon, and an unprivileged user.
#![allow(missing_docs, clippy::unwrap_used)]

mod common;

use stagefs_test_support::{test, Need};

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::{assert_same_tree, is_root, make_tree, pattern, Mount, BIN};
use rand::{Rng, SeedableRng};

fn fresh() -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    (tmp, src)
}

fn mounted_tree_matches_source_cold_and_warm() {
    let (tmp, src) = fresh();
    let files = make_tree(&src);
    let non_empty = files
        .iter()
        .filter(|f| fs::metadata(src.join(f)).unwrap().len() > 0)
        .count() as u64;
    let mut m = Mount::new(tmp.path(), &src, &["--cache-size", "100M"]);
    assert_same_tree(&src, &m.mnt);
    let s = m.wait_stats("staging", |s| s["files_staged"].as_u64() == Some(non_empty));
    assert_eq!(s["error_count"], 0, "{s}");
    m.umount();
    // Warm: everything comes from scratch, and nothing is listed again.
    m.mount();
    assert_same_tree(&src, &m.mnt);
    let s = m.stats();
    assert_eq!(s["bytes_from_source"], 0, "{s}");
    // One stat, of the source root (is it still the tree the kept snapshot is of?).
    assert_eq!(
        s["metadata_requests"], 1,
        "a remount listed the source: {s}"
    );
    assert_eq!(s["snapshot"], "cache", "{s}");
    if is_root() {
        // As root, the large file goes through kernel passthrough once verified (in the
        // background, after its first open of this mount).
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            assert!(
                fs::read(m.mnt.join("a/big.bin")).unwrap()
                    == fs::read(src.join("a/big.bin")).unwrap()
            );
            let s = m.stats();
            if s["passthrough_opens"].as_u64().unwrap() > 0 {
                assert!(s["bytes_passthrough"].as_u64().unwrap() >= 6 << 20, "{s}");
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no passthrough: {s}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn concurrent_random_reads_equal_the_source() {
    let (tmp, src) = fresh();
    let files = make_tree(&src);
    let m = Mount::new(
        tmp.path(),
        &src,
        &["--no-staging", "--no-passthrough", "--cache-size", "4M"],
    );
    let files = Arc::new(files);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (src, mnt, files) = (src.clone(), m.mnt.clone(), files.clone());
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                for _ in 0..150 {
                    let rel = &files[rng.random_range(0..files.len())];
                    let size = fs::metadata(src.join(rel)).unwrap().len();
                    let off = rng.random_range(0..=size);
                    let len = rng.random_range(0..300_000usize);
                    let want = {
                        let mut b = vec![0; len];
                        let n = fs::File::open(src.join(rel))
                            .unwrap()
                            .read_at(&mut b, off)
                            .unwrap();
                        b.truncate(n);
                        b
                    };
                    let mut f = fs::File::open(mnt.join(rel)).unwrap();
                    f.seek(SeekFrom::Start(off)).unwrap();
                    let mut got = Vec::new();
                    f.take(len as u64).read_to_end(&mut got).unwrap();
                    assert!(got == want, "{} at {off}+{len}", rel.display());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // A 4 MiB cache for a ~18 MiB tree: reads kept working while blocks were evicted.
    let s = m.stats();
    assert!(s["blocks_evicted"].as_u64().unwrap() > 0, "{s}");
    assert!(s["cache_used"].as_u64().unwrap() <= 4 << 20, "{s}");
}

fn writes_fail_with_erofs() {
    let (tmp, src) = fresh();
    make_tree(&src);
    let m = Mount::new(tmp.path(), &src, &[]);
    let erofs =
        |r: std::io::Result<()>| assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EROFS));
    erofs(fs::write(m.mnt.join("new"), b"x"));
    erofs(
        fs::OpenOptions::new()
            .write(true)
            .open(m.mnt.join("f3.bin"))
            .map(drop),
    );
    erofs(
        fs::OpenOptions::new()
            .append(true)
            .open(m.mnt.join("f3.bin"))
            .map(drop),
    );
    erofs(fs::create_dir(m.mnt.join("d")));
    erofs(fs::remove_file(m.mnt.join("f3.bin")));
    erofs(fs::rename(m.mnt.join("f3.bin"), m.mnt.join("g")));
    erofs(fs::set_permissions(
        m.mnt.join("f3.bin"),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    ));
    assert_eq!(
        fs::read(src.join("f3.bin")).unwrap().len(),
        4095,
        "source untouched"
    );
}

fn symlinks_are_shown_not_followed() {
    let (tmp, src) = fresh();
    make_tree(&src);
    let m = Mount::new(tmp.path(), &src, &[]);
    assert!(fs::symlink_metadata(m.mnt.join("abs-link"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        fs::read_link(m.mnt.join("abs-link")).unwrap(),
        Path::new("/etc/hostname")
    );
    // A relative link resolves inside the mount.
    assert_eq!(
        fs::read(m.mnt.join("a/link")).unwrap(),
        fs::read(src.join("a/b/f1.bin")).unwrap()
    );
}

fn source_changed_since_the_snapshot_is_estale_never_other_bytes() {
    let (tmp, src) = fresh();
    // Larger than the small files that cross-file prefetch caches whole.
    let size = 6 << 20;
    fs::write(src.join("f"), pattern(1, size)).unwrap();
    fs::write(src.join("g"), pattern(5, size)).unwrap();
    fs::write(src.join("gone"), pattern(7, size)).unwrap();
    let m = Mount::new(tmp.path(), &src, &["--no-staging", "--no-passthrough"]);
    assert_eq!(fs::read(m.mnt.join("f")).unwrap(), pattern(1, size));
    // A handle opened on the snapshot's version, part-read.
    let held = fs::File::open(m.mnt.join("g")).unwrap();
    let mut head = vec![0; 4096];
    held.read_exact_at(&mut head, 0).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    fs::write(src.join("f"), pattern(2, size)).unwrap();
    fs::write(src.join("g"), pattern(6, size)).unwrap();
    fs::remove_file(src.join("gone")).unwrap();
    // Snapshot semantics: the cached file still reads as the snapshot saw it (one version).
    assert!(fs::read(m.mnt.join("f")).unwrap() == pattern(1, size));
    // The uncached rest of the changed file: ESTALE, never the new bytes mixed in.
    let mut rest = vec![0; size - 4096];
    match held.read_exact_at(&mut rest, 4096) {
        Ok(()) => assert!(rest == pattern(5, size)[4096..], "mixed versions"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}"),
    }
    // The deleted file is still in the snapshot (same size); reading it is ESTALE.
    assert_eq!(fs::metadata(m.mnt.join("gone")).unwrap().len(), size as u64);
    let e = fs::read(m.mnt.join("gone")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}");
    let s = m.stats();
    assert!(
        s["errors"]
            .to_string()
            .contains("changed on the source since the snapshot"),
        "{s}"
    );
}

fn bytes_that_never_existed_after_a_remount_same_size_same_mtime_rewrite() {
    // Through a real mount: read 4 KiB with --no-staging, unmount, rewrite the
    // file in place with other bytes of the same size and set its mtime back (touch -r), remount:
    // `cat` must give ESTALE or the new bytes whole, never a mix of old cached and new blocks.
    let (tmp, src) = fresh();
    let size = 3 << 20;
    fs::write(src.join("f"), pattern(1, size)).unwrap();
    let mut m = Mount::new(tmp.path(), &src, &["--no-staging", "--no-passthrough"]);
    let mut head = vec![0; 4096];
    fs::File::open(m.mnt.join("f"))
        .unwrap()
        .read_exact_at(&mut head, 0)
        .unwrap();
    assert!(head == pattern(1, size)[..4096]);
    m.umount();
    let mtime = fs::metadata(src.join("f")).unwrap().modified().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let new = pattern(2, size);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(src.join("f"))
        .unwrap();
    f.write_all_at(&new, 0).unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    m.mount();
    match fs::read(m.mnt.join("f")) {
        Ok(got) => assert!(got == new, "the remount served bytes that never existed"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ESTALE), "{e}"),
    }
}

fn two_mounts_on_one_cache_the_second_is_refused() {
    // Regression: two mounts sharing a cache directory overwrote each other's blocks.
    let (tmp, src) = fresh();
    fs::write(src.join("f"), b"x").unwrap();
    let m = Mount::new(tmp.path(), &src, &[]);
    let mnt2 = tmp.path().join("mnt2");
    fs::create_dir(&mnt2).unwrap();
    let out = Command::new(BIN)
        .arg("mount")
        .arg(&src)
        .arg(&mnt2)
        .arg("--cache")
        .arg(&m.cache)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the second mount was accepted: {err}"
    );
    assert!(err.contains("in use by another mount"), "{err}");
    assert_eq!(fs::read(m.mnt.join("f")).unwrap(), b"x");
}

fn revalidate_shows_changes_made_while_mounted() {
    let (tmp, src) = fresh();
    fs::write(src.join("f"), pattern(1, 100_000)).unwrap();
    let m = Mount::new(
        tmp.path(),
        &src,
        &["--no-staging", "--no-passthrough", "--revalidate", "0.2"],
    );
    assert_eq!(fs::read(m.mnt.join("f")).unwrap(), pattern(1, 100_000));
    std::thread::sleep(Duration::from_millis(20));
    fs::write(src.join("f"), pattern(2, 120_000)).unwrap();
    fs::write(src.join("new"), b"fresh").unwrap();
    std::thread::sleep(Duration::from_millis(600));
    assert!(fs::read(m.mnt.join("f")).unwrap() == pattern(2, 120_000));
    assert_eq!(fs::read(m.mnt.join("new")).unwrap(), b"fresh");
}

fn corrupted_cache_block_is_detected_and_refetched() {
    let (tmp, src) = fresh();
    // Large (over 4 MiB): its copy is dropped block by block (a small copy is fetched again
    // whole: it is never changed in place).
    let data = pattern(3, 6 << 20);
    fs::write(src.join("f"), &data).unwrap();
    let mut m = Mount::new(tmp.path(), &src, &["--no-staging", "--no-passthrough"]);
    assert!(fs::read(m.mnt.join("f")).unwrap() == data);
    m.umount();
    let mut corrupted = 0;
    for f in fs::read_dir(m.cache.join("v2/files")).unwrap().flatten() {
        let file = fs::OpenOptions::new().write(true).open(f.path()).unwrap();
        file.write_all_at(b"CORRUPT", (1 << 20) + 5).unwrap();
        corrupted += 1;
    }
    assert_eq!(corrupted, 1, "one copy holds the file's blocks");
    m.mount();
    assert!(
        fs::read(m.mnt.join("f")).unwrap() == data,
        "corrupt cache bytes were served"
    );
    let s = m.stats();
    assert!(s["corrupt_blocks"].as_u64().unwrap() >= 1, "{s}");
    let from_source = s["bytes_from_source"].as_u64().unwrap();
    assert!(
        from_source > 0 && from_source <= 1 << 20,
        "only the bad block is re-fetched: {s}"
    );
}

/// A tmpfs of a given size mounted at a path (a scratch that fills up), unmounted on drop.
struct SmallScratch(PathBuf);

impl SmallScratch {
    fn mount(at: &Path, size: &str) -> SmallScratch {
        fs::create_dir(at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status()
            .unwrap();
        assert!(ok.success());
        SmallScratch(at.to_path_buf())
    }
}

impl Drop for SmallScratch {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn full_scratch_still_serves_every_read() {
    let (tmp, src) = fresh();
    let data = pattern(4, 12 << 20);
    fs::write(src.join("big"), &data).unwrap();
    let scratch = tmp.path().join("scratch");
    let _guard = SmallScratch::mount(&scratch, "3m");
    let mut m = Mount::with_cache(
        tmp.path(),
        &src,
        &scratch.join("cache"),
        &["--no-staging", "--no-passthrough", "--cache-size", "1G"],
    );
    for _ in 0..2 {
        assert!(
            fs::read(m.mnt.join("big")).unwrap() == data,
            "read failed with scratch full"
        );
    }
    let s = m.stats();
    assert!(s["cache_full_events"].as_u64().unwrap() >= 1, "{s}");
    m.umount();
}

/// Hardening round three: after one ENOSPC on scratch the cache's capacity ratcheted down to
/// what it held (then less, each time), for the rest of the mount, with a warning per failed
/// write. Now the capacity follows the space left, comes back as space frees, and the warning
/// is rate-limited; every block read back later is intact.
fn regression_one_enospc_capped_the_cache_for_the_rest_of_the_mount() {
    let (tmp, src) = fresh();
    let a = pattern(5, 8 << 20);
    let b = pattern(6, 6 << 20);
    fs::write(src.join("a"), &a).unwrap();
    fs::write(src.join("b"), &b).unwrap();
    let scratch = tmp.path().join("scratch");
    let _guard = SmallScratch::mount(&scratch, "16m");
    // Someone else's 11 MB leave about 5 MB for the cache.
    fs::write(scratch.join("filler"), vec![1u8; 11 << 20]).unwrap();
    let args = ["--no-staging", "--no-passthrough", "--cache-size", "1G"];
    let mut m = Mount::with_cache(tmp.path(), &src, &scratch.join("cache"), &args);
    assert!(
        fs::read(m.mnt.join("a")).unwrap() == a,
        "read with scratch full"
    );
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    assert!(
        fs::read(m.mnt.join("a")).unwrap() == a,
        "read again with scratch full"
    );
    let s = m.stats();
    assert!(s["cache_full_events"].as_u64().unwrap() >= 1, "{s}");
    // The other user's job ends; its space comes back to the cache.
    fs::remove_file(scratch.join("filler")).unwrap();
    std::thread::sleep(Duration::from_secs(6));
    assert!(fs::read(m.mnt.join("b")).unwrap() == b);
    let before = m.stats()["bytes_from_source"].as_u64().unwrap();
    // The second read must reach the daemon, not the kernel's page cache.
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    assert!(fs::read(m.mnt.join("b")).unwrap() == b);
    let s = m.stats();
    assert_eq!(
        s["bytes_from_source"].as_u64().unwrap(),
        before,
        "b was not kept once space freed: {s}"
    );
    m.umount();
    let log = fs::read_to_string(scratch.join("cache/stagefs.log")).unwrap_or_default();
    let warnings = log.matches("scratch is full").count();
    assert!((1..=3).contains(&warnings), "{warnings} warnings:\n{log}");
    // What was recorded reads back intact in a new mount.
    let mut m = Mount::with_cache(tmp.path(), &src, &scratch.join("cache"), &args);
    assert!(fs::read(m.mnt.join("a")).unwrap() == a);
    assert!(fs::read(m.mnt.join("b")).unwrap() == b);
    let s = m.stats();
    assert_eq!(s["corrupt_blocks"].as_u64().unwrap(), 0, "{s}");
    m.umount();
}

/// A remount was given 90 % of the space left on scratch as its capacity, not counting what
/// its own cache already held there: a cache that filled most of scratch got a fraction of
/// its size at the next mount and evicted itself (bench/mount/direct.sh's RAM scratch: 1.3 of
/// 4 GiB, every warm open refused as not staged). Now the cache's own files count as room.
fn regression_a_remount_on_a_nearly_full_scratch_evicted_its_own_cache() {
    let (tmp, src) = fresh();
    let files: Vec<Vec<u8>> = (0..4).map(|i| pattern(20 + i, 6 << 20)).collect();
    for (i, f) in files.iter().enumerate() {
        fs::write(src.join(format!("f{i}")), f).unwrap();
    }
    let scratch = tmp.path().join("scratch");
    let _guard = SmallScratch::mount(&scratch, "40m");
    let cache = scratch.join("cache");
    // Staged in full (24 MiB of 40), default capacity.
    let mut m = Mount::with_cache(tmp.path(), &src, &cache, &["--no-passthrough"]);
    for (i, f) in files.iter().enumerate() {
        assert!(fs::read(m.mnt.join(format!("f{i}"))).unwrap() == *f);
    }
    let held = m.stats()["cache_used"].as_u64().unwrap();
    m.umount();
    assert!(held >= 24 << 20, "staged {held} bytes");
    let mut m = Mount::with_cache(tmp.path(), &src, &cache, &["--no-passthrough"]);
    let s = m.stats();
    let capacity = s["cache_capacity"].as_u64().unwrap();
    assert!(
        capacity >= 24 << 20,
        "the remount's capacity is {capacity}: {s}"
    );
    fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    let before = s["bytes_from_source"].as_u64().unwrap();
    for (i, f) in files.iter().enumerate() {
        assert!(fs::read(m.mnt.join(format!("f{i}"))).unwrap() == *f);
    }
    let s = m.stats();
    assert_eq!(s["blocks_evicted"].as_u64().unwrap(), 0, "{s}");
    assert_eq!(s["bytes_from_source"].as_u64().unwrap(), before, "{s}");
    m.umount();
}

/// Waits until `pid` has exited (its state is Z or it is gone), at most 20 s.
fn wait_until_dead(pid: i32) {
    let stat = format!("/proc/{pid}/stat");
    for _ in 0..2000 {
        match fs::read_to_string(&stat) {
            Err(_) => return,
            Ok(s)
                if s.rsplit(')')
                    .next()
                    .is_some_and(|t| t.trim_start().starts_with('Z')) =>
            {
                return
            }
            Ok(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    panic!("pid {pid} still runs 20 s after SIGKILL");
}

fn killed_daemon_leaves_a_mount_that_umount_clears_and_remount_reuses_the_cache() {
    let (tmp, src) = fresh();
    make_tree(&src);
    let mut m = Mount::new(tmp.path(), &src, &["--no-staging", "--no-passthrough"]);
    assert_same_tree(&src, &m.mnt);
    let pid = m.stats()["pid"].as_i64().unwrap();
    // One header flush interval.
    std::thread::sleep(Duration::from_millis(2500));
    // SAFETY: sending SIGKILL to the daemon we started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    wait_until_dead(pid as i32);
    // (Entries, attributes and listings may still come from the kernel's caches; a name
    // never looked up goes to the dead daemon.) A dead daemon's connection answers ENOTCONN,
    // or ECONNABORTED where the kernel ends requests of an aborted connection with it
    // (FUSE_ABORT_ERROR; CI's kernel did so for this lookup).
    let err = fs::metadata(m.mnt.join("never-looked-up")).unwrap_err();
    assert!(
        matches!(
            err.raw_os_error(),
            Some(libc::ENOTCONN) | Some(libc::ECONNABORTED)
        ),
        "{err}"
    );
    // Mounting over the dead mount is refused with advice.
    let out = Command::new(BIN)
        .arg("mount")
        .arg(&src)
        .arg(&m.mnt)
        .arg("--cache")
        .arg(&m.cache)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("stagefs umount"),
        "{out:?}"
    );
    m.umount();
    m.mount();
    assert_same_tree(&src, &m.mnt);
    let s = m.stats();
    assert_eq!(
        s["bytes_from_source"], 0,
        "cache not reused after kill -9: {s}"
    );
    assert!(s["bytes_from_cache"].as_u64().unwrap() > 0, "{s}");
}

fn stats_file_and_stat_command_report_the_mount() {
    let (tmp, src) = fresh();
    make_tree(&src);
    let m = Mount::new(tmp.path(), &src, &["--no-staging", "--no-passthrough"]);
    fs::read(m.mnt.join("c/f8.bin")).unwrap();
    let s = m.stats();
    let served = s["bytes_from_source"].as_u64().unwrap() + s["bytes_from_cache"].as_u64().unwrap();
    assert_eq!(
        served,
        fs::metadata(src.join("c/f8.bin")).unwrap().len(),
        "{s}"
    );
    // The cache was empty: the bytes came by a demand miss or by read-ahead (which, with a
    // normal user's 128 KiB kernel read-ahead, can win the race for every block).
    assert!(
        s["block_misses"].as_u64().unwrap() >= 1 || s["bytes_prefetched"].as_u64().unwrap() > 0,
        "{s}"
    );
    assert_eq!(
        s["source"].as_str().unwrap(),
        fs::canonicalize(&src).unwrap().to_str().unwrap()
    );
    let out = Command::new(BIN).arg("stat").arg(&m.mnt).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("verdict"), "{text}");
    assert!(text.contains("from source"), "{text}");
    // Every byte read from the source, whatever asked for it: exactly the file's blocks here.
    let read = s["source_bytes_read"].as_u64().unwrap();
    assert_eq!(
        read,
        fs::metadata(src.join("c/f8.bin")).unwrap().len(),
        "{s}"
    );
    assert!(text.contains("from the source in all"), "{text}");
}

fn mount_errors_are_clear() {
    let (tmp, src) = fresh();
    let run = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let mnt = tmp.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let cache = tmp.path().join("cache");
    let (s, m, c) = (
        src.to_str().unwrap(),
        mnt.to_str().unwrap(),
        cache.to_str().unwrap(),
    );
    assert!(run(&["mount", "/nonexistent/data", m, "--cache", c]).contains("/nonexistent/data"));
    assert!(run(&["mount", s, "/nonexistent/mnt", "--cache", c]).contains("mkdir -p"));
    let _busy = Mount::new(tmp.path(), &src, &[]);
    assert!(run(&["mount", s, m, "--cache", c]).contains("already a mountpoint"));
}

fn unprivileged_user_mounts_through_fusermount3() {
    let uid = match Command::new("id").args(["-u", "stagefs-test"]).output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .trim()
            .parse::<u32>()
            .unwrap(),
        _ => 65534,
    };
    let (tmp, src) = fresh();
    make_tree(&src);
    // The binary and the tree must be reachable by that user.
    let bin = tmp.path().join("stagefs");
    fs::copy(BIN, &bin).unwrap();
    let chown = Command::new("chown")
        .arg("-R")
        .arg(format!("{uid}:{uid}"))
        .arg(tmp.path())
        .status()
        .unwrap();
    assert!(chown.success());
    let mnt = tmp.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    std::os::unix::fs::chown(&mnt, Some(uid), Some(uid)).unwrap();
    let as_user = |args: &[&str]| {
        let mut c = Command::new("setpriv");
        c.args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
        ])
        .args(args);
        c.env("HOME", tmp.path());
        c.output().unwrap()
    };
    let (b, s, m, c) = (
        bin.to_str().unwrap(),
        src.to_str().unwrap(),
        mnt.to_str().unwrap(),
        tmp.path().join("cache"),
    );
    let out = as_user(&[b, "mount", s, m, "--cache", c.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "user mount failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let check = format!(
        "cd {s} && find . -type f | sort | while read f; do cmp \"$f\" \"{m}/$f\" || exit 1; done && \
         test \"$(readlink {m}/a/link)\" = b/f1.bin && grep -q bytes_from_source {m}/.stagefs/stats"
    );
    let out = as_user(&["sh", "-c", &check]);
    let umount = as_user(&[b, "umount", m]);
    assert!(
        out.status.success(),
        "user reads differ: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        umount.status.success(),
        "user umount failed: {}",
        String::from_utf8_lossy(&umount.stderr)
    );
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(m), "still mounted");
}

/// Regression: open() held the backing-id lock while taking the handle map, and release()
/// the reverse (an `if let` kept its guard alive), so concurrent opens and closes of cached
/// small files under passthrough deadlocked the mount.
fn regression_concurrent_open_release_of_cached_files_does_not_deadlock() {
    let (tmp, src) = fresh();
    for i in 0..200 {
        fs::write(src.join(format!("f{i:03}")), pattern(i, 5000 + i as usize)).unwrap();
    }
    let mut m = Mount::new(tmp.path(), &src, &[]);
    m.wait_stats("staging", |s| s["files_staged"].as_u64() == Some(200));
    m.umount();
    m.mount();
    let (tx, rx) = std::sync::mpsc::channel();
    for t in 0..8u64 {
        let (mnt, tx) = (m.mnt.clone(), tx.clone());
        // A reader's failure is sent, not panicked: a panic here would only show as a hang.
        std::thread::spawn(move || {
            let check = || -> Result<(), String> {
                for round in 0..5u64 {
                    for i in 0..200u64 {
                        let i = (i * 7 + t * 13 + round) % 200;
                        let p = mnt.join(format!("f{i:03}"));
                        let got = fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
                        if got != pattern(i, 5000 + i as usize) {
                            return Err(format!("{}: other bytes", p.display()));
                        }
                    }
                }
                Ok(())
            };
            let _ = tx.send(check());
        });
    }
    for _ in 0..8 {
        let done = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("readers hung: open/release deadlock");
        if let Err(e) = done {
            panic!("a reader failed: {e}");
        }
    }
}

fn mount_from_an_index_lists_nothing_on_the_source() {
    let (tmp, src) = fresh();
    make_tree(&src);
    let index = tmp.path().join("tree.stagefs-index");
    let out = Command::new(BIN)
        .arg("index")
        .arg(&src)
        .arg("-o")
        .arg(&index)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m = Mount::new(
        tmp.path(),
        &src,
        &["--index", index.to_str().unwrap(), "--no-staging"],
    );
    assert_same_tree(&src, &m.mnt);
    let s = m.stats();
    assert_eq!(s["snapshot"], "index", "{s}");
    assert_eq!(
        s["metadata_requests"], 0,
        "mount --index listed the source: {s}"
    );
}

fn kill_9_under_eight_readers_then_remount_serves_exact_bytes() {
    let (tmp, src) = fresh();
    let n = 400u64;
    for i in 0..n {
        let d = src.join(format!("c{}", i % 8));
        fs::create_dir_all(&d).unwrap();
        fs::write(
            d.join(format!("{i:04}")),
            pattern(i, 20_000 + (i as usize * 977) % 90_000),
        )
        .unwrap();
    }
    let mut m = Mount::new(tmp.path(), &src, &["--no-passthrough"]);
    let pid = m.stats()["pid"].as_i64().unwrap();
    let readers: Vec<_> = (0..8u64)
        .map(|t| {
            let mnt = m.mnt.clone();
            std::thread::spawn(move || {
                // Read until the daemon dies under us; whatever was read is exact.
                for k in 0..n {
                    let i = (k * 7 + t * 53) % n;
                    let p = mnt.join(format!("c{}/{i:04}", i % 8));
                    match fs::read(&p) {
                        Ok(b) => assert!(b == pattern(i, 20_000 + (i as usize * 977) % 90_000)),
                        Err(e) => {
                            // The daemon is gone: requests in flight are aborted, later ones
                            // find the connection down.
                            let code = e.raw_os_error();
                            assert!(
                                code == Some(libc::ENOTCONN) || code == Some(libc::ECONNABORTED),
                                "{e}"
                            );
                            return;
                        }
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: sending SIGKILL to the daemon we started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    for r in readers {
        r.join().unwrap();
    }
    m.umount();
    m.mount();
    for i in 0..n {
        let p = m.mnt.join(format!("c{}/{i:04}", i % 8));
        assert!(
            fs::read(&p).unwrap() == pattern(i, 20_000 + (i as usize * 977) % 90_000),
            "{}",
            p.display()
        );
    }
    assert_eq!(m.stats()["error_count"], 0);
}

/// A reader walking a directory in order on a warm cache (a DataLoader in ImageFolder order,
/// `tar`, `cp`) is served from pages the daemon pushed ahead of it: fewer read requests than
/// files, every byte equal.
fn in_order_reader_on_a_warm_cache_is_served_from_pushed_pages() {
    let (tmp, src) = fresh();
    fs::create_dir(src.join("d")).unwrap();
    let n = 400u64;
    let len = |i: u64| 3000 + (i * 7919 % 20_000) as usize;
    for i in 0..n {
        fs::write(src.join(format!("d/f{i:04}")), pattern(i, len(i))).unwrap();
    }
    let mut m = Mount::new(tmp.path(), &src, &[]);
    m.wait_stats("staging", |s| s["files_staged"].as_u64() == Some(n));
    m.umount();
    // Paths opened from a list, the directory never listed: the kernel holds no inode of the
    // files ahead, so almost nothing is pushed. Not exactly nothing: the reader looks up file
    // i+1 before it opens it, and a walker that gets to i+1 in that gap finds the inode held
    // and pushes it, rightly (CI saw 1 of 200 as a normal user under load).
    m.mount();
    for i in 0..n / 2 {
        let got = fs::read(m.mnt.join(format!("d/f{i:04}"))).unwrap();
        assert!(got == pattern(i, len(i)), "file {i} differs");
    }
    let s = m.stats();
    assert!(s["files_pushed"].as_u64().unwrap() <= n / 40, "{s}");
    m.umount();
    // Listed first, as ImageFolder does: the files ahead of the reader are pushed.
    m.mount();
    assert_eq!(fs::read_dir(m.mnt.join("d")).unwrap().count() as u64, n);
    for i in 0..n {
        let got = fs::read(m.mnt.join(format!("d/f{i:04}"))).unwrap();
        assert!(got == pattern(i, len(i)), "file {i} differs");
    }
    let s = m.stats();
    assert!(s["files_pushed"].as_u64().unwrap() >= 50, "{s}");
    assert!(
        s["reads"].as_u64().unwrap() < n,
        "every file was asked for: {s}"
    );
    assert_eq!(s["error_count"], 0, "{s}");
}

/// Regression: with opens skipped, the stats file was rendered afresh for the size and for
/// every read request, so a reader got the size of one rendering and bytes of others (torn
/// JSON under activity). Read in small pieces while eight threads read the tree.
fn regression_stats_read_in_pieces_under_activity_is_valid_json() {
    let (tmp, src) = fresh();
    let files = make_tree(&src);
    // No passthrough: as root it would keep opens, and with them a rendering per open.
    let m = Mount::new(tmp.path(), &src, &["--no-passthrough"]);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..8)
        .map(|_| {
            let (stop, mnt, files) = (stop.clone(), m.mnt.clone(), files.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for f in &files {
                        let _ = fs::read(mnt.join(f));
                    }
                }
            })
        })
        .collect();
    for _ in 0..200 {
        let mut f = fs::File::open(m.mnt.join(".stagefs/stats")).unwrap();
        let (mut all, mut buf) = (Vec::new(), [0u8; 512]);
        loop {
            let n = f.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
        }
        if let Err(e) = serde_json::from_slice::<serde_json::Value>(&all) {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            panic!("torn stats ({e}): {}", String::from_utf8_lossy(&all));
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
}

/// Regression: renders held the FUSE threads, so twelve slow view reads made an `ls` of
/// an unrelated folder wait for them (29 s with twelve 4-CPU-s JPEGs), `stagefs umount` hung on
/// the stats file, and the daemon could not end while it rendered. Here the slow inputs are CSV
/// tables whose views take seconds each to render in a debug build (the whole file is parsed),
/// read by twelve `cat` processes at once: more than the FUSE threads.
fn regression_slow_renders_do_not_starve_an_unrelated_listing_or_umount() {
    let (tmp, src) = fresh();
    fs::create_dir_all(src.join("tables")).unwrap();
    fs::create_dir_all(src.join("other/deep")).unwrap();
    fs::write(src.join("other/deep/x"), b"x").unwrap();
    let rows: String = (0..100_000)
        .map(|i| format!("{},{},{}\n", i as f64 * 0.5, i, i % 7))
        .collect();
    const TABLES: usize = 12;
    for k in 0..TABLES {
        fs::write(
            src.join(format!("tables/t{k}.csv")),
            format!("a,b,c\n{rows}{rows}"),
        )
        .unwrap();
    }
    let mut m = Mount::new(tmp.path(), &src, &[]);
    let pid = m.stats()["pid"].as_u64().unwrap() as i32;
    let readers: Vec<_> = (0..TABLES)
        .map(|k| {
            Command::new("cat")
                .arg(m.mnt.join(format!(".npy/tables/t{k}.csv/features.npy")))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    let listed: Vec<_> = fs::read_dir(m.mnt.join("other"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let stats = m.stats();
    let waited = t0.elapsed();
    let mut readers = readers;
    let still_rendering = readers
        .iter_mut()
        .filter_map(|c| c.try_wait().unwrap().is_none().then_some(()))
        .count();
    assert_eq!(listed, vec![std::ffi::OsString::from("deep")]);
    assert!(
        still_rendering > 0,
        "the renders ended before the listing: the inputs are too small to test anything"
    );
    assert!(
        waited < Duration::from_secs(2),
        "an unrelated listing and the stats file waited {waited:?} behind {still_rendering} renders: {stats}"
    );
    // The readers are killed (a cancelled job). Each still waits for the answer to the request
    // the daemon has already taken (the kernel waits it out; fuser passes no FUSE_INTERRUPT on),
    // then the unmount, which reads the stats file first, and the daemon's exit are prompt.
    for mut c in readers {
        let _ = c.kill();
        let _ = c.wait();
    }
    let t1 = std::time::Instant::now();
    m.umount();
    // SAFETY: kill with signal 0 only checks that the process exists.
    while unsafe { libc::kill(pid, 0) } == 0 && t1.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        t1.elapsed() < Duration::from_secs(10),
        "umount and the daemon's exit took {:?} while renders ran",
        t1.elapsed()
    );
}

/// A sequential reader of a large cached file gets it pushed into the page cache
/// ahead of it (one request per push window instead of eight per MiB), byte-exact; readers in
/// other orders (backwards, random offsets, mmap, several at once) are served byte-exact too;
/// and a corrupted scratch block is never pushed (nor served).
fn large_file_reads_are_exact_in_every_order_and_sequential_ones_are_pushed() {
    let (tmp, src) = fresh();
    const MB: usize = 1 << 20;
    let data = Arc::new(pattern(20, 40 * MB + 12_345));
    fs::write(src.join("big.bin"), &*data).unwrap();
    // The unprivileged path, also as root (passthrough would serve cached files in the kernel);
    // pushes ahead of streaming readers are a lever, on here to be tested.
    let mut m = Mount::new(tmp.path(), &src, &["--no-passthrough", "--push-ahead"]);
    m.wait_stats("staging", |s| s["files_staged"].as_u64() == Some(1));
    m.umount();
    let path = m.mnt.join("big.bin");
    let read_seq = |path: &Path| {
        let mut f = fs::File::open(path).unwrap();
        let mut got = Vec::new();
        let mut buf = vec![0u8; MB];
        loop {
            let n = f.read(&mut buf).unwrap();
            if n == 0 {
                break got;
            }
            got.extend_from_slice(&buf[..n]);
        }
    };
    // In order: pushed.
    m.mount();
    assert!(read_seq(&path) == *data, "sequential read differs");
    let s = m.stats();
    let pushed = s["bytes_pushed"].as_u64().unwrap();
    // How much is pushed depends on the race with the reader: the pushers skip the blocks it
    // has asked for already (root's 1 MiB read-ahead often gets there first; CI saw 29 of 40
    // MiB pushed). None at all would mean no pushing.
    assert!(pushed >= 4 * MB as u64, "too little pushed: {s}");
    // A normal user's 128 KiB kernel read-ahead: 324 requests without pushes. How many fewer
    // depends on whether the pushers (slow in a debug build) stay ahead of the reader, so only
    // "fewer" is asserted; the figure is bench/mount/large.sh's.
    assert!(
        s["reads"].as_u64().unwrap() < 324,
        "every piece was asked for: {s}"
    );
    m.umount();
    // Backwards, random offsets and mmap, on a fresh page cache each.
    m.mount();
    let f = fs::File::open(&path).unwrap();
    let mut off = data.len();
    while off > 0 {
        let lo = off.saturating_sub(MB + 4321);
        let mut buf = vec![0u8; off - lo];
        f.read_exact_at(&mut buf, lo as u64).unwrap();
        assert!(buf == data[lo..off], "backwards read at {lo} differs");
        off = lo;
    }
    drop(f);
    m.umount();
    m.mount();
    let f = fs::File::open(&path).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(20);
    for _ in 0..200 {
        let lo = rng.random_range(0..data.len());
        let len = rng.random_range(1..4 * MB).min(data.len() - lo);
        let mut buf = vec![0u8; len];
        f.read_exact_at(&mut buf, lo as u64).unwrap();
        assert!(buf == data[lo..lo + len], "random read at {lo} differs");
    }
    drop(f);
    m.umount();
    // mmap rows in random order (np.load(mmap_mode="r") with shuffled rows): every byte
    // exact, and the rest of each block a fault touches is pushed, so most faults find their
    // pages. A normal user's faults read 128 KiB around them: 321 requests or more without
    // the pushes, ~30 with. Root's mount raises the read-ahead to 1 MiB (54 requests without
    // pushes), so the count is only telling for a normal user (CI's second run).
    m.mount();
    let rows = mmap_rows_in_random_order(&path, &src.join("big.bin"));
    assert_eq!(rows, "ok 641", "mmap rows differ");
    let s = m.stats();
    if is_root() {
        eprintln!("skipped: the mmap request count needs a normal user's 128 KiB read-ahead");
    } else {
        assert!(
            s["reads"].as_u64().unwrap() < 162,
            "no block rest was pushed: {s}"
        );
    }
    m.umount();
    m.mount();
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import mmap,sys,hashlib; f=open(sys.argv[1],'rb'); \
             m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ); print(hashlib.sha256(m).hexdigest())",
        )
        .arg(&path)
        .output()
        .unwrap();
    let local = Command::new("sha256sum")
        .arg(src.join("big.bin"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&local.stdout)
            .split(' ')
            .next()
            .unwrap(),
        "mmap read differs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    m.umount();
    // Four processes at once, in order (pushes racing the readers' own requests).
    m.mount();
    let readers: Vec<_> = (0..4)
        .map(|_| Command::new("sha256sum").arg(&path).output().unwrap())
        .collect();
    for r in readers {
        assert_eq!(
            r.stdout.split(|b| *b == b' ').next(),
            local.stdout.split(|b| *b == b' ').next()
        );
    }
    m.umount();
    // A corrupted block of the cached copy is neither pushed nor served. Large files are kept
    // as exact copies, one scratch file each, under files/.
    let corrupt = |cache: &Path| {
        let mut corrupted = 0;
        for f in fs::read_dir(cache.join("v2/files")).unwrap().flatten() {
            if f.metadata().unwrap().len() >= 40 * MB as u64 {
                let file = fs::OpenOptions::new().write(true).open(f.path()).unwrap();
                file.write_all_at(b"CORRUPT", (5 * MB + 77) as u64).unwrap();
                corrupted += 1;
            }
        }
        assert_eq!(corrupted, 1, "one scratch file holds the large file");
    };
    corrupt(&m.cache);
    m.mount();
    assert_eq!(
        mmap_rows_in_random_order(&path, &src.join("big.bin")),
        "ok 641",
        "a corrupt block's rest was pushed or its rows served"
    );
    assert!(m.stats()["corrupt_blocks"].as_u64().unwrap() >= 1);
    m.umount();
    // Corrupted again for the streaming reader's pushes.
    corrupt(&m.cache);
    m.mount();
    assert!(
        read_seq(&path) == *data,
        "a corrupt block was pushed or served"
    );
    let s = m.stats();
    assert!(s["corrupt_blocks"].as_u64().unwrap() >= 1, "{s}");
}

/// Touches 64 KiB rows of `path` through `mmap` in a random order and compares each with
/// `source`: "ok ROWS", or the first row that differs.
fn mmap_rows_in_random_order(path: &Path, source: &Path) -> String {
    let out = common::output_ok(
        Command::new("python3")
            .arg("-c")
            .arg(
                "import mmap,random,sys\n\
             f=open(sys.argv[1],'rb'); m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ)\n\
             src=open(sys.argv[2],'rb').read(); row=65536\n\
             rows=list(range(0,len(m),row)); random.Random(20).shuffle(rows)\n\
             bad=[r for r in rows if m[r:r+row]!=src[r:r+row]]\n\
             print(f'differs at {bad[0]}' if bad else f'ok {len(rows)}')",
            )
            .arg(path)
            .arg(source),
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Regression (found by the Loader's hint tests): as root, concurrent opens of a large cached
/// file failed with EIO. Some opens got passthrough (entry verified) while others were still
/// open through the daemon, and the kernel keeps one I/O mode per inode: mixing them is EIO.
fn regression_concurrent_opens_of_a_cached_large_file_never_mix_passthrough_and_cache() {
    let (tmp, src) = fresh();
    let data = pattern(21, 64 << 20);
    fs::write(src.join("big.bin"), &data).unwrap();
    let mut m = Mount::new(tmp.path(), &src, &[]);
    m.wait_stats("staging", |s| s["files_staged"].as_u64() == Some(1));
    // A fresh mount: the cached copy is verified at its first open, off the read path, so that
    // first open is served by the daemon (page-cache mode) while later ones could get passthrough.
    m.umount();
    m.mount();
    let path = m.mnt.join("big.bin");
    let read_all = |f: &fs::File| -> Result<(), String> {
        let mut buf = vec![0u8; 1 << 20];
        for (i, want) in data.chunks(1 << 20).enumerate() {
            let n = f
                .read_at(&mut buf[..want.len()], (i << 20) as u64)
                .map_err(|e| format!("read at {i} MiB failed: {e}"))?;
            if buf[..n] != *want {
                return Err(format!("bytes differ at {i} MiB"));
            }
        }
        Ok(())
    };
    let first = fs::File::open(&path).unwrap();
    read_all(&first).unwrap();
    // Verification done meanwhile (waited for on the counters, not on time); the first handle
    // is still open in page-cache mode.
    m.wait_stats_now("the copy verified", |s| {
        s["copies_verified"].as_u64().unwrap_or(0) + s["copies_trusted"].as_u64().unwrap_or(0) >= 1
    });
    let second = fs::File::open(&path).unwrap();
    if let Err(e) = read_all(&second) {
        panic!(
            "a second open beside a daemon-served one: {e}: {}",
            m.stats()
        );
    }
    drop((first, second));
    // All closed: the next opens may use passthrough, and share it.
    let (third, fourth) = (
        fs::File::open(&path).unwrap(),
        fs::File::open(&path).unwrap(),
    );
    read_all(&third).unwrap();
    read_all(&fourth).unwrap();
    assert!(
        m.stats()["passthrough_opens"].as_u64().unwrap() >= 1,
        "{}",
        m.stats()
    );
}

/// CI (root, load 23): `stagefs umount` right after the test's last read failed "busy",
/// although the test had closed everything (a process that has just closed or exited, or a
/// forked child not yet exec'd, can hold the mount for a moment). A mount whose last user
/// goes away within the grace period is unmounted; one still in use fails with the advice.
fn regression_umount_right_after_the_last_close_is_not_refused_as_busy() {
    let (tmp, src) = fresh();
    make_tree(&src);
    let mut m = Mount::new(tmp.path(), &src, &["--no-staging"]);
    // A regular file of the mount (not a symlink, whose target may lie elsewhere).
    let name = fs::read_dir(&m.mnt)
        .unwrap()
        .map(|e| e.unwrap())
        .find(|e| e.file_type().unwrap().is_file())
        .expect("a file at the root of the tree")
        .path();
    // Still in use for the whole grace period: refused, with what to do.
    let held = fs::File::open(&name).unwrap();
    let out = m.command(BIN).arg("umount").arg(&m.mnt).output().unwrap();
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("busy") && err.contains("--lazy"), "{err}");
    // Its user goes away a moment after the unmount begins: unmounted.
    let closer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        drop(held);
    });
    m.umount();
    closer.join().unwrap();
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let at = format!(" {} ", m.mnt.display());
    assert!(!mounts.contains(&at), "still mounted: {mounts}");
}

/// Regression: the daemon's caches of open descriptors (1,088 at full size: source files and
/// directories, its copies and their direct-read twins) were sized without the descriptor
/// limit, and every small file is a copy of its own, so under a normal user's soft limit of
/// 1024 opens failed with EMFILE after some hundreds of files (CI, the unprivileged run).
/// Under a hard limit of 256, which the daemon cannot raise, 1500 small files read back exact,
/// cold and warm, and no error is counted.
fn regression_a_low_descriptor_limit_fails_no_read_with_emfile() {
    let (tmp, src) = fresh();
    let n = 1500u64;
    let len = |i: u64| 2000 + (i as usize * 37) % 3000;
    for i in 0..n {
        let d = src.join(format!("d{:02}", i / 100));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join(format!("f{i:04}")), pattern(i, len(i))).unwrap();
    }
    let m = Mount::under(
        tmp.path(),
        &src,
        &tmp.path().join("cache"),
        &["--no-passthrough"],
        &["prlimit", "--nofile=256:256"],
    );
    for pass in ["cold", "warm"] {
        for i in 0..n {
            let p = m.mnt.join(format!("d{:02}/f{i:04}", i / 100));
            let got = fs::read(&p).unwrap_or_else(|e| panic!("{pass} {}: {e}", p.display()));
            assert!(
                got == pattern(i, len(i)),
                "{pass}: bytes of {}",
                p.display()
            );
        }
    }
    let s = m.stats();
    assert_eq!(s["error_count"], 0, "{s}");
}

fn main() -> std::process::ExitCode {
    stagefs_test_support::run(vec![
        test!(mounted_tree_matches_source_cold_and_warm, Need::Fuse),
        test!(concurrent_random_reads_equal_the_source, Need::Fuse),
        test!(writes_fail_with_erofs, Need::Fuse),
        test!(symlinks_are_shown_not_followed, Need::Fuse),
        test!(
            source_changed_since_the_snapshot_is_estale_never_other_bytes,
            Need::Fuse
        ),
        test!(revalidate_shows_changes_made_while_mounted, Need::Fuse),
        test!(corrupted_cache_block_is_detected_and_refetched, Need::Fuse),
        test!(full_scratch_still_serves_every_read, Need::Fuse, Need::Root),
        test!(
            regression_one_enospc_capped_the_cache_for_the_rest_of_the_mount,
            Need::Fuse,
            Need::Root
        ),
        test!(
            regression_a_remount_on_a_nearly_full_scratch_evicted_its_own_cache,
            Need::Fuse,
            Need::Root
        ),
        test!(
            killed_daemon_leaves_a_mount_that_umount_clears_and_remount_reuses_the_cache,
            Need::Fuse
        ),
        test!(stats_file_and_stat_command_report_the_mount, Need::Fuse),
        test!(mount_errors_are_clear, Need::Fuse),
        test!(
            unprivileged_user_mounts_through_fusermount3,
            Need::Fuse,
            Need::Root,
            Need::Accounts,
            Need::UserFuse
        ),
        test!(
            regression_concurrent_open_release_of_cached_files_does_not_deadlock,
            Need::Fuse
        ),
        test!(mount_from_an_index_lists_nothing_on_the_source, Need::Fuse),
        test!(
            kill_9_under_eight_readers_then_remount_serves_exact_bytes,
            Need::Fuse
        ),
        test!(
            in_order_reader_on_a_warm_cache_is_served_from_pushed_pages,
            Need::Fuse
        ),
        test!(
            regression_stats_read_in_pieces_under_activity_is_valid_json,
            Need::Fuse
        ),
        test!(
            regression_slow_renders_do_not_starve_an_unrelated_listing_or_umount,
            Need::Fuse
        ),
        test!(
            large_file_reads_are_exact_in_every_order_and_sequential_ones_are_pushed,
            Need::Fuse
        ),
        test!(
            bytes_that_never_existed_after_a_remount_same_size_same_mtime_rewrite,
            Need::Fuse
        ),
        test!(two_mounts_on_one_cache_the_second_is_refused, Need::Fuse),
        test!(
            regression_a_low_descriptor_limit_fails_no_read_with_emfile,
            Need::Fuse
        ),
        test!(
            regression_umount_right_after_the_last_close_is_not_refused_as_busy,
            Need::Fuse
        ),
        test!(
            regression_concurrent_opens_of_a_cached_large_file_never_mix_passthrough_and_cache,
            Need::Fuse,
            Need::Root
        ),
    ])
}
