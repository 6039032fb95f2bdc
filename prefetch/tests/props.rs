//! Property tests of the cache store: whatever sequence of inserts, reads, invalidations,
//! flushes and remounts happens, a read returns the exact bytes of the version asked for or a
//! miss, and the cache never holds more than its capacity.
#![allow(missing_docs, clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;
use stagefs_prefetch::{
    block_count, block_len, CacheStore, Signature, Stats, StoreConfig, BLOCK_SIZE,
};

#[derive(Debug, Clone)]
enum Op {
    Insert { file: u8, version: u8, block: u8 },
    Read { file: u8, version: u8, block: u8 },
    Invalidate { file: u8 },
    FlushAndRemount,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..4u8, 0..2u8, 0..4u8).prop_map(|(file, version, block)| Op::Insert { file, version, block }),
        6 => (0..4u8, 0..2u8, 0..4u8).prop_map(|(file, version, block)| Op::Read { file, version, block }),
        1 => (0..4u8).prop_map(|file| Op::Invalidate { file }),
        1 => Just(Op::FlushAndRemount),
    ]
}

/// File `f` at `version` has this size (versions differ in size or mtime) and these bytes.
fn sig(file: u8, version: u8) -> Signature {
    let size = u64::from(file) * 300_000 + 2 * BLOCK_SIZE + u64::from(version % 2) * 7;
    Signature {
        size,
        mtime_ns: i64::from(version) + 1,
        ino: 0,
    }
}

fn block_bytes(file: u8, version: u8, block: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u64 * 31 + block * 7 + u64::from(file) * 13 + u64::from(version) * 101) as u8
        })
        .collect()
}

fn path(file: u8) -> PathBuf {
    PathBuf::from(format!("d/file{file}"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn reads_are_exact_or_miss_and_capacity_holds(ops in proptest::collection::vec(op(), 1..40)) {
        let tmp = tempfile::tempdir().unwrap();
        let capacity = 5 * BLOCK_SIZE;
        let open = || Arc::new(CacheStore::open(&StoreConfig { dir: tmp.path().to_path_buf(), capacity }, Arc::new(Stats::default())).unwrap());
        let mut store = open();
        let mut inserted: HashMap<(u8, u8, u64), bool> = HashMap::new();
        let mut buf = vec![0u8; BLOCK_SIZE as usize];
        for op in ops {
            match op {
                Op::Insert { file, version, block } => {
                    let s = sig(file, version);
                    let b = u64::from(block) % block_count(s.size);
                    let data = block_bytes(file, version, b, block_len(s.size, b) as usize);
                    if store.insert_block(&path(file), s, b, &data) {
                        inserted.insert((file, version, b), true);
                    }
                }
                Op::Read { file, version, block } => {
                    let s = sig(file, version);
                    let b = u64::from(block) % block_count(s.size);
                    if let Some(n) = store.read_block(&path(file), s, b, &mut buf) {
                        prop_assert!(inserted.contains_key(&(file, version, b)), "served a block never cached");
                        prop_assert_eq!(&buf[..n], &block_bytes(file, version, b, block_len(s.size, b) as usize)[..]);
                    }
                }
                Op::Invalidate { file } => store.invalidate(Path::new(&path(file))),
                Op::FlushAndRemount => {
                    store.flush().unwrap();
                    drop(store);
                    store = open();
                }
            }
            prop_assert!(store.used() <= capacity, "used {} > capacity {}", store.used(), capacity);
        }
    }
}
