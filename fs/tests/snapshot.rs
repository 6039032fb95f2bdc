//! The metadata snapshot over real trees and injected sources: listing equals a `std::fs` walk,
//! lookups stream, requests run in parallel, failures are skipped and reported, files round-trip
//! and hostile ones are rejected, revalidation follows changes.
#![allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use proptest::prelude::*;
use stagefs_fs::snapshot::{NodeAttr, NodeId, ScanOptions, Snapshot, SnapshotError, ROOT};
use stagefs_prefetch::cachedir::CacheDir;
use stagefs_prefetch::source::{DirName, FileKind, LocalSource, Meta, Source, Version};
use stagefs_prefetch::SourceError;

/// Which operation a failure or delay applies to.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Op {
    Stat,
    ReadDir,
    Readlink,
}

/// A [`LocalSource`] with a delay per operation, failures injected by path, and counts of
/// operations and of requests in flight.
struct TestSource {
    inner: Box<dyn Source>,
    delay: Duration,
    fail: Mutex<HashSet<(Op, PathBuf)>>,
    slow: Mutex<HashMap<(Op, PathBuf), Duration>>,
    ops: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

impl TestSource {
    fn new(root: &Path, delay: Duration) -> Arc<TestSource> {
        Self::wrap(Box::new(LocalSource::new(root).unwrap()), delay)
    }

    fn wrap(inner: Box<dyn Source>, delay: Duration) -> Arc<TestSource> {
        Arc::new(TestSource {
            inner,
            delay,
            fail: Mutex::default(),
            slow: Mutex::default(),
            ops: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        })
    }

    fn fail(&self, op: Op, path: &str) {
        self.fail.lock().unwrap().insert((op, PathBuf::from(path)));
    }

    fn ops(&self) -> usize {
        self.ops.load(Ordering::SeqCst)
    }

    fn call<T>(
        &self,
        op: Op,
        rel: &Path,
        f: impl FnOnce() -> Result<T, SourceError>,
    ) -> Result<T, SourceError> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        self.ops.fetch_add(1, Ordering::SeqCst);
        let extra = self
            .slow
            .lock()
            .unwrap()
            .get(&(op, rel.to_path_buf()))
            .copied();
        std::thread::sleep(self.delay + extra.unwrap_or_default());
        let r = if self.fail.lock().unwrap().contains(&(op, rel.to_path_buf())) {
            Err(SourceError::Io {
                path: rel.to_path_buf(),
                source: io::Error::from_raw_os_error(libc::EACCES),
            })
        } else {
            f()
        };
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        r
    }
}

impl Source for TestSource {
    fn stat(&self, rel: &Path) -> Result<Meta, SourceError> {
        self.call(Op::Stat, rel, || self.inner.stat(rel))
    }
    fn read_dir(&self, rel: &Path) -> Result<Vec<DirName>, SourceError> {
        self.call(Op::ReadDir, rel, || self.inner.read_dir(rel))
    }
    fn readlink(&self, rel: &Path) -> Result<Vec<u8>, SourceError> {
        self.call(Op::Readlink, rel, || self.inner.readlink(rel))
    }
    fn read_at(&self, rel: &Path, v: Version, off: u64, len: usize) -> Result<Bytes, SourceError> {
        self.inner.read_at(rel, v, off, len)
    }
}

/// A generated source with no files behind it: `big/` holds `n` entries (listed in reverse
/// order, so the snapshot must sort), plus a few entries at the root.
struct SyntheticSource {
    n: usize,
}

impl SyntheticSource {
    fn meta(kind: FileKind, i: u64) -> Meta {
        Meta {
            kind,
            perm: if kind == FileKind::Dir { 0o755 } else { 0o644 },
            uid: 1000 + (i % 3) as u32,
            gid: 100,
            size: i * 7,
            mtime_ns: 1_700_000_000_000_000_000 + i as i64,
            ctime_ns: 1_700_000_000_000_000_000 + 2 * i as i64,
            ino: 10 + i,
            nlink: 1,
            rdev: 0,
        }
    }
}

impl Source for SyntheticSource {
    fn stat(&self, rel: &Path) -> Result<Meta, SourceError> {
        let s = rel.to_str().unwrap();
        Ok(match s {
            "" | "big" => Self::meta(FileKind::Dir, 0),
            "link" => Self::meta(FileKind::Symlink, 1),
            _ => {
                let i: u64 =
                    s.rsplit('f')
                        .next()
                        .unwrap()
                        .parse()
                        .map_err(|_| SourceError::Gone {
                            path: rel.to_path_buf(),
                        })?;
                Self::meta(FileKind::File, i)
            }
        })
    }
    fn read_dir(&self, rel: &Path) -> Result<Vec<DirName>, SourceError> {
        let names: Vec<String> = match rel.to_str().unwrap() {
            "" => vec!["big".into(), "link".into(), "f1".into()],
            _ => (0..self.n).rev().map(|i| format!("f{i:06}")).collect(),
        };
        Ok(names
            .into_iter()
            .map(|n| DirName {
                name: n.into(),
                kind: None,
            })
            .collect())
    }
    fn readlink(&self, _rel: &Path) -> Result<Vec<u8>, SourceError> {
        Ok(b"big/f000001".to_vec())
    }
    fn read_at(&self, rel: &Path, _: Version, _: u64, _: usize) -> Result<Bytes, SourceError> {
        Err(SourceError::Gone {
            path: rel.to_path_buf(),
        })
    }
}

fn opts(threads: usize) -> ScanOptions {
    ScanOptions {
        threads,
        wait_timeout: Duration::from_secs(60),
    }
}

fn set_mtime(p: &Path, secs: u64, nanos: u32) {
    let t = SystemTime::UNIX_EPOCH + Duration::new(secs, nanos);
    let f = std::fs::File::open(p).unwrap();
    f.set_times(std::fs::FileTimes::new().set_modified(t))
        .unwrap();
}

/// A tree with a bit of everything: nested directories, odd names, modes, mtimes, symlinks
/// (inside, outside, dangling), an empty directory and a FIFO.
fn make_tree(root: &Path) {
    for d in 0..6 {
        let dir = root.join(format!("class{d}"));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        for f in 0..(10 + d * 3) {
            let p = dir.join(format!("img_{f:03}.jpg"));
            std::fs::write(&p, vec![b'x'; f * 11 + d]).unwrap();
            set_mtime(&p, 1_600_000_000 + (f * 1000 + d) as u64, (f * 7919) as u32);
        }
        std::fs::write(dir.join("sub/deep.bin"), b"deep").unwrap();
    }
    std::fs::create_dir(root.join("empty")).unwrap();
    for name in ["with space", "ünïcødé", "new\nline", "-dash", ".hidden"] {
        std::fs::write(root.join(name), name).unwrap();
    }
    let exec = root.join("run.sh");
    std::fs::write(&exec, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&exec, PermissionsExt::from_mode(0o750)).unwrap();
    let private = root.join("private.txt");
    std::fs::write(&private, "p").unwrap();
    std::fs::set_permissions(&private, PermissionsExt::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink("class0/img_000.jpg", root.join("inside")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", root.join("outside")).unwrap();
    std::os::unix::fs::symlink("nowhere", root.join("dangling")).unwrap();
    let fifo = std::ffi::CString::new(root.join("pipe").as_os_str().as_bytes()).unwrap();
    // SAFETY: mkfifo on a valid C string.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);
}

/// Every path below `root` (relative), depth first with entries sorted by name bytes.
fn std_walk(root: &Path) -> Vec<PathBuf> {
    fn rec(root: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
        let mut names: Vec<OsString> = std::fs::read_dir(root.join(rel))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        for n in names {
            let p = rel.join(&n);
            out.push(p.clone());
            if std::fs::symlink_metadata(root.join(&p)).unwrap().is_dir() {
                rec(root, &p, out);
            }
        }
    }
    let mut out = vec![PathBuf::new()];
    rec(root, Path::new(""), &mut out);
    out
}

/// The snapshot's walk: (path, attributes, link target) in walk order.
fn snap_walk(s: &Snapshot) -> Vec<(PathBuf, NodeAttr, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    s.walk(|id, a| out.push((s.path(id).unwrap(), a.clone(), s.link_target(id))));
    out
}

fn kind_of(m: &std::fs::Metadata) -> FileKind {
    FileKind::from_mode(m.mode())
}

/// Asserts the snapshot's walk is exactly the `std::fs` walk of `root`, attribute for attribute.
fn assert_matches_std(s: &Snapshot, root: &Path) {
    let walked = snap_walk(s);
    let paths: Vec<PathBuf> = walked.iter().map(|w| w.0.clone()).collect();
    assert_eq!(
        paths,
        std_walk(root),
        "same entries, same depth-first name order"
    );
    for (rel, a, link) in walked {
        let m = std::fs::symlink_metadata(root.join(&rel)).unwrap();
        let want = NodeAttr {
            kind: kind_of(&m),
            perm: (m.mode() & 0o7777) as u16,
            uid: m.uid(),
            gid: m.gid(),
            size: m.size(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
            ctime_ns: m.ctime() * 1_000_000_000 + m.ctime_nsec(),
            ino: m.ino(),
            nlink: m.nlink() as u32,
            rdev: 0,
        };
        assert_eq!(a, want, "{}", rel.display());
        let want_link = m
            .file_type()
            .is_symlink()
            .then(|| std::fs::read_link(root.join(&rel)).unwrap());
        assert_eq!(
            link.map(|l| PathBuf::from(OsStr::from_bytes(&l))),
            want_link,
            "{}",
            rel.display()
        );
    }
}

#[test]
fn listing_equals_a_std_fs_walk() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("src");
    std::fs::create_dir(&root).unwrap();
    make_tree(&root);
    let src = TestSource::new(&root, Duration::ZERO);
    let s = Snapshot::scan(src.clone(), &root, opts(8)).unwrap();
    s.wait_complete().unwrap();
    assert!(s.errors().is_empty(), "{:?}", s.errors());
    assert_matches_std(&s, &root);
    assert_eq!(s.source_root(), root);
    // Lookups and readdir agree with the walk.
    let img = s.resolve(Path::new("class3/img_004.jpg")).unwrap().unwrap();
    assert_eq!(s.attr(img).unwrap().size, 4 * 11 + 3);
    assert_eq!(s.path(img).unwrap(), Path::new("class3/img_004.jpg"));
    let class3 = s.parent(img).unwrap();
    assert_eq!(s.parent(class3), Some(ROOT));
    assert_eq!(s.parent(ROOT), None);
    // is_at agrees with path() for every node, and says no for any other path.
    s.walk(|id, _| {
        let p = s.path(id).unwrap();
        assert!(s.is_at(id, &p), "{}", p.display());
        assert!(!s.is_at(id, &Path::new("x").join(&p)));
    });
    assert!(s.is_at(ROOT, Path::new("")));
    assert!(!s.is_at(img, Path::new("class2/img_004.jpg")));
    assert!(!s.is_at(img, Path::new("img_004.jpg")));
    assert_eq!(s.resolve(Path::new("class3/nope")).unwrap(), None);
    assert!(matches!(
        s.lookup(img, OsStr::new("x")),
        Err(SnapshotError::NotDir { .. })
    ));
    assert!(s.resolve(Path::new("../etc")).is_err());
    let stats = s.scan_stats();
    assert!(stats.complete);
    assert_eq!(stats.entries as usize, std_walk(&root).len());
    assert_eq!(stats.requests as usize, src.ops());
    assert_eq!(stats.pending_dirs, 0);
}

#[test]
fn read_dir_serves_chunks_in_name_order_from_an_index() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    for i in (0..300).rev() {
        std::fs::write(root.join(format!("n{i:04}")), b"").unwrap();
    }
    let s = Snapshot::scan(TestSource::new(root, Duration::ZERO), root, opts(4)).unwrap();
    let mut all = Vec::new();
    let mut start = 0;
    loop {
        let mut got = 0;
        s.read_dir(ROOT, start, |i, id, name, a| {
            assert_eq!(
                s.attr(id).as_ref(),
                Some(a),
                "the callback may call back in"
            );
            all.push(name.to_owned());
            start = i + 1;
            got += 1;
            got < 37 // a kernel buffer's worth
        })
        .unwrap();
        if got == 0 {
            break;
        }
    }
    let want: Vec<OsString> = (0..300).map(|i| format!("n{i:04}").into()).collect();
    assert_eq!(all, want);
}

/// A tree with many directories plus a deep chain `d/e/f/g/h/target`.
fn wide_and_deep(root: &Path, dirs: usize, files: usize) -> usize {
    for d in 0..dirs {
        let dir = root.join(format!("w{d:03}"));
        std::fs::create_dir(&dir).unwrap();
        for f in 0..files {
            std::fs::write(dir.join(format!("f{f:03}")), b"").unwrap();
        }
    }
    std::fs::create_dir_all(root.join("d/e/f/g/h")).unwrap();
    std::fs::write(root.join("d/e/f/g/h/target"), b"found").unwrap();
    dirs * files + dirs + 6
}

#[test]
fn deep_lookup_returns_long_before_the_whole_tree_is_listed() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let total = wide_and_deep(root, 30, 60);
    let src = TestSource::new(root, Duration::from_millis(1));
    let s = Snapshot::scan(src.clone(), root, opts(4)).unwrap();
    let id = s
        .resolve(Path::new("d/e/f/g/h/target"))
        .unwrap()
        .expect("found");
    let ops_at_lookup = src.ops();
    assert!(!s.is_complete(), "the lookup waited for the whole tree");
    assert!(
        ops_at_lookup < total / 2,
        "{ops_at_lookup} of ~{total} source requests made before the lookup returned"
    );
    assert_eq!(s.attr(id).unwrap().size, 5);
    s.wait_complete().unwrap();
    assert!(src.ops() >= total);
    assert_matches_std(&s, root);
}

#[test]
fn requests_in_flight_reach_the_thread_count_in_one_big_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    std::fs::create_dir(root.join("big")).unwrap();
    for f in 0..2000 {
        std::fs::write(root.join(format!("big/{f:05}")), b"").unwrap();
    }
    let src = TestSource::new(root, Duration::from_millis(1));
    let s = Snapshot::scan(src.clone(), root, opts(16)).unwrap();
    s.wait_complete().unwrap();
    // One directory: only chunking its stats across the pool puts 16 requests in flight.
    assert_eq!(src.max_in_flight.load(Ordering::SeqCst), 16);
    assert_eq!(s.scan_stats().entries, 2002);
}

#[test]
fn failing_directory_and_entries_are_skipped_and_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("src");
    std::fs::create_dir(&root).unwrap();
    for d in 0..8 {
        std::fs::create_dir_all(root.join(format!("d{d}"))).unwrap();
        for f in 0..10 {
            std::fs::write(root.join(format!("d{d}/f{f}")), b"x").unwrap();
        }
    }
    std::os::unix::fs::symlink("d0/f0", root.join("l1")).unwrap();
    std::os::unix::fs::symlink("d0/f1", root.join("l2")).unwrap();
    let src = TestSource::new(&root, Duration::ZERO);
    src.fail(Op::ReadDir, "d3");
    src.fail(Op::Stat, "d5/f7");
    src.fail(Op::Readlink, "l1");
    let s = Snapshot::scan(src, &root, opts(4)).unwrap();
    s.wait_complete().unwrap();
    let errors = s.errors();
    assert_eq!(errors.len(), 3, "{errors:?}");
    for p in ["d3", "d5/f7", "l1"] {
        assert!(
            errors.iter().any(|e| e.contains(p)),
            "{p} not in {errors:?}"
        );
    }
    let check = |s: &Snapshot| {
        let d3 = s
            .resolve(Path::new("d3"))
            .unwrap()
            .expect("d3 itself is listed");
        match s.lookup(d3, OsStr::new("f0")) {
            Err(e @ SnapshotError::Unlisted { .. }) => {
                assert_eq!(stagefs_fs::FsError::from(e).errno(), libc::EACCES)
            }
            other => panic!("lookup in an unlisted directory: {other:?}"),
        }
        assert!(s.read_dir(d3, 0, |_, _, _, _| true).is_err());
        assert_eq!(s.resolve(Path::new("d5/f7")).unwrap(), None);
        assert!(s.resolve(Path::new("d5/f8")).unwrap().is_some());
        assert_eq!(s.resolve(Path::new("l1")).unwrap(), None);
        assert!(s.resolve(Path::new("l2")).unwrap().is_some());
        let mut n = 0;
        s.walk(|_, _| n += 1);
        // root + 8 dirs + 70 files of the 7 listed dirs - d5/f7 + l2
        assert_eq!(n, 1 + 8 + 70 - 1 + 1);
    };
    check(&s);
    let file = tmp.path().join("index");
    s.save(&file).unwrap();
    let loaded = Snapshot::load(&file).unwrap();
    check(&loaded);
    assert_eq!(loaded.errors(), errors);
}

#[test]
fn missing_or_non_directory_root_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let src = TestSource::new(tmp.path(), Duration::ZERO);
    src.fail(Op::Stat, "");
    let e = Snapshot::scan(src, tmp.path(), opts(2)).unwrap_err();
    assert!(matches!(e, SnapshotError::Root { .. }), "{e}");
    assert!(
        e.to_string().contains(&*tmp.path().to_string_lossy()),
        "{e}"
    );
    let e = Snapshot::scan(Arc::new(SyntheticLeaf), Path::new("/data/file"), opts(2)).unwrap_err();
    assert!(matches!(e, SnapshotError::NotDir { .. }), "{e}");
}

/// A source whose root is a regular file.
struct SyntheticLeaf;

impl Source for SyntheticLeaf {
    fn stat(&self, _: &Path) -> Result<Meta, SourceError> {
        Ok(SyntheticSource::meta(FileKind::File, 1))
    }
    fn read_dir(&self, rel: &Path) -> Result<Vec<DirName>, SourceError> {
        Err(SourceError::Gone {
            path: rel.to_path_buf(),
        })
    }
    fn readlink(&self, rel: &Path) -> Result<Vec<u8>, SourceError> {
        Err(SourceError::Gone {
            path: rel.to_path_buf(),
        })
    }
    fn read_at(&self, rel: &Path, _: Version, _: u64, _: usize) -> Result<Bytes, SourceError> {
        Err(SourceError::Gone {
            path: rel.to_path_buf(),
        })
    }
}

#[test]
fn lookup_gives_up_after_the_wait_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir(tmp.path().join("slow")).unwrap();
    let src = TestSource::new(tmp.path(), Duration::ZERO);
    src.slow
        .lock()
        .unwrap()
        .insert((Op::ReadDir, "slow".into()), Duration::from_millis(1500));
    let s = Snapshot::scan(
        src,
        tmp.path(),
        ScanOptions {
            threads: 2,
            wait_timeout: Duration::from_millis(100),
        },
    )
    .unwrap();
    let slow = s.resolve(Path::new("slow")).unwrap().unwrap();
    match s.lookup(slow, OsStr::new("x")) {
        Err(e @ SnapshotError::TimedOut { .. }) => {
            assert_eq!(stagefs_fs::FsError::from(e).errno(), libc::ETIMEDOUT)
        }
        other => panic!("{other:?}"),
    }
    s.wait_complete().unwrap();
    assert_eq!(s.lookup(slow, OsStr::new("x")).unwrap(), None);
}

/// Everything observable about a snapshot, by path (ids differ between a snapshot and its file).
fn by_path(s: &Snapshot) -> BTreeMap<PathBuf, (NodeAttr, Option<Vec<u8>>)> {
    snap_walk(s)
        .into_iter()
        .map(|(p, a, l)| (p, (a, l)))
        .collect()
}

#[test]
fn save_and_load_round_trip_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("src");
    std::fs::create_dir(&root).unwrap();
    make_tree(&root);
    let s = Snapshot::scan(TestSource::new(&root, Duration::ZERO), &root, opts(8)).unwrap();
    let file = tmp.path().join("out/tree.stagefs-index");
    std::fs::create_dir(tmp.path().join("out")).unwrap();
    s.save(&file).unwrap();
    let mode = std::fs::metadata(&file).unwrap().mode() & 0o777;
    assert_eq!(
        mode, 0o600,
        "an index names private paths: owner-only by default"
    );
    let left: Vec<_> = std::fs::read_dir(tmp.path().join("out")).unwrap().collect();
    assert_eq!(left.len(), 1, "no temporary left behind");
    let loaded = Snapshot::load(&file).unwrap();
    assert!(loaded.is_complete());
    assert_eq!(loaded.id(), s.id());
    assert_eq!(loaded.source_root(), s.source_root());
    assert_eq!(loaded.created(), s.created());
    assert_eq!(loaded.len(), s.len());
    assert_eq!(by_path(&loaded), by_path(&s));
    assert_matches_std(&loaded, &root);
    assert_eq!(
        loaded.scan_stats().requests,
        0,
        "loading asks the source nothing"
    );

    // The cache copy: same bytes through the private directory.
    let cache = CacheDir::open(&tmp.path().join("cache")).unwrap();
    loaded.save_to(&cache, "snapshot").unwrap();
    let again = Snapshot::load_from(&cache, "snapshot").unwrap();
    assert_eq!(by_path(&again), by_path(&s));
    assert!(
        std::fs::read(cache.path().join("snapshot")).unwrap() == std::fs::read(&file).unwrap(),
        "a loaded snapshot saves byte-identically"
    );
}

#[test]
fn two_hundred_thousand_entries_in_one_directory() {
    let n = 200_000;
    let s = Snapshot::scan(
        Arc::new(SyntheticSource { n }),
        Path::new("/synthetic"),
        opts(16),
    )
    .unwrap();
    let big = s.resolve(Path::new("big")).unwrap().unwrap();
    let mut count = 0;
    let mut prev: Option<OsString> = None;
    s.read_dir(big, 0, |i, _, name, a| {
        assert_eq!(i, count);
        assert_eq!(a.size, i as u64 * 7);
        assert!(prev.as_deref().is_none_or(|p| p < name));
        prev = Some(name.to_owned());
        count += 1;
        true
    })
    .unwrap();
    assert_eq!(count, n);
    let mid = s.lookup(big, OsStr::new("f123456")).unwrap().unwrap();
    assert_eq!(s.attr(mid).unwrap().ino, 10 + 123_456);
    // Resuming at an index serves the rest without re-listing.
    let mut rest = 0;
    s.read_dir(big, n - 10, |_, _, _, _| {
        rest += 1;
        true
    })
    .unwrap();
    assert_eq!(rest, 10);
    s.wait_complete().unwrap();
    let per_entry = s.memory_bytes() / s.len();
    assert!(per_entry < 120, "{per_entry} bytes per entry");
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("big.stagefs-index");
    s.save(&file).unwrap();
    let loaded = Snapshot::load(&file).unwrap();
    assert_eq!(loaded.len(), n + 4);
    let big = loaded.resolve(Path::new("big")).unwrap().unwrap();
    let mid = loaded.lookup(big, OsStr::new("f123456")).unwrap().unwrap();
    assert_eq!(loaded.attr(mid).unwrap().size, 123_456 * 7);
    let link = loaded.resolve(Path::new("link")).unwrap().unwrap();
    assert_eq!(loaded.link_target(link).unwrap(), b"big/f000001");
}

/// The bytes of a small snapshot file with every section populated (owners, symlinks, errors,
/// a failed directory).
fn sample_file(tmp: &Path) -> Vec<u8> {
    let root = tmp.join("sample");
    std::fs::create_dir(&root).unwrap();
    make_tree(&root);
    let src = TestSource::new(&root, Duration::ZERO);
    src.fail(Op::ReadDir, "class2");
    let s = Snapshot::scan(src, &root, opts(4)).unwrap();
    let file = tmp.join("sample.idx");
    s.save(&file).unwrap();
    std::fs::read(&file).unwrap()
}

/// Recomputes the trailing checksum, as a hostile writer would.
fn fix_crc(bytes: &mut [u8]) {
    let end = bytes.len() - 4;
    let crc = crc32fast::hash(&bytes[..end]);
    bytes[end..].copy_from_slice(&crc.to_le_bytes());
}

fn load_bytes(dir: &Path, bytes: &[u8]) -> Result<Arc<Snapshot>, SnapshotError> {
    let p = dir.join("mutated.idx");
    std::fs::write(&p, bytes).unwrap();
    Snapshot::load(&p)
}

/// Exercises everything a mount would ask of a loaded snapshot.
fn use_fully(s: &Snapshot) {
    let mut ids: Vec<NodeId> = Vec::new();
    s.walk(|id, _| ids.push(id));
    for id in ids {
        let _ = (s.path(id), s.parent(id), s.link_target(id), s.attr(id));
        let _ = s.read_dir(id, 0, |_, child, name, _| {
            let _ = s.lookup(id, name);
            s.parent(child) == Some(id)
        });
    }
}

#[test]
fn every_truncation_of_a_file_is_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = sample_file(tmp.path());
    let origin = Path::new("sample");
    for len in 0..bytes.len() {
        let r = Snapshot::from_bytes(&bytes[..len], origin);
        assert!(r.is_err(), "truncated to {len} of {} accepted", bytes.len());
    }
    let mut longer = bytes.clone();
    longer.extend_from_slice(b"junk");
    assert!(Snapshot::from_bytes(&longer, origin).is_err());
    use_fully(&Snapshot::from_bytes(&bytes, origin).unwrap());
    // The same bytes through a file, and back out through a stream.
    let loaded = load_bytes(tmp.path(), &bytes).unwrap();
    let mut out = Vec::new();
    loaded.write_to(&mut out).unwrap();
    assert!(out == bytes);
}

/// Size of a node record in the snapshot file (persist.rs's docs).
const NODE_LEN: usize = 46;

/// Byte offsets of the sections, read from the header (layout in persist.rs's docs).
struct Layout {
    nodes: usize,
    names: usize,
    n_nodes: usize,
}

fn layout(b: &[u8]) -> Layout {
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let (root_len, n_nodes, n_owners) = (u32_at(44), u32_at(48), u32_at(80));
    let nodes = 128 + root_len + n_owners * 8;
    Layout {
        nodes,
        names: nodes + n_nodes * NODE_LEN,
        n_nodes,
    }
}

#[test]
fn hostile_files_with_valid_checksums_are_rejected() {
    let tmp = tempfile::tempdir().unwrap();
    let good = sample_file(tmp.path());
    let l = layout(&good);
    let reject = |what: &str, f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = good.clone();
        f(&mut b);
        fix_crc(&mut b);
        match load_bytes(tmp.path(), &b) {
            Err(SnapshotError::Corrupt { reason, .. }) => reason,
            other => panic!("{what}: {other:?}"),
        }
    };
    // Counts far beyond the file: refused before allocating anything.
    reject("huge node count", &|b| {
        b[48..52].copy_from_slice(&u32::MAX.to_le_bytes())
    });
    reject("huge names length", &|b| {
        b[56..64].copy_from_slice(&u64::MAX.to_le_bytes())
    });
    reject("invalid kind", &|b| b[l.nodes + NODE_LEN] = 9);
    reject("root not a directory", &|b| b[l.nodes] = 0);
    reject("flags set", &|b| b[l.nodes + NODE_LEN + 1] = 1);
    // The first entry's name (all names are at least one byte): make it "/", then "..".
    let first_len = u16::from_le_bytes(
        good[l.nodes + NODE_LEN + 4..l.nodes + NODE_LEN + 6]
            .try_into()
            .unwrap(),
    );
    let r = reject("slash in a name", &|b| b[l.names] = b'/');
    assert!(r.contains("invalid name"), "{r}");
    // Give the first name two bytes, "..", and the second the rest (the lengths still add up).
    let r = reject("dot-dot name", &|b| {
        let len_at = |i: usize| l.nodes + NODE_LEN * i + 4;
        let second_len = u16::from_le_bytes(b[len_at(2)..len_at(2) + 2].try_into().unwrap());
        b[len_at(1)..len_at(1) + 2].copy_from_slice(&2u16.to_le_bytes());
        b[len_at(2)..len_at(2) + 2].copy_from_slice(&(first_len + second_len - 2).to_le_bytes());
        b[l.names..l.names + 2].copy_from_slice(b"..");
    });
    assert!(r.contains("invalid name"), "{r}");
    let r = reject("NUL in a name", &|b| b[l.names] = 0);
    assert!(r.contains("invalid name"), "{r}");
    // Root children are sorted: swapping the first two names' bytes breaks the order if they
    // have the same length; otherwise make the second name sort first.
    let r = reject("unsorted names", &|b| {
        let second = l.names + first_len as usize;
        b[second] = 0x01;
    });
    assert!(r.contains("sorted") || r.contains("invalid name"), "{r}");
    assert!(l.n_nodes > 10);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Random damage, with and without a recomputed checksum: an error or a usable snapshot,
    /// never a panic or an abort.
    #[test]
    fn mutated_files_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in proptest::option::of(any::<prop::sample::Index>()),
        recompute in any::<bool>(),
    ) {
        let tmp = SAMPLE.with(|s| s.clone());
        let mut b = tmp.1.clone();
        for (i, v) in &edits {
            let i = i.index(b.len());
            b[i] = *v;
        }
        if let Some(c) = cut {
            b.truncate(c.index(b.len()).max(8));
        }
        if recompute && b.len() >= 4 {
            fix_crc(&mut b);
        }
        if let Ok(s) = Snapshot::from_bytes(&b, tmp.0.path()) {
            use_fully(&s);
        }
    }
}

thread_local! {
    /// One sample file per test thread (building it is the slow part).
    static SAMPLE: (Arc<tempfile::TempDir>, Vec<u8>) = {
        let tmp = Arc::new(tempfile::tempdir().unwrap());
        let bytes = sample_file(tmp.path());
        (tmp, bytes)
    };
}

#[test]
fn revalidate_sees_a_changed_file_and_new_and_removed_entries() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("src");
    std::fs::create_dir_all(root.join("a")).unwrap();
    std::fs::write(root.join("a/x"), b"old").unwrap();
    std::fs::write(root.join("a/y"), b"doomed").unwrap();
    std::fs::write(root.join("a/w"), b"same").unwrap();
    set_mtime(&root.join("a"), 1_600_000_000, 0);
    let src = TestSource::new(&root, Duration::ZERO);
    let s = Snapshot::scan(src.clone(), &root, opts(4)).unwrap();
    s.wait_complete().unwrap();
    let a = s.resolve(Path::new("a")).unwrap().unwrap();
    let x = s.resolve(Path::new("a/x")).unwrap().unwrap();
    let y = s.resolve(Path::new("a/y")).unwrap().unwrap();
    let w = s.resolve(Path::new("a/w")).unwrap().unwrap();

    std::fs::write(root.join("a/x"), b"new and longer").unwrap();
    std::fs::remove_file(root.join("a/y")).unwrap();
    std::fs::write(root.join("a/z"), b"born").unwrap();
    std::fs::create_dir_all(root.join("a/sub/inner")).unwrap();
    std::fs::write(root.join("a/sub/inner/leaf"), b"leaf").unwrap();
    set_mtime(&root.join("a"), 1_600_000_100, 0);

    // Fresh enough: served from the snapshot, the source is not asked.
    let before = src.ops();
    assert_eq!(s.revalidate(x, Duration::from_secs(3600)).unwrap().size, 3);
    assert_eq!(
        s.revalidate(a, Duration::from_secs(3600)).unwrap().mtime_ns,
        1_600_000_000_000_000_000
    );
    assert_eq!(src.ops(), before);
    assert!(
        s.resolve(Path::new("a/z")).unwrap().is_none(),
        "snapshot semantics until revalidated"
    );

    let a_attr = s.revalidate(a, Duration::ZERO).unwrap();
    assert_eq!(a_attr.mtime_ns, 1_600_000_100_000_000_000);
    assert_eq!(
        s.lookup(a, OsStr::new("x")).unwrap(),
        Some(x),
        "kept names keep their ids"
    );
    assert_eq!(s.lookup(a, OsStr::new("w")).unwrap(), Some(w));
    assert_eq!(s.lookup(a, OsStr::new("y")).unwrap(), None);
    assert!(s.attr(y).is_none());
    let z = s.lookup(a, OsStr::new("z")).unwrap().unwrap();
    assert!(z > w && z > x, "new names get new ids");
    assert_eq!(s.attr(z).unwrap().size, 4);
    let mut names = Vec::new();
    s.read_dir(a, 0, |_, _, n, _| {
        names.push(n.to_owned());
        true
    })
    .unwrap();
    assert_eq!(names, ["sub", "w", "x", "z"]);
    // The new subdirectory is listed when first looked into.
    let leaf = s.resolve(Path::new("a/sub/inner/leaf")).unwrap().unwrap();
    assert_eq!(s.attr(leaf).unwrap().size, 4);

    assert_eq!(
        s.attr(x).unwrap().size,
        3,
        "the file's attributes until it is revalidated"
    );
    let x_attr = s.revalidate(x, Duration::ZERO).unwrap();
    assert_eq!(x_attr.size, 14);
    assert_eq!(s.attr(x), Some(x_attr));

    // Gone since: removed from the snapshot.
    std::fs::remove_file(root.join("a/w")).unwrap();
    match s.revalidate(w, Duration::ZERO) {
        Err(e) => assert_eq!(stagefs_fs::FsError::from(e).errno(), libc::ENOENT),
        Ok(a) => panic!("{a:?}"),
    }
    assert_eq!(s.lookup(a, OsStr::new("w")).unwrap(), None);

    // What revalidation learned is saved, and is the source as it is now (the removal of `w`
    // touched the directory's mtime again: put it back to what was revalidated; its ctime
    // cannot be put back, so the directory is revalidated once more).
    set_mtime(&root.join("a"), 1_600_000_100, 0);
    s.revalidate(a, Duration::ZERO).unwrap();
    let file = tmp.path().join("index");
    s.save(&file).unwrap();
    let loaded = Snapshot::load(&file).unwrap();
    assert!(loaded
        .resolve(Path::new("a/sub/inner/leaf"))
        .unwrap()
        .is_some());
    assert_eq!(by_path(&loaded), by_path(&s));
    assert_matches_std(&loaded, &root);
}

#[test]
fn loaded_snapshot_revalidates_only_with_a_source_attached() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("src");
    std::fs::create_dir(&root).unwrap();
    std::fs::write(root.join("f"), b"1").unwrap();
    let s = Snapshot::scan(TestSource::new(&root, Duration::ZERO), &root, opts(2)).unwrap();
    let file = tmp.path().join("index");
    s.save(&file).unwrap();
    let loaded = Snapshot::load(&file).unwrap();
    let f = loaded.resolve(Path::new("f")).unwrap().unwrap();
    assert!(matches!(
        loaded.revalidate(f, Duration::ZERO),
        Err(SnapshotError::NoSource)
    ));
    // A snapshot as old as a loaded one is re-checked at its first revalidation.
    std::fs::write(root.join("f"), b"12").unwrap();
    assert!(loaded.attach_source(TestSource::new(&root, Duration::ZERO)));
    assert_eq!(
        loaded
            .revalidate(f, Duration::from_secs(3600))
            .unwrap()
            .size,
        1
    );
    assert_eq!(loaded.revalidate(f, Duration::ZERO).unwrap().size, 2);
    assert!(!s.attach_source(TestSource::new(&root, Duration::ZERO)));
}

#[test]
fn not_an_index_and_other_versions_are_named_as_such() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("x");
    std::fs::write(&p, b"{\"json\": true}").unwrap();
    let e = Snapshot::load(&p).unwrap_err();
    assert!(matches!(e, SnapshotError::WrongFormat { .. }), "{e}");
    let mut b = sample_file(tmp.path());
    b[8..12].copy_from_slice(&99u32.to_le_bytes());
    fix_crc(&mut b);
    let e = load_bytes(tmp.path(), &b).unwrap_err();
    assert!(e.to_string().contains("version 99"), "{e}");
    let e = Snapshot::load(&tmp.path().join("absent")).unwrap_err();
    assert!(matches!(e, SnapshotError::Io { .. }), "{e}");
}

#[test]
fn damage_is_reported_as_a_checksum_mismatch_not_as_its_first_symptom() {
    let tmp = tempfile::tempdir().unwrap();
    let mut b = sample_file(tmp.path());
    let l = layout(&b);
    b[l.names] = b'/'; // would be "invalid name" were the checksum recomputed
    match Snapshot::from_bytes(&b, Path::new("x")) {
        Err(SnapshotError::Corrupt { reason, .. }) => {
            assert!(reason.contains("checksum mismatch"), "{reason}");
            assert!(reason.contains("invalid name"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn concurrent_lookups_during_the_scan_all_find_their_entries() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    wide_and_deep(root, 12, 40);
    let src = TestSource::new(root, Duration::from_micros(200));
    let s = Snapshot::scan(src, root, opts(8)).unwrap();
    std::thread::scope(|scope| {
        for t in 0..8usize {
            let s = &s;
            scope.spawn(move || {
                // Each reader walks the directories in its own order, as shuffled loaders do.
                for k in 0..12 {
                    let d = (k * 5 + t * 7) % 12;
                    for f in (0..40).rev() {
                        let rel = format!("w{d:03}/f{f:03}");
                        let id = s.resolve(Path::new(&rel)).unwrap();
                        let id = id.unwrap_or_else(|| panic!("{rel} not found"));
                        assert_eq!(s.path(id).unwrap(), Path::new(&rel));
                    }
                }
                assert!(s.resolve(Path::new("d/e/f/g/h/target")).unwrap().is_some());
            });
        }
    });
    s.wait_complete().unwrap();
    assert_matches_std(&s, root);
}

#[test]
fn dropping_a_snapshot_mid_scan_stops_the_listing() {
    let tmp = tempfile::tempdir().unwrap();
    wide_and_deep(tmp.path(), 20, 50);
    let src = TestSource::new(tmp.path(), Duration::from_millis(2));
    let s = Snapshot::scan(src.clone(), tmp.path(), opts(4)).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    drop(s);
    // Each thread finishes at most its current request, then stops.
    std::thread::sleep(Duration::from_millis(300));
    let settled = src.ops();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        src.ops(),
        settled,
        "the listing goes on after the snapshot is gone"
    );
    assert_eq!(src.in_flight.load(Ordering::SeqCst), 0);
    assert!(
        settled < 1000,
        "{settled} requests: the whole tree was listed anyway"
    );
}
