//! The filesystem core driven directly, without a kernel mount, over an injected source.
#![allow(missing_docs, clippy::unwrap_used)]

mod support;

use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use stagefs_fs::snapshot::{ScanOptions, Snapshot};
use stagefs_fs::FsError;
use stagefs_prefetch::{FileKind, LocalSource};
use support::*;

fn tree(src: &std::path::Path) {
    fs::create_dir_all(src.join("d/e")).unwrap();
    fs::write(src.join("d/x.txt"), b"hello world").unwrap();
    fs::write(src.join("d/e/small.bin"), pattern(1, 150_000)).unwrap();
    fs::write(src.join("big"), pattern(2, (3 << 20) + 777)).unwrap();
    fs::write(src.join("large"), pattern(3, (9 << 20) + 5)).unwrap();
    fs::write(src.join("empty"), b"").unwrap();
    std::os::unix::fs::symlink("../etc", src.join("d/up")).unwrap();
}

fn setup() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    tree(&src);
    let cache = tmp.path().join("cache");
    (tmp, src, cache)
}

#[test]
fn lookup_getattr_readdir_read_match_the_source() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let d = lookup(&c, &rel("d")).unwrap();
    assert_eq!(d.kind, FileKind::Dir);
    let x = lookup(&c, &rel("d/x.txt")).unwrap();
    assert_eq!((x.kind, x.size), (FileKind::File, 11));
    assert_eq!(c.getattr(x.ino).unwrap(), x);
    assert_eq!(read(&c, &rel("d/x.txt"), 6, 100, 4096).unwrap(), b"world");
    for (p, seed, len) in [("big", 2, (3 << 20) + 777), ("large", 3, (9 << 20) + 5)] {
        let want = pattern(seed, len);
        assert!(
            read(&c, &rel(p), 0, len as u64, 128 << 10).unwrap() == want,
            "{p}"
        );
        // A read straddling a block boundary.
        let got = read(&c, &rel(p), (1 << 20) - 10, 20, 20).unwrap();
        assert_eq!(got, &want[(1 << 20) - 10..(1 << 20) + 10]);
    }
    assert!(read(&c, &rel("empty"), 0, 10, 10).unwrap().is_empty());
    let up = lookup(&c, &rel("d/up")).unwrap();
    assert_eq!(c.readlink(up.ino).unwrap(), b"../etc");
    assert!(matches!(lookup(&c, &rel("d/nope")), Err(FsError::NotFound)));
    c.shutdown();
}

#[test]
fn virtual_dirs_are_reachable_but_not_listed_in_the_root() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let root = names(&c, &rel(""), 100).unwrap();
    assert_eq!(root, ["big", "d", "empty", "large"]);
    assert!(lookup(&c, &rel(".stagefs/stats")).is_ok());
    assert_eq!(lookup(&c, &rel(".npy")).unwrap().kind, FileKind::Dir);
    // Listing in small chunks resumes where it stopped.
    assert_eq!(names(&c, &rel("d"), 1).unwrap(), ["e", "up", "x.txt"]);
    c.shutdown();
}

#[test]
fn writes_fail_with_erofs() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let x = lookup(&c, &rel("d/x.txt")).unwrap();
    assert!(matches!(c.open(x.ino, true, false), Err(FsError::ReadOnly)));
    assert_eq!(FsError::ReadOnly.errno(), libc::EROFS);
    c.shutdown();
}

#[test]
fn remount_lists_nothing_and_serves_from_the_cache() {
    let (_t, src, cache) = setup();
    let (c, s1) = mount(config(&src, &cache));
    for p in ["d/x.txt", "d/e/small.bin", "big", "large"] {
        read(&c, &rel(p), 0, 20 << 20, 1 << 20).unwrap();
    }
    assert!(s1.metadata_calls() > 0);
    c.shutdown();
    let (c, s2) = mount(config(&src, &cache));
    for p in ["d/x.txt", "d/e/small.bin", "big", "large"] {
        read(&c, &rel(p), 0, 20 << 20, 1 << 20).unwrap();
    }
    assert_eq!(names(&c, &rel("d"), 100).unwrap().len(), 3);
    // One stat, of the root (is it still the tree the kept snapshot is of?), and no listing.
    assert_eq!(
        (
            s2.stats.load(SeqCst),
            s2.lists.load(SeqCst),
            s2.links.load(SeqCst)
        ),
        (1, 0, 0),
        "a remount listed or statted the source beyond its root"
    );
    assert_eq!(s2.reads.load(SeqCst), 0, "a remount re-read cached data");
    c.shutdown();
}

#[test]
fn mount_from_an_index_file_lists_nothing() {
    let (tmp, src, cache) = setup();
    let index = tmp.path().join("ds.stagefs-index");
    let canon = fs::canonicalize(&src).unwrap();
    let snap = Snapshot::scan(
        std::sync::Arc::new(LocalSource::new(&canon).unwrap()),
        &canon,
        ScanOptions::default(),
    )
    .unwrap();
    snap.save(&index).unwrap();
    let mut cfg = config(&src, &cache);
    cfg.index = Some(index.clone());
    let (c, s) = mount(cfg);
    assert_eq!(
        read(&c, &rel("d/x.txt"), 0, 100, 100).unwrap(),
        b"hello world"
    );
    assert_eq!(names(&c, &rel("d/e"), 100).unwrap(), ["small.bin"]);
    assert_eq!(s.metadata_calls(), 0, "mount --index listed the source");
    c.shutdown();
    // An index of another directory is refused, saying which.
    let other = tmp.path().join("other");
    fs::create_dir(&other).unwrap();
    let mut cfg = config(&other, &tmp.path().join("cache2"));
    cfg.index = Some(index);
    let err = stagefs_fs::FsCore::with_source(cfg, Counting::new(&other))
        .err()
        .unwrap();
    assert!(err.to_string().contains("is an index of"), "{err}");
}

#[test]
fn file_changed_since_the_snapshot_fails_with_estale_never_other_bytes() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    assert_eq!(read(&c, &rel("d/x.txt"), 0, 5, 5).unwrap(), b"hello");
    // Cached bytes are the snapshot's version; an uncached file that changed is ESTALE.
    fs::write(src.join("big"), pattern(99, (3 << 20) + 777)).unwrap();
    let e = read(&c, &rel("big"), 0, 1 << 20, 1 << 20).unwrap_err();
    assert_eq!(e.errno(), libc::ESTALE);
    let stats = c.stats_json();
    assert!(
        stats.contains("changed on the source since the snapshot"),
        "{stats}"
    );
    c.shutdown();
}

/// Rewrites `path` in place (same inode, same size) with `data`, then sets its mtime back to
/// what it was, as `touch -r` would: only the ctime tells the new contents from the old.
fn rewrite_in_place_keeping_size_and_mtime(path: &std::path::Path, data: &[u8]) {
    use std::io::Write;
    let before = fs::symlink_metadata(path).unwrap();
    assert_eq!(before.len(), data.len() as u64);
    // The ctime clock must move past the original's (coarse on some filesystems).
    std::thread::sleep(Duration::from_millis(20));
    let mut f = fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all(data).unwrap();
    f.set_modified(before.modified().unwrap()).unwrap();
    drop(f);
    let after = fs::symlink_metadata(path).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        (after.ino(), after.len(), after.modified().unwrap()),
        (before.ino(), before.len(), before.modified().unwrap()),
        "the rewrite must keep inode, size and mtime"
    );
}

#[test]
fn bytes_that_never_existed_after_a_remount_same_size_same_mtime_rewrite() {
    // Read the first 4 KiB (cached), unmount, rewrite in place with other
    // bytes of the same size and restore the mtime, remount: the old cached block and the new
    // source blocks must never be served together.
    let (_t, src, cache) = setup();
    let len = (3 << 20) + 777;
    let (c, _) = mount(config(&src, &cache));
    assert_eq!(
        read(&c, &rel("big"), 0, 4096, 4096).unwrap(),
        &pattern(2, len)[..4096]
    );
    c.shutdown();
    let new = pattern(77, len);
    rewrite_in_place_keeping_size_and_mtime(&src.join("big"), &new);
    let (c, _) = mount(config(&src, &cache));
    match read(&c, &rel("big"), 0, len as u64, 128 << 10) {
        Ok(got) => assert!(got == new, "a remount served bytes that never existed"),
        Err(e) => assert_eq!(e.errno(), libc::ESTALE, "{e:?}"),
    }
    c.shutdown();
    // With a fresh listing the new version is served whole.
    let mut cfg = config(&src, &cache);
    cfg.rescan = true;
    let (c, _) = mount(cfg);
    assert!(read(&c, &rel("big"), 0, len as u64, 128 << 10).unwrap() == new);
    c.shutdown();
}

#[test]
fn bytes_that_never_existed_after_a_remount_regenerated_tree_at_the_same_path() {
    // The tree at the source path is removed and generated again (same
    // names, same sizes, mtimes set back); the remount must serve the new tree, not the kept
    // snapshot and its cached bytes.
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    for p in ["d/x.txt", "d/e/small.bin", "big"] {
        read(&c, &rel(p), 0, 20 << 20, 1 << 20).unwrap();
    }
    c.shutdown();
    let mtimes: Vec<_> = ["d/x.txt", "d/e/small.bin", "big"]
        .iter()
        .map(|p| fs::metadata(src.join(p)).unwrap().modified().unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(20));
    fs::remove_dir_all(&src).unwrap();
    fs::create_dir_all(src.join("d/e")).unwrap();
    let regenerated = [
        ("d/x.txt", b"HELLO WORLD".to_vec()),
        ("d/e/small.bin", pattern(11, 150_000)),
        ("big", pattern(12, (3 << 20) + 777)),
    ];
    for ((p, data), mtime) in regenerated.iter().zip(&mtimes) {
        let f = fs::File::create(src.join(p)).unwrap();
        std::io::Write::write_all(&mut &f, data).unwrap();
        f.set_modified(*mtime).unwrap();
    }
    fs::write(src.join("new.txt"), b"only in the new tree").unwrap();
    let (c, _) = mount(config(&src, &cache));
    for (p, data) in &regenerated {
        let got = read(&c, &rel(p), 0, 20 << 20, 1 << 20).unwrap();
        assert!(&got == data, "{p}: the remount served the old tree's bytes");
    }
    assert_eq!(
        read(&c, &rel("new.txt"), 0, 100, 100).unwrap(),
        b"only in the new tree"
    );
    assert!(matches!(lookup(&c, &rel("large")), Err(FsError::NotFound)));
    c.shutdown();
}

#[test]
fn revalidate_sees_a_changed_file_and_a_new_one() {
    let (_t, src, cache) = setup();
    let mut cfg = config(&src, &cache);
    cfg.revalidate = Some(Duration::from_millis(1));
    let (c, _) = mount(cfg);
    assert_eq!(
        read(&c, &rel("d/x.txt"), 0, 100, 100).unwrap(),
        b"hello world"
    );
    std::thread::sleep(Duration::from_millis(20));
    fs::write(src.join("d/x.txt"), b"new contents!").unwrap();
    fs::write(src.join("d/new.txt"), b"fresh").unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        read(&c, &rel("d/x.txt"), 0, 100, 100).unwrap(),
        b"new contents!"
    );
    assert_eq!(read(&c, &rel("d/new.txt"), 0, 100, 100).unwrap(), b"fresh");
    c.shutdown();
}

#[test]
fn killed_daemon_then_remount_serves_exact_bytes() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    read(&c, &rel("large"), 0, 20 << 20, 1 << 20).unwrap();
    c.abandon(); // kill -9: the index is not written at exit
    let (c, _) = mount(config(&src, &cache));
    assert!(read(&c, &rel("large"), 0, 20 << 20, 1 << 20).unwrap() == pattern(3, (9 << 20) + 5));
    c.shutdown();
}

#[test]
fn corrupt_cache_bytes_are_detected_and_fetched_again() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    read(&c, &rel("d/e/small.bin"), 0, 1 << 20, 1 << 20).unwrap();
    c.shutdown();
    // Flip bytes in every copy on scratch.
    for e in fs::read_dir(cache.join("v2/files")).unwrap() {
        let p = e.unwrap().path();
        let mut b = fs::read(&p).unwrap();
        for i in (0..b.len()).step_by(4096) {
            b[i] ^= 0x55;
        }
        fs::write(&p, b).unwrap();
    }
    let (c, s) = mount(config(&src, &cache));
    assert!(read(&c, &rel("d/e/small.bin"), 0, 1 << 20, 1 << 20).unwrap() == pattern(1, 150_000));
    assert_eq!(
        s.reads.load(SeqCst),
        1,
        "the bad block came from the source again"
    );
    assert!(c.stats_json().contains("\"corrupt_blocks\": 1"));
    c.shutdown();
}

#[test]
fn source_eio_mid_file_fails_that_read_and_the_mount_keeps_serving() {
    let (_t, src, cache) = setup();
    let (c, s) = mount(config(&src, &cache));
    read(&c, &rel("d/x.txt"), 0, 100, 100).unwrap();
    s.fail_reads.store(true, SeqCst);
    let e = read(&c, &rel("big"), 1 << 20, 1 << 20, 1 << 20).unwrap_err();
    assert_eq!(e.errno(), libc::EIO);
    // Cached data is still served, and the source works again once it recovers.
    assert_eq!(
        read(&c, &rel("d/x.txt"), 0, 100, 100).unwrap(),
        b"hello world"
    );
    s.fail_reads.store(false, SeqCst);
    assert!(read(&c, &rel("big"), 0, 10, 10).is_ok());
    c.shutdown();
}

#[test]
fn mount_is_usable_before_a_slow_listing_completes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    for d in 0..30 {
        fs::create_dir_all(src.join(format!("c{d:02}"))).unwrap();
        for f in 0..5 {
            fs::write(src.join(format!("c{d:02}/{f}")), [d as u8; 10]).unwrap();
        }
    }
    let cfg = config(&src, &tmp.path().join("cache"));
    let s = Counting::new(&cfg.source);
    s.meta_delay_ms.store(20, SeqCst);
    let started = Instant::now();
    let mut cfg = cfg;
    cfg.scan_threads = 2;
    let c = stagefs_fs::FsCore::with_source(cfg, s.clone()).unwrap();
    assert_eq!(read(&c, &rel("c29/4"), 0, 10, 10).unwrap(), [29u8; 10]);
    let first = started.elapsed();
    assert!(
        !c.snapshot_ref().is_complete(),
        "listing finished before the first read ({first:?})"
    );
    c.snapshot_ref().wait_complete().unwrap();
    c.shutdown();
}

#[test]
fn views_carry_the_owner_and_read_bits_of_their_input() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("salaries.csv"), b"name,salary\na,1\nb,2\n").unwrap();
    fs::set_permissions(src.join("salaries.csv"), fs::Permissions::from_mode(0o600)).unwrap();
    let (c, _) = mount(config(&src, &tmp.path().join("cache")));
    let dir = lookup(&c, &rel(".npy/salaries.csv")).unwrap();
    assert_eq!(dir.perm, 0o500, "view dir of a 0600 table");
    let col = lookup(&c, &rel(".npy/salaries.csv/salary.npy")).unwrap();
    assert_eq!(
        col.perm, 0o400,
        "a column of a 0600 table must not be world-readable"
    );
    let np = names(&c, &rel(".npy/salaries.csv"), 100).unwrap();
    assert!(np.iter().any(|n| n == OsStr::new("salary.npy")), "{np:?}");
    c.shutdown();
}

/// Regression: every active file remembered its last block, so 4096 files read once could pin
/// 4 GiB of 1 MiB blocks. The remembered blocks are bounded for the whole daemon, and reads
/// stay exact past the bound.
#[test]
fn remembered_blocks_stay_within_their_budget_however_many_files_are_read() {
    let (_t, src, cache) = setup();
    // 100 MiB of first blocks against a 64 MiB budget.
    let files = 100u64;
    for i in 0..files {
        std::fs::write(src.join(format!("big{i}")), pattern(i, (1 << 20) + 7)).unwrap();
    }
    let mut cfg = config(&src, &cache);
    cfg.stage = false;
    let (core, _) = mount(cfg);
    // Seven of eight pieces of each first block: every file still has a use for its block.
    let part = (1 << 20) - (128 << 10);
    for i in 0..files {
        let got = read(&core, &rel(&format!("big{i}")), 0, part, 128 << 10).unwrap();
        assert!(got == pattern(i, part as usize), "file {i} differs");
    }
    let held = core.memo_bytes();
    assert!(held > 0, "nothing remembered at all");
    assert!(
        held <= stagefs_fs::files::MEMO_BUDGET,
        "{held} bytes remembered for {files} files"
    );
}

/// Regression, found by the small-file CPU figure: every small file read whole remembered its
/// block, so a pass over 10,000 of them held the whole budget for nothing, and a large file
/// read afterwards got no memo: each of its 128 KiB pieces re-read and re-checksummed its
/// 1 MiB block (seq epochs 2.8 s instead of 1.2 s on the benchmark's 2 GB).
#[test]
fn regression_small_files_read_whole_leave_the_memo_budget_to_large_files() {
    let (_t, src, cache) = setup();
    // 800 × 100 KB = 80 MB of blocks against the 64 MiB budget.
    let small = 800u64;
    let dir = src.join("small");
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..small {
        std::fs::write(dir.join(format!("s{i}")), pattern(i, 100_000)).unwrap();
    }
    std::fs::write(src.join("large"), pattern(7, 4 << 20)).unwrap();
    let mut cfg = config(&src, &cache);
    cfg.stage = false;
    let (core, _) = mount(cfg);
    for i in 0..small {
        // One request per file, as the kernel's 128 KiB read-ahead asks for a 100 KB file.
        let got = read(&core, &rel(&format!("small/s{i}")), 0, 100_000, 128 << 10).unwrap();
        assert!(got == pattern(i, 100_000), "small file {i} differs");
    }
    assert_eq!(
        core.memo_bytes(),
        0,
        "small files read whole still hold blocks"
    );
    // The large file's first block, read in 128 KiB pieces, is remembered while it is read...
    let part = 3 << 17;
    let got = read(&core, &rel("large"), 0, part, 128 << 10).unwrap();
    assert!(got == pattern(7, part as usize)[..], "large file differs");
    assert_eq!(
        core.memo_bytes(),
        1 << 20,
        "the large file's block is not remembered"
    );
    // ... and given back once the reader reaches its end.
    let got = read(&core, &rel("large"), part, (1 << 20) - part, 128 << 10).unwrap();
    assert!(
        got == pattern(7, 1 << 20)[part as usize..],
        "large file differs"
    );
    assert_eq!(
        core.memo_bytes(),
        0,
        "a block read to its end is still held"
    );
    core.shutdown();
}

#[test]
fn two_mounts_on_one_cache_the_second_is_refused() {
    // Regression: two mounts sharing one cache directory overwrote each other's blocks.
    let (tmp, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let other = tmp.path().join("src2");
    tree(&other);
    let err = stagefs_fs::FsCore::with_source(config(&other, &cache), Counting::new(&other))
        .err()
        .expect("a second mount of a cache in use was accepted");
    let msg = err.to_string();
    assert!(
        msg.contains("in use by another mount")
            && msg.contains(&format!("pid {}", std::process::id())),
        "{msg}"
    );
    assert_eq!(err.errno(), libc::EBUSY);
    c.shutdown();
    // Free again once the first is unmounted.
    let (c, _) = mount(config(&other, &cache));
    assert_eq!(read(&c, &rel("d/x.txt"), 0, 5, 5).unwrap(), b"hello");
    c.shutdown();
}

/// Hardening round three: on an `--allow-other` mount a second user who could read neither
/// `pub/private.png` (0600) nor list `secret/` (0700) got their pixels through
/// `.npy/imgs/images.npy`, and `files.txt` named `secret/topsecret-name.png`: an image
/// folder's view files carried the folder's modes, not every input's.
#[test]
fn regression_image_views_showed_other_users_what_the_source_denies_them() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let png = |w: u32| {
        let mut out = Vec::new();
        let mut e = png::Encoder::new(&mut out, w, w);
        e.set_color(png::ColorType::Grayscale);
        e.write_header()
            .unwrap()
            .write_image_data(&vec![7u8; (w * w) as usize])
            .unwrap();
        out
    };
    for (dir, mode) in [
        ("open/a", 0o755),
        ("imgs/pub", 0o755),
        ("imgs/secret", 0o700),
    ] {
        fs::create_dir_all(src.join(dir)).unwrap();
        fs::set_permissions(src.join(dir), fs::Permissions::from_mode(mode)).unwrap();
    }
    for (file, mode) in [
        ("open/a/1.png", 0o644),
        ("open/a/2.png", 0o644),
        ("imgs/pub/ok.png", 0o644),
        ("imgs/pub/private.png", 0o600),
        ("imgs/secret/topsecret-name.png", 0o644),
    ] {
        fs::write(src.join(file), png(4)).unwrap();
        fs::set_permissions(src.join(file), fs::Permissions::from_mode(mode)).unwrap();
    }
    let (c, _) = mount(config(&src, &tmp.path().join("cache")));
    for f in ["images.npy", "labels.npy", "files.txt", "classes.txt"] {
        let a = lookup(&c, &rel(&format!(".npy/imgs/{f}"))).unwrap();
        assert_eq!(a.perm, 0o400, "{f} of a folder with private inputs");
        let a = lookup(&c, &rel(&format!(".npy/open/{f}"))).unwrap();
        assert_eq!(a.perm, 0o444, "{f} of a folder everyone may read");
    }
    // The view directory of a 0700 folder may be entered by its owner only.
    let d = lookup(&c, &rel(".npy/imgs/secret")).unwrap();
    assert_eq!(d.perm, 0o500);
    c.shutdown();
}

/// Hardening round three: opening an image view rendered all of it to scratch in the
/// background, so reading only its 128-byte header turned 14 MB of 1×1 PNGs into 30 GB of
/// scratch, and 2,000 zero-byte JPEGs into 290 MB. Now a header read renders the header, a
/// sequential reader is rendered ahead of within a bound, and units of zeros are not stored.
#[test]
fn regression_a_header_read_of_an_image_view_rendered_all_of_it_to_scratch() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir_all(src.join("tiny/a")).unwrap();
    let mut png1 = Vec::new();
    {
        let mut e = png::Encoder::new(&mut png1, 1, 1);
        e.set_color(png::ColorType::Grayscale);
        e.write_header().unwrap().write_image_data(&[200]).unwrap();
    }
    let (pngs, jpegs) = (300, 100);
    for i in 0..pngs {
        fs::write(src.join(format!("tiny/a/{i:04}.png")), &png1).unwrap();
    }
    for i in 0..jpegs {
        fs::write(src.join(format!("tiny/a/z{i:04}.jpg")), b"").unwrap();
    }
    let mut cfg = config(&src, &tmp.path().join("cache"));
    cfg.stage = false;
    cfg.image_size = 224;
    let (c, _) = mount(cfg);
    let a = lookup(&c, &rel(".npy/tiny/images.npy")).unwrap();
    let slot = (a.size - 128) / (pngs + jpegs);
    assert_eq!(slot, 3 * 224 * 224);
    let before = c.store().used();
    let header = read(&c, &rel(".npy/tiny/images.npy"), 0, 128, 128).unwrap();
    assert_eq!(&header[1..6], b"NUMPY");
    std::thread::sleep(Duration::from_millis(500));
    let after_header = c.store().used() - before;
    assert!(
        after_header < 4 * slot,
        "a header read stored {after_header} bytes ({slot}-byte slots)"
    );
    // A sequential reader gets every byte; the zero slots of the empty JPEGs are not stored.
    let all = read(&c, &rel(".npy/tiny/images.npy"), 0, a.size, 128 << 10).unwrap();
    assert_eq!(all.len() as u64, a.size);
    let zero_slots = all[128..]
        .chunks_exact(slot as usize)
        .filter(|s| s.iter().all(|&b| b == 0))
        .count() as u64;
    assert_eq!(zero_slots, jpegs, "the empty JPEGs render as zeros");
    std::thread::sleep(Duration::from_millis(300));
    let stored = c.store().used() - before;
    assert!(
        stored < (pngs + 8) * slot + (1 << 20),
        "{stored} bytes stored for {pngs} decodable images of {slot} bytes"
    );
    // The zeros read again, from memory.
    let again = read(&c, &rel(".npy/tiny/images.npy"), 0, a.size, 128 << 10).unwrap();
    assert!(again == all, "a second read differs");
    c.shutdown();
}
