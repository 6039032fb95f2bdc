//! A many-small-file dataset through a real mount: 200,000 files read byte-exact, a remount
//! that lists nothing and re-reads nothing from the source, and a cache whose file count grows
//! with bytes, not files.
#![allow(missing_docs, clippy::unwrap_used)]

mod common;

use stagefs_test_support::{test, Need};

use std::fs;
use std::path::Path;

use common::Mount;

const DIRS: usize = 200;
const PER_DIR: usize = 1000;

/// The bytes of file `i`: 1–4 KB derived from its number (so checking needs no second read of
/// the source).
fn content(i: usize) -> Vec<u8> {
    let len = 1000 + (i * 7919) % 3000;
    common::pattern(i as u64, len)
}

fn generate(src: &Path) {
    for d in 0..DIRS {
        let dir = src.join(format!("n{d:04}"));
        fs::create_dir_all(&dir).unwrap();
        for f in 0..PER_DIR {
            let i = d * PER_DIR + f;
            fs::write(dir.join(format!("{i:07}.jpg")), content(i)).unwrap();
        }
    }
}

fn read_all(mnt: &Path) -> usize {
    let mut n = 0;
    let mut dirs: Vec<_> = fs::read_dir(mnt)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    for d in dirs {
        let mut files: Vec<_> = fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        for f in files {
            let i: usize = f.file_stem().unwrap().to_str().unwrap().parse().unwrap();
            assert!(
                fs::read(&f).unwrap() == content(i),
                "bytes of {}",
                f.display()
            );
            n += 1;
        }
    }
    n
}

fn files_under(dir: &Path) -> usize {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                n += 1;
            }
        }
    }
    n
}

fn two_hundred_thousand_small_files_read_exact_and_remount_lists_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    generate(&src);
    let mut m = Mount::new(tmp.path(), &src, &["--no-staging", "--no-passthrough"]);
    assert_eq!(read_all(&m.mnt), DIRS * PER_DIR);
    let s = m.stats();
    assert_eq!(s["snapshot"], "listed", "{s}");
    assert_eq!(
        s["snapshot_entries"].as_u64().unwrap(),
        (1 + DIRS + DIRS * PER_DIR) as u64
    );
    m.umount();
    // Packed: the cache holds a handful of files for 200,000 cached ones.
    let cached = files_under(&m.cache);
    assert!(
        cached <= DIRS * PER_DIR / 100,
        "{cached} files on scratch for {} cached",
        DIRS * PER_DIR
    );
    m.mount();
    assert_eq!(read_all(&m.mnt), DIRS * PER_DIR);
    let s = m.stats();
    assert_eq!(s["snapshot"], "cache", "{s}");
    // One stat, of the source root (is it still the tree the kept snapshot is of?).
    assert_eq!(
        s["metadata_requests"], 1,
        "the remount listed the source: {s}"
    );
    assert_eq!(s["bytes_from_source"], 0, "the remount re-read data: {s}");
    m.umount();
}

fn main() -> std::process::ExitCode {
    stagefs_test_support::run(vec![test!(
        two_hundred_thousand_small_files_read_exact_and_remount_lists_nothing,
        Need::Fuse
    )])
}
