//! The filesystem core driven directly, without a kernel mount.
#![allow(missing_docs, clippy::unwrap_used)]

use std::ffi::OsStr;
use std::fs;
use std::sync::Arc;

use stagefs_fs::core::Kind;
use stagefs_fs::{FsConfig, FsCore, FsError};
use stagefs_prefetch::FetchConfig;

fn core(src: &std::path::Path, cache: &std::path::Path) -> Arc<FsCore> {
    FsCore::new(FsConfig {
        source: src.to_path_buf(),
        cache_dir: cache.to_path_buf(),
        cache_size: 64 << 20,
        fetch: FetchConfig {
            workers: 2,
            max_queued: 64,
        },
        stage: false,
        cross_file: 4,
        image_size: 32,
        strict_views: false,
        fast_decode: false,
        max_image_pixels: 1 << 26,
        decode_budget: 1 << 25,
    })
    .unwrap()
}

fn setup() -> (tempfile::TempDir, Arc<FsCore>) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir_all(src.join("d")).unwrap();
    fs::write(src.join("d/x.txt"), b"hello world").unwrap();
    fs::write(src.join("big"), vec![7u8; 3 << 20]).unwrap();
    std::os::unix::fs::symlink("../etc", src.join("d/up")).unwrap();
    let c = core(&src, &tmp.path().join("cache"));
    (tmp, c)
}

#[test]
fn lookup_getattr_readdir_read() {
    let (_tmp, c) = setup();
    let d = c.lookup(c.root(), OsStr::new("d")).unwrap();
    assert_eq!(d.kind, Kind::Dir);
    let x = c.lookup(d.ino, OsStr::new("x.txt")).unwrap();
    assert_eq!((x.kind, x.size), (Kind::File, 11));
    assert_eq!(c.getattr(x.ino).unwrap(), x);
    let names: Vec<_> = c
        .readdir(c.root())
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, [".stagefs", ".npy", "big", "d"]);
    let o = c.open(x.ino, false, false).unwrap();
    assert_eq!(c.read(o.fh, 6, 100).unwrap(), b"world");
    assert!(c.read(o.fh, 100, 10).unwrap().is_empty());
    c.release(o.fh);
    assert!(matches!(c.read(o.fh, 0, 1), Err(FsError::BadHandle)));
}

#[test]
fn errors_map_to_precise_errnos() {
    let (_tmp, c) = setup();
    let e = c.lookup(c.root(), OsStr::new("missing")).unwrap_err();
    assert_eq!(e.errno(), libc::ENOENT);
    let x = c
        .lookup(
            c.lookup(c.root(), OsStr::new("d")).unwrap().ino,
            OsStr::new("x.txt"),
        )
        .unwrap();
    assert_eq!(c.open(x.ino, true, false).unwrap_err().errno(), libc::EROFS);
    assert_eq!(c.readdir(x.ino).unwrap_err().errno(), libc::ENOTDIR);
    assert_eq!(c.readlink(x.ino).unwrap_err().errno(), libc::EINVAL);
    assert_eq!(c.getattr(999_999).unwrap_err().errno(), libc::EBADF);
    let d = c.lookup(c.root(), OsStr::new("d")).unwrap();
    assert_eq!(
        c.open(d.ino, false, false).unwrap_err().errno(),
        libc::EISDIR
    );
}

#[test]
fn symlink_target_is_returned_verbatim() {
    let (_tmp, c) = setup();
    let d = c.lookup(c.root(), OsStr::new("d")).unwrap();
    let l = c.lookup(d.ino, OsStr::new("up")).unwrap();
    assert_eq!(l.kind, Kind::Symlink);
    assert_eq!(c.readlink(l.ino).unwrap(), b"../etc");
}

#[test]
fn stats_control_file_is_json_with_counters() {
    let (_tmp, c) = setup();
    let big = c.lookup(c.root(), OsStr::new("big")).unwrap();
    let o = c.open(big.ino, false, false).unwrap();
    assert_eq!(c.read(o.fh, 0, 1 << 20).unwrap().len(), 1 << 20);
    let ctl = c.lookup(c.root(), OsStr::new(".stagefs")).unwrap();
    let st = c.lookup(ctl.ino, OsStr::new("stats")).unwrap();
    let h = c.open(st.ino, false, false).unwrap();
    assert!(h.direct_io);
    let json: serde_json::Value =
        serde_json::from_slice(&c.read(h.fh, 0, 1 << 20).unwrap()).unwrap();
    assert_eq!(json["bytes_from_source"], 1 << 20);
    assert_eq!(json["reads"], 1);
    c.shutdown();
}

#[test]
fn reopen_of_unchanged_file_keeps_the_page_cache_and_a_changed_one_does_not() {
    let (tmp, c) = setup();
    let d = c.lookup(c.root(), OsStr::new("d")).unwrap();
    let x = c.lookup(d.ino, OsStr::new("x.txt")).unwrap();
    assert!(c.open(x.ino, false, false).unwrap().keep_cache);
    assert!(c.open(x.ino, false, false).unwrap().keep_cache);
    std::thread::sleep(std::time::Duration::from_millis(10));
    fs::write(tmp.path().join("src/d/x.txt"), b"HELLO WORLD").unwrap();
    let o = c.open(x.ino, false, false).unwrap();
    assert!(
        !o.keep_cache,
        "a changed file must drop the kernel's cached pages"
    );
    assert_eq!(c.read(o.fh, 0, 5).unwrap(), b"HELLO");
}

#[test]
fn fully_cached_file_is_offered_for_passthrough() {
    let (_tmp, c) = setup();
    let big = c.lookup(c.root(), OsStr::new("big")).unwrap();
    let o = c.open(big.ino, false, true).unwrap();
    assert!(o.passthrough.is_none(), "nothing cached yet");
    assert_eq!(c.read(o.fh, 0, 3 << 20).unwrap(), vec![7u8; 3 << 20]);
    let o2 = c.open(big.ino, false, true).unwrap();
    let f = o2
        .passthrough
        .expect("complete file offered for passthrough");
    assert_eq!(f.metadata().unwrap().len(), 3 << 20);
}
