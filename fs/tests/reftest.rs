//! Reference-model property test of the filesystem core (after mountpoint-s3's reftests):
//! proptest generates a tree and a sequence of operations — lookups, listings in chunks, reads
//! at random offsets and sizes, remounts, kills (no index written) and remounts, and changes to
//! source files — runs them against `FsCore` over an injected source, and compares every
//! answer with the model: the tree as `std::fs` saw it when the snapshot was taken. Snapshot
//! semantics: a file changed since then reads as its snapshot version or fails with ESTALE,
//! never with other bytes. Reads go through an open handle or, as on a normal user's mount
//! with opens skipped, by inode with handle 0.
#![allow(missing_docs, clippy::unwrap_used)]

mod support;

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;

use proptest::prelude::*;
use stagefs_fs::FsCore;
use stagefs_prefetch::FileKind;
use support::*;

const DIRS: [&str; 4] = ["", "a", "a/b", "c"];
/// Sizes that exercise empty files, tiny ones, block boundaries, packed multi-block files and
/// files kept as exact copies (> 4 MiB).
const SIZES: [usize; 8] = [
    0,
    1,
    4095,
    65_537,
    1 << 20,
    (1 << 20) + 1,
    3 * (1 << 20) + 17,
    5 * (1 << 20) + 3,
];

#[derive(Debug, Clone)]
enum Op {
    Lookup(usize),
    Readdir(usize, usize),
    /// File, where (fraction of its size), how much, request size, through an open handle
    /// (false: by inode with handle 0, as a normal user's mount with opens skipped reads).
    Read(usize, f64, usize, u32, bool),
    Change(usize),
    Remount,
    Kill,
}

fn op(nfiles: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..nfiles).prop_map(Op::Lookup),
        2 => (0..DIRS.len(), 1..5usize).prop_map(|(d, n)| Op::Readdir(d, n)),
        8 => (0..nfiles, 0.0..1.0f64, 0..3_000_000usize, prop_oneof![Just(4096u32), Just(131_072), Just(1 << 20)], any::<bool>())
            .prop_map(|(f, o, l, c, open)| Op::Read(f, o, l, c, open)),
        1 => (0..nfiles).prop_map(Op::Change),
        1 => Just(Op::Remount),
        1 => Just(Op::Kill),
    ]
}

/// What the snapshot saw.
struct Model {
    files: Vec<(PathBuf, Vec<u8>)>,
    attrs: BTreeMap<PathBuf, (FileKind, u64, u16, i64)>,
    listings: BTreeMap<PathBuf, Vec<std::ffi::OsString>>,
    changed: HashSet<usize>,
}

fn build(root: &std::path::Path, spec: &[(usize, usize)]) -> Model {
    for d in DIRS {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    let mut files = Vec::new();
    for (i, (d, s)) in spec.iter().enumerate() {
        let rel = PathBuf::from(DIRS[*d]).join(format!("f{i:02}"));
        let data = pattern(i as u64 + 1, SIZES[*s]);
        fs::write(root.join(&rel), &data).unwrap();
        files.push((rel, data));
    }
    std::os::unix::fs::symlink("../f00", root.join("a/link")).unwrap();
    let mut attrs = BTreeMap::new();
    let mut listings = BTreeMap::new();
    for d in DIRS {
        let mut names: Vec<_> = fs::read_dir(root.join(d))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for n in &names {
            let rel = PathBuf::from(d).join(n);
            let m = fs::symlink_metadata(root.join(&rel)).unwrap();
            let kind = if m.is_dir() {
                FileKind::Dir
            } else if m.file_type().is_symlink() {
                FileKind::Symlink
            } else {
                FileKind::File
            };
            attrs.insert(
                rel,
                (
                    kind,
                    m.size(),
                    (m.mode() & 0o7777) as u16,
                    m.mtime() * 1_000_000_000 + m.mtime_nsec(),
                ),
            );
        }
        listings.insert(PathBuf::from(d), names);
    }
    Model {
        files,
        attrs,
        listings,
        changed: HashSet::new(),
    }
}

fn run(spec: Vec<(usize, usize)>, ops: Vec<Op>, capacity: u64, stage: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mut model = build(&src, &spec);
    let cache = tmp.path().join("cache");
    let cfg = || {
        let mut c = config(&src, &cache);
        c.cache_size = capacity;
        c.stage = stage;
        c
    };
    let mounted = |c: Arc<FsCore>| {
        // The model is the tree before any change: let the listing finish first (a change
        // made while the mount lists is legitimately seen by the snapshot).
        c.snapshot_ref().wait_complete().unwrap();
        c
    };
    let mut core: Arc<FsCore> = mounted(mount(cfg()).0);
    for op in ops {
        match op {
            Op::Lookup(f) => {
                let rel = &model.files[f].0;
                let a = lookup(&core, rel).unwrap();
                let (kind, size, perm, mtime) = model.attrs[rel];
                assert_eq!(
                    (a.kind, a.size, a.perm),
                    (kind, size, perm),
                    "{}",
                    rel.display()
                );
                let got = a
                    .mtime
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as i64;
                assert_eq!(got, mtime, "mtime of {}", rel.display());
            }
            Op::Readdir(d, chunk) => {
                let want = &model.listings[&PathBuf::from(DIRS[d])];
                assert_eq!(
                    &names(&core, &PathBuf::from(DIRS[d]), chunk).unwrap(),
                    want,
                    "listing of {:?}",
                    DIRS[d]
                );
            }
            Op::Read(f, frac, len, chunk, open) => {
                let (rel, data) = &model.files[f];
                let off = (data.len() as f64 * frac) as u64;
                let end = (off as usize + len).min(data.len());
                match read_as(&core, rel, off, len as u64, chunk, open) {
                    Ok(got) => assert!(
                        got == data[off as usize..end],
                        "bytes of {} at {off}+{len}",
                        rel.display()
                    ),
                    Err(e) => {
                        assert!(
                            model.changed.contains(&f),
                            "read of unchanged {} failed: {e}",
                            rel.display()
                        );
                        assert_eq!(e.errno(), libc::ESTALE, "{e}");
                    }
                }
            }
            Op::Change(f) => {
                let (rel, data) = &model.files[f];
                std::thread::sleep(std::time::Duration::from_millis(2));
                fs::write(src.join(rel), pattern(1000 + f as u64, data.len() + 3)).unwrap();
                model.changed.insert(f);
            }
            Op::Remount => {
                core.shutdown();
                core = mounted(mount(cfg()).0);
            }
            Op::Kill => {
                core.abandon();
                core = mounted(mount(cfg()).0);
            }
        }
        // The symlink is served as stored.
        let l = lookup(&core, &PathBuf::from("a/link")).unwrap();
        assert_eq!(core.readlink(l.ino).unwrap(), b"../f00");
    }
    core.shutdown();
}

fn spec() -> impl Strategy<Value = Vec<(usize, usize)>> {
    proptest::collection::vec((0..DIRS.len(), 0..SIZES.len()), 1..10)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn core_answers_like_the_snapshot_of_the_source(
        (spec, ops) in spec().prop_flat_map(|s| { let n = s.len(); (Just(s), proptest::collection::vec(op(n), 1..25)) }),
        small_cache in any::<bool>(),
        stage in any::<bool>(),
    ) {
        // A 3 MiB cache forces evictions (and refusals for files larger than the cache).
        let capacity = if small_cache { 3 << 20 } else { 256 << 20 };
        run(spec, ops, capacity, stage);
    }
}
