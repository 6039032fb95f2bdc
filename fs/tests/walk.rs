//! The walker ([`stagefs_fs::walk`]): cached files pushed ahead of a reader that walks a
//! directory in order, through a recording page sink; never ahead of a shuffled reader, never
//! a corrupt block.
#![allow(missing_docs, clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::fs;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stagefs_fs::sink::PageSink;
use stagefs_fs::FsCore;
use support::*;

const FILES: usize = 300;

fn name(i: usize) -> String {
    format!("d/f{i:04}.jpg")
}

fn size(i: usize) -> usize {
    5_000 + (i * 7919) % 60_000
}

fn setup() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir_all(src.join("d")).unwrap();
    for i in 0..FILES {
        fs::write(src.join(name(i)), pattern(i as u64, size(i))).unwrap();
    }
    let cache = tmp.path().join("cache");
    (tmp, src, cache)
}

/// Pages pushed to one inode: (offset, bytes).
type Pages = Vec<(u64, Vec<u8>)>;

/// Pushed pages by inode.
#[derive(Default)]
struct Recorder {
    pushed: Mutex<HashMap<u64, Pages>>,
}

impl PageSink for Recorder {
    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> bool {
        self.pushed
            .lock()
            .unwrap()
            .entry(ino)
            .or_default()
            .push((offset, data.to_vec()));
        true
    }
}

/// Fills the cache: every file read once, then a remount on it.
fn warm(src: &std::path::Path, cache: &std::path::Path) -> Arc<FsCore> {
    let (c, _) = mount(config(src, cache));
    for i in 0..FILES {
        read(&c, &rel(&name(i)), 0, 1 << 20, 1 << 20).unwrap();
    }
    c.shutdown();
    mount(config(src, cache)).0
}

/// Waits until the walker has been quiet for a moment.
fn settle(rec: &Recorder) {
    let mut last = usize::MAX;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        let n = rec.pushed.lock().unwrap().len();
        if n == last {
            return;
        }
        last = n;
    }
}

#[test]
fn an_in_order_reader_gets_the_next_cached_files_pushed_byte_exact() {
    let (_t, src, cache) = setup();
    let c = warm(&src, &cache);
    let rec = Arc::new(Recorder::default());
    c.set_page_sink(Some(rec.clone()));
    // Read files 0 and 1 in order, as ImageFolder order would.
    for i in 0..2 {
        read(&c, &rel(&name(i)), 0, 1 << 20, 1 << 20).unwrap();
    }
    settle(&rec);
    let pushed = rec.pushed.lock().unwrap();
    let mut inos: Vec<u64> = pushed.keys().copied().collect();
    inos.sort_unstable();
    assert!(
        pushed.len() >= 32,
        "a window of files after the second read is pushed, got {}",
        pushed.len()
    );
    // Each pushed inode is a file after file 1, its pages exactly its bytes.
    for i in 2..FILES {
        let ino = lookup(&c, &rel(&name(i))).unwrap().ino;
        if let Some(pages) = pushed.get(&ino) {
            let mut got = Vec::new();
            for (off, d) in pages {
                assert_eq!(*off as usize, got.len());
                got.extend_from_slice(d);
            }
            assert!(
                got == pattern(i as u64, size(i)),
                "file {i} pushed wrong bytes"
            );
        }
    }
    for i in 0..2 {
        let ino = lookup(&c, &rel(&name(i))).unwrap().ino;
        assert!(!pushed.contains_key(&ino), "file {i} was already read");
    }
    drop(pushed);
    let stats = c.stats_json();
    assert!(!stats.contains("\"files_pushed\": 0,"), "{stats}");
    c.shutdown();
}

#[test]
fn a_shuffled_reader_gets_nothing_pushed() {
    let (_t, src, cache) = setup();
    let c = warm(&src, &cache);
    let rec = Arc::new(Recorder::default());
    c.set_page_sink(Some(rec.clone()));
    // A fixed "shuffle" with no two consecutive files in a row.
    for i in (0..FILES).map(|i| (i * 97) % FILES).take(100) {
        read(&c, &rel(&name(i)), 0, 1 << 20, 1 << 20).unwrap();
    }
    settle(&rec);
    assert!(rec.pushed.lock().unwrap().is_empty());
    c.shutdown();
}

#[test]
fn nothing_is_pushed_without_a_sink_or_from_an_uncached_file() {
    let (_t, src, cache) = setup();
    // Cold cache: an in-order reader gets the next files prefetched, not pushed; reads are
    // byte-exact either way.
    let (c, _) = mount(config(&src, &cache));
    let rec = Arc::new(Recorder::default());
    c.set_page_sink(Some(rec.clone()));
    for i in 0..2 {
        assert!(
            read(&c, &rel(&name(i)), 0, 1 << 20, 1 << 20).unwrap() == pattern(i as u64, size(i))
        );
    }
    settle(&rec);
    // Whatever got pushed was cached (prefetched) by then, and byte-exact.
    for (ino, pages) in rec.pushed.lock().unwrap().iter() {
        let i = (2..FILES)
            .find(|i| lookup(&c, &rel(&name(*i))).unwrap().ino == *ino)
            .unwrap();
        let got: Vec<u8> = pages.iter().flat_map(|(_, d)| d.clone()).collect();
        assert!(got == pattern(i as u64, size(i)));
    }
    c.set_page_sink(None);
    c.shutdown();
}

#[test]
fn corrupt_cache_blocks_are_never_pushed() {
    let (_t, src, cache) = setup();
    let c = warm(&src, &cache);
    c.shutdown();
    for e in fs::read_dir(cache.join("v2/segments")).unwrap() {
        let p = e.unwrap().path();
        let mut b = fs::read(&p).unwrap();
        for i in (0..b.len()).step_by(4096) {
            b[i] ^= 0x55;
        }
        fs::write(&p, b).unwrap();
    }
    let (c, _) = mount(config(&src, &cache));
    let rec = Arc::new(Recorder::default());
    c.set_page_sink(Some(rec.clone()));
    for i in 0..2 {
        assert!(
            read(&c, &rel(&name(i)), 0, 1 << 20, 1 << 20).unwrap() == pattern(i as u64, size(i))
        );
    }
    settle(&rec);
    // Every cached block failed its checksum: whatever was pushed came from a re-fetch.
    for (ino, pages) in rec.pushed.lock().unwrap().iter() {
        let i = (2..FILES)
            .find(|i| lookup(&c, &rel(&name(*i))).unwrap().ino == *ino)
            .unwrap();
        let got: Vec<u8> = pages.iter().flat_map(|(_, d)| d.clone()).collect();
        assert!(
            got == pattern(i as u64, size(i)),
            "file {i}: corrupt bytes pushed"
        );
    }
    c.shutdown();
}
