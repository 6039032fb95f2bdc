//! Regression: the store kept one open descriptor per cached file, so a dataset of 20,000
//! small files failed reads with EMFILE. Descriptors are now an LRU of bounded size.
#![allow(missing_docs, clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use stagefs_prefetch::store::OPEN_DATA_FILES;
use stagefs_prefetch::{CacheStore, Signature, Stats, StoreConfig};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn regression_many_small_files_do_not_exhaust_descriptors() {
    let tmp = tempfile::tempdir().unwrap();
    let store = CacheStore::open(
        &StoreConfig {
            dir: tmp.path().to_path_buf(),
            capacity: 1 << 30,
        },
        Arc::new(Stats::default()),
    )
    .unwrap();
    let before = open_fds();
    let sig = Signature {
        size: 100,
        mtime_ns: 1,
        ino: 0,
    };
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..3 * OPEN_DATA_FILES {
        let rel = PathBuf::from(format!("class{}/img{i}.jpg", i % 10));
        assert!(store.insert_block(&rel, sig, 0, &[i as u8; 100]));
        assert_eq!(store.read_block(&rel, sig, 0, &mut buf), Some(100));
    }
    let grown = open_fds().saturating_sub(before);
    assert!(
        grown <= OPEN_DATA_FILES,
        "{grown} descriptors held for {} files",
        3 * OPEN_DATA_FILES
    );
}
