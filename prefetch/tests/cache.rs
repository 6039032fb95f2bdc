//! Cache and fetcher behaviour without FUSE: validation, eviction, checksums, remount reuse,
//! and the fetch scheduler against slow and failing sources.
#![allow(missing_docs, clippy::unwrap_used)]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use stagefs_prefetch::{
    CacheStore, FetchConfig, Fetcher, LocalSource, Priority, Signature, Source, SourceError, Stats,
    StoreConfig, BLOCK_SIZE,
};

const MB: u64 = BLOCK_SIZE;

fn sig(size: u64, mtime_ns: i64) -> Signature {
    Signature {
        size,
        mtime_ns,
        ino: 0,
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn store(dir: &Path, capacity: u64) -> (Arc<CacheStore>, Arc<Stats>) {
    let stats = Arc::new(Stats::default());
    let s = CacheStore::open(
        &StoreConfig {
            dir: dir.to_path_buf(),
            capacity,
        },
        stats.clone(),
    )
    .unwrap();
    (Arc::new(s), stats)
}

fn data_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for sub in fs::read_dir(dir.join("v1")).unwrap().flatten() {
        if sub.path().is_dir() {
            for f in fs::read_dir(sub.path()).unwrap().flatten() {
                if f.path().extension().is_some_and(|e| e == "data") {
                    out.push(f.path());
                }
            }
        }
    }
    out
}

#[test]
fn block_round_trips_and_is_bound_to_size_and_mtime() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _) = store(tmp.path(), 100 * MB);
    let rel = Path::new("a/b.bin");
    let data = pattern(1, 1000);
    let sg = sig(1000, 5);
    assert!(s.insert_block(rel, sg, 0, &data));
    let mut buf = vec![0; MB as usize];
    assert_eq!(s.read_block(rel, sg, 0, &mut buf), Some(1000));
    assert_eq!(&buf[..1000], &data[..]);
    // Same size, other mtime: a different version of the file, never served.
    assert_eq!(s.read_block(rel, sig(1000, 6), 0, &mut buf), None);
    // Other size: likewise.
    assert_eq!(s.read_block(rel, sig(1001, 5), 0, &mut buf), None);
    // Another path with the same signature has nothing cached.
    assert_eq!(s.read_block(Path::new("a/c.bin"), sg, 0, &mut buf), None);
}

#[test]
fn wrong_length_block_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _) = store(tmp.path(), 100 * MB);
    assert!(!s.insert_block(Path::new("x"), sig(2 * MB, 1), 0, &[0u8; 10]));
}

#[test]
fn corrupted_block_is_a_miss_never_wrong_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, stats) = store(tmp.path(), 100 * MB);
    let rel = Path::new("f");
    let sg = sig(2 * MB, 1);
    let data = pattern(2, 2 * MB as usize);
    assert!(s.insert_block(rel, sg, 0, &data[..MB as usize]));
    assert!(s.insert_block(rel, sg, 1, &data[MB as usize..]));
    let file = &data_files(tmp.path())[0];
    let f = fs::OpenOptions::new().write(true).open(file).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"garbage", MB + 100).unwrap();
    let mut buf = vec![0; MB as usize];
    assert_eq!(
        s.read_block(rel, sg, 1, &mut buf),
        None,
        "corrupt block must not be served"
    );
    assert_eq!(stats.corrupt_blocks.load(SeqCst), 1);
    assert_eq!(
        s.read_block(rel, sg, 0, &mut buf),
        Some(MB as usize),
        "intact block still served"
    );
    assert!(
        !s.contains(rel, sg, 1),
        "corrupt block is dropped so it gets re-fetched"
    );
}

#[test]
fn capacity_is_respected_with_lru_eviction() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, stats) = store(tmp.path(), 3 * MB);
    let sg = sig(MB, 1);
    let block = pattern(3, MB as usize);
    for name in ["a", "b", "c"] {
        assert!(s.insert_block(Path::new(name), sg, 0, &block));
    }
    let mut buf = vec![0; MB as usize];
    // Touch "a": "b" becomes least recently used.
    assert!(s.read_block(Path::new("a"), sg, 0, &mut buf).is_some());
    assert!(s.insert_block(Path::new("d"), sg, 0, &block));
    assert!(s.used() <= 3 * MB);
    assert!(!s.contains(Path::new("b"), sg, 0));
    assert!(s.contains(Path::new("a"), sg, 0));
    assert!(s.contains(Path::new("d"), sg, 0));
    assert_eq!(stats.blocks_evicted.load(SeqCst), 1);
}

#[test]
fn pinned_file_survives_eviction_pressure() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _) = store(tmp.path(), 2 * MB);
    let sg = sig(MB, 1);
    let block = pattern(4, MB as usize);
    assert!(s.insert_block(Path::new("pinned"), sg, 0, &block));
    let f = s
        .pin_complete(Path::new("pinned"), sg)
        .expect("complete file pins");
    assert!(s.insert_block(Path::new("x"), sg, 0, &block));
    assert!(
        s.insert_block(Path::new("y"), sg, 0, &block),
        "evicts x, not the pinned file"
    );
    assert!(s.contains(Path::new("pinned"), sg, 0));
    let mut buf = vec![0; MB as usize];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut buf, 0).unwrap();
    assert_eq!(buf, block);
    s.unpin(Path::new("pinned"));
    assert!(s.insert_block(Path::new("z"), sg, 0, &block));
}

#[test]
fn remount_reuses_flushed_blocks_without_scanning_data() {
    let tmp = tempfile::tempdir().unwrap();
    let rel = Path::new("dir/file.bin");
    let sg = sig(3 * MB + 5, 42);
    let data = pattern(5, sg.size as usize);
    {
        let (s, _) = store(tmp.path(), 100 * MB);
        for idx in 0..4u64 {
            let lo = (idx * MB) as usize;
            let hi = ((idx + 1) * MB).min(sg.size) as usize;
            assert!(s.insert_block(rel, sg, idx, &data[lo..hi]));
        }
        s.flush().unwrap();
    }
    let (s, stats) = store(tmp.path(), 100 * MB);
    assert!(s.is_complete(rel, sg));
    assert_eq!(s.used(), sg.size);
    assert_eq!(stats.files_staged.load(SeqCst), 1);
    let mut buf = vec![0; MB as usize];
    assert_eq!(s.read_block(rel, sg, 3, &mut buf), Some(5));
    assert_eq!(&buf[..5], &data[3 * MB as usize..]);
}

#[test]
fn blocks_written_after_the_last_flush_are_forgotten_not_corrupt() {
    // A daemon killed between a block write and the next header flush.
    let tmp = tempfile::tempdir().unwrap();
    let rel = Path::new("f");
    let sg = sig(2 * MB, 1);
    let data = pattern(6, 2 * MB as usize);
    {
        let (s, _) = store(tmp.path(), 100 * MB);
        assert!(s.insert_block(rel, sg, 0, &data[..MB as usize]));
        s.flush().unwrap();
        assert!(s.insert_block(rel, sg, 1, &data[MB as usize..]));
        std::mem::forget(s); // no flush, no destructor: like kill -9
    }
    let (s, _) = store(tmp.path(), 100 * MB);
    assert!(s.contains(rel, sg, 0));
    assert!(!s.contains(rel, sg, 1));
}

#[test]
fn lower_capacity_at_remount_evicts_down_to_it() {
    let tmp = tempfile::tempdir().unwrap();
    let sg = sig(MB, 1);
    {
        let (s, _) = store(tmp.path(), 10 * MB);
        for i in 0..5 {
            assert!(s.insert_block(Path::new(&format!("f{i}")), sg, 0, &pattern(i, MB as usize)));
        }
        s.flush().unwrap();
    }
    let (s, _) = store(tmp.path(), 2 * MB);
    assert!(s.used() <= 2 * MB);
    // The most recently used survive.
    assert!(s.contains(Path::new("f4"), sg, 0));
}

#[test]
fn headers_of_another_format_are_discarded() {
    let tmp = tempfile::tempdir().unwrap();
    let sg = sig(10, 1);
    {
        let (s, _) = store(tmp.path(), 10 * MB);
        assert!(s.insert_block(Path::new("f"), sg, 0, &[7; 10]));
        s.flush().unwrap();
    }
    for sub in fs::read_dir(tmp.path().join("v1")).unwrap().flatten() {
        for f in fs::read_dir(sub.path()).unwrap().flatten() {
            if f.path().extension().is_some_and(|e| e == "meta") {
                let text = fs::read_to_string(f.path())
                    .unwrap()
                    .replace("\"format\":1", "\"format\":99");
                fs::write(f.path(), text).unwrap();
            }
        }
    }
    let (s, _) = store(tmp.path(), 10 * MB);
    assert!(!s.contains(Path::new("f"), sg, 0));
    assert!(data_files(tmp.path()).is_empty(), "stale data is removed");
}

/// A source that counts reads, can be slowed down and can be made to fail.
struct TestSource {
    inner: LocalSource,
    reads: AtomicUsize,
    delay: Duration,
    fail: AtomicBool,
}

impl Source for TestSource {
    fn stat(&self, rel: &Path) -> Result<stagefs_prefetch::source::Meta, SourceError> {
        self.inner.stat(rel)
    }
    fn read_dir(&self, rel: &Path) -> Result<Vec<stagefs_prefetch::source::DirName>, SourceError> {
        self.inner.read_dir(rel)
    }
    fn readlink(&self, rel: &Path) -> Result<Vec<u8>, SourceError> {
        self.inner.readlink(rel)
    }
    fn read_at(
        &self,
        rel: &Path,
        sig: Signature,
        offset: u64,
        buf: usize,
    ) -> Result<bytes::Bytes, SourceError> {
        self.reads.fetch_add(1, SeqCst);
        std::thread::sleep(self.delay);
        if self.fail.load(SeqCst) {
            return Err(SourceError::Io {
                path: rel.to_path_buf(),
                source: std::io::Error::other("injected"),
            });
        }
        self.inner.read_at(rel, sig, offset, buf)
    }
}

fn setup(
    size: usize,
    delay_ms: u64,
) -> (
    tempfile::TempDir,
    Arc<TestSource>,
    Fetcher,
    Signature,
    Vec<u8>,
) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    let data = pattern(9, size);
    fs::write(src.join("f"), &data).unwrap();
    let sg = Signature::of(&fs::metadata(src.join("f")).unwrap());
    let source = Arc::new(TestSource {
        inner: LocalSource::new(&src).unwrap(),
        reads: AtomicUsize::new(0),
        delay: Duration::from_millis(delay_ms),
        fail: AtomicBool::new(false),
    });
    let (s, stats) = store(&tmp.path().join("cache"), 100 * MB);
    let f = Fetcher::new(
        s,
        source.clone(),
        stats,
        FetchConfig {
            workers: 4,
            max_queued: 64,
        },
    )
    .unwrap();
    (tmp, source, f, sg, data)
}

#[test]
fn concurrent_demand_reads_of_one_block_fetch_it_once() {
    let (_tmp, source, fetcher, sg, data) = setup(MB as usize, 200);
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let f = fetcher.clone();
            std::thread::spawn(move || f.read(Path::new("f"), sg, i * 1000, 4096).unwrap())
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        let got = t.join().unwrap();
        assert_eq!(got, data[i * 1000..i * 1000 + 4096]);
    }
    assert_eq!(source.reads.load(SeqCst), 1);
    fetcher.shutdown();
}

#[test]
fn demand_read_spanning_blocks_returns_exact_bytes_and_caches_them() {
    let (_tmp, source, fetcher, sg, data) = setup(3 * MB as usize + 77, 0);
    let off = MB - 10;
    let got = fetcher
        .read(Path::new("f"), sg, off, 2 * MB as usize)
        .unwrap();
    assert_eq!(got, data[off as usize..(off + 2 * MB) as usize]);
    let reads = source.reads.load(SeqCst);
    let again = fetcher
        .read(Path::new("f"), sg, off, 2 * MB as usize)
        .unwrap();
    assert_eq!(again, got);
    assert_eq!(
        source.reads.load(SeqCst),
        reads,
        "second read comes from the cache"
    );
    // Reads past the end are short, not errors.
    let tail = fetcher.read(Path::new("f"), sg, sg.size - 7, 100).unwrap();
    assert_eq!(tail, data[data.len() - 7..]);
    assert!(fetcher
        .read(Path::new("f"), sg, sg.size + 5, 100)
        .unwrap()
        .is_empty());
    fetcher.shutdown();
}

#[test]
fn prefetch_fills_the_cache_ahead_of_the_reader() {
    let (_tmp, source, fetcher, sg, data) = setup(4 * MB as usize, 20);
    let rel: Arc<Path> = Path::new("f").into();
    fetcher.prefetch(&rel, sg, 0..4, Priority::ReadAhead);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !(0..4).all(|i| fetcher.store().contains(&rel, sg, i)) {
        assert!(
            std::time::Instant::now() < deadline,
            "prefetch did not complete"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let reads = source.reads.load(SeqCst);
    assert_eq!(fetcher.read(&rel, sg, 0, data.len()).unwrap(), data);
    assert_eq!(source.reads.load(SeqCst), reads);
    assert_eq!(
        fetcher.stats().bytes_prefetched.load(SeqCst),
        data.len() as u64
    );
    fetcher.shutdown();
}

#[test]
fn failing_source_fails_the_read_and_caches_nothing() {
    let (_tmp, source, fetcher, sg, _) = setup(MB as usize, 0);
    source.fail.store(true, SeqCst);
    assert!(fetcher.read(Path::new("f"), sg, 0, 100).is_err());
    assert!(!fetcher.store().contains(Path::new("f"), sg, 0));
    source.fail.store(false, SeqCst);
    assert_eq!(fetcher.read(Path::new("f"), sg, 0, 100).unwrap().len(), 100);
    fetcher.shutdown();
}

#[test]
fn file_changed_on_source_is_reported_not_mixed() {
    let (tmp, _source, fetcher, sg, _) = setup(2 * MB as usize, 0);
    fetcher.read(Path::new("f"), sg, 0, 10).unwrap();
    std::thread::sleep(Duration::from_millis(10));
    fs::write(tmp.path().join("src/f"), pattern(10, 2 * MB as usize)).unwrap();
    let err = fetcher.read(Path::new("f"), sg, MB, 10).unwrap_err();
    assert!(matches!(err, SourceError::Changed { .. }), "{err}");
    // The cached block of the old version is dropped too.
    assert!(!fetcher.store().contains(Path::new("f"), sg, 0));
    fetcher.shutdown();
}

#[test]
fn staging_waits_while_a_reader_is_waiting_on_the_source() {
    // Demand reads run on the caller's thread, so even with every worker busy staging, a reader
    // is served after at most one source round trip of its own.
    let (_tmp, source, fetcher, sg, data) = setup(8 * MB as usize, 50);
    let rel: Arc<Path> = Path::new("f").into();
    fetcher.prefetch(&rel, sg, 1..8, Priority::Staging);
    let t = std::time::Instant::now();
    let got = fetcher.read(&rel, sg, 0, 10).unwrap();
    assert_eq!(got, data[..10]);
    assert!(source.reads.load(SeqCst) >= 1);
    assert!(t.elapsed() < Duration::from_secs(5));
    fetcher.shutdown();
}
