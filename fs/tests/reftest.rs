//! Reference-model property test of the filesystem core (after mountpoint-s3's reftests):
//! proptest generates a tree and a sequence of operations — lookups, listings in chunks, reads
//! at random offsets and sizes, remounts, kills (no index written) and remounts, and changes to
//! source files — runs them against `FsCore` over an injected source, and compares every
//! answer with the model: the tree as `std::fs` saw it when the snapshot was taken. Snapshot
//! semantics: a file changed since then reads as its snapshot version or fails with ESTALE,
//! never with other bytes. Reads go through an open handle or, as on a normal user's mount
//! with opens skipped, by inode with handle 0. A table at the root is read through its
//! `.npy/` view and compared with the view rendered straight from the source (what `stagefs
//! convert` writes). With `--revalidate` (which the mount serves with the daemon's opens) a
//! changed file reads as its old version, its new one or ESTALE — never a mix — and its
//! attributes are the old or the new ones.
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

/// The table at the source's root, and its column views in the mount.
const TABLE: &str = "t.csv";
const VIEWS: [&str; 2] = ["id.npy", "x.npy"];
const TABLE_ROWS: usize = 6000;

#[derive(Debug, Clone)]
enum Op {
    Lookup(usize),
    Readdir(usize, usize),
    /// File, where (fraction of its size), how much, request size, through an open handle
    /// (false: by inode with handle 0, as a normal user's mount with opens skipped reads).
    Read(usize, f64, usize, u32, bool),
    /// A column view of the table: which, where, how much, request size, open handle.
    ViewRead(usize, f64, usize, u32, bool),
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
        3 => (0..VIEWS.len(), 0.0..1.0f64, 0..100_000usize, prop_oneof![Just(4096u32), Just(131_072)], any::<bool>())
            .prop_map(|(v, o, l, c, open)| Op::ViewRead(v, o, l, c, open)),
        1 => (0..nfiles).prop_map(Op::Change),
        1 => Just(Op::Remount),
        1 => Just(Op::Kill),
    ]
}

/// What the snapshot saw.
struct Model {
    files: Vec<(PathBuf, Vec<u8>)>,
    /// What each changed file holds now.
    changed_to: BTreeMap<usize, Vec<u8>>,
    /// The column views, rendered from the source without the mount.
    views: Vec<Vec<u8>>,
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
    let mut table = String::from("id,x\n");
    for i in 0..TABLE_ROWS {
        table += &format!("{i},{}\n", i as f64 * 0.25 - 7.0);
    }
    fs::write(root.join(TABLE), table).unwrap();
    let views = rendered_views(root);
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
        changed_to: BTreeMap::new(),
        views,
        attrs,
        listings,
        changed: HashSet::new(),
    }
}

/// The table's column views as the views crate renders them from the source directly.
fn rendered_views(root: &std::path::Path) -> Vec<Vec<u8>> {
    use stagefs_views::{open_view, DirSource, ViewOptions, ViewTree};
    let src: Arc<DirSource> = Arc::new(DirSource::new(root));
    let tree = ViewTree::scan(&*src).unwrap();
    VIEWS
        .iter()
        .map(|v| {
            let rel = PathBuf::from(TABLE).join(v);
            let view = open_view(src.clone(), &tree, &rel, &ViewOptions::default()).unwrap();
            let mut out = vec![0u8; view.len() as usize];
            assert_eq!(view.read_at(0, &mut out).unwrap(), out.len());
            out
        })
        .collect()
}

fn run(spec: Vec<(usize, usize)>, ops: Vec<Op>, capacity: u64, stage: bool, revalidate: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let mut model = build(&src, &spec);
    let cache = tmp.path().join("cache");
    let cfg = || {
        let mut c = config(&src, &cache);
        c.cache_size = capacity;
        c.stage = stage;
        // Every attribute older than a millisecond is asked again: changes are seen at once.
        c.revalidate = revalidate.then_some(std::time::Duration::from_millis(1));
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
                if revalidate && model.changed.contains(&f) {
                    // Old or new: the size tells which (a change adds 3 bytes).
                    let new = model.changed_to[&f].len() as u64;
                    assert!(a.size == size || a.size == new, "size of {}", rel.display());
                    continue;
                }
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
                // Under --revalidate the mount asks the daemon at every open.
                let open = open || revalidate;
                let now = |d: &[u8]| {
                    d[(off as usize).min(d.len())..(off as usize + len).min(d.len())].to_vec()
                };
                match read_as(&core, rel, off, len as u64, chunk, open) {
                    Ok(got) => assert!(
                        got == data[off as usize..end]
                            || (revalidate
                                && model.changed_to.get(&f).is_some_and(|n| got == now(n))),
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
            Op::ViewRead(v, frac, len, chunk, open) => {
                let want = &model.views[v];
                let off = (want.len() as f64 * frac) as usize;
                let end = (off + len).min(want.len());
                let rel = PathBuf::from(".npy").join(TABLE).join(VIEWS[v]);
                let got = read_as(
                    &core,
                    &rel,
                    off as u64,
                    len as u64,
                    chunk,
                    open || revalidate,
                )
                .unwrap_or_else(|e| panic!("view {} at {off}+{len}: {e}", rel.display()));
                assert!(
                    got == want[off..end],
                    "view bytes of {} at {off}+{len}",
                    rel.display()
                );
            }
            Op::Change(f) => {
                let (rel, data) = &model.files[f];
                std::thread::sleep(std::time::Duration::from_millis(2));
                let new = pattern(1000 + f as u64, data.len() + 3);
                fs::write(src.join(rel), &new).unwrap();
                model.changed.insert(f);
                model.changed_to.insert(f, new);
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
        revalidate in any::<bool>(),
    ) {
        // A 3 MiB cache forces evictions (and refusals for files larger than the cache).
        let capacity = if small_cache { 3 << 20 } else { 256 << 20 };
        run(spec, ops, capacity, stage, revalidate);
    }
}
