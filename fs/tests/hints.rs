//! Read-order hints ([`stagefs_fs::hints`]): bad hints are rejected with a reason and counted,
//! never changing a read; accepted ones fetch (and push) source blocks and render views ahead.
#![allow(missing_docs, clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stagefs_fs::hints::{Rejected, MAX_LINE, MAX_RANGES};
use stagefs_fs::sink::PageSink;
use stagefs_fs::FsCore;
use stagefs_prefetch::BLOCK_SIZE;
use support::*;

const BIG: usize = 8 * BLOCK_SIZE as usize + 12345;
const ROWS: usize = 5000;

fn setup() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("big.bin"), pattern(7, BIG)).unwrap();
    let mut csv = String::from("name,value\n");
    for i in 0..ROWS {
        csv.push_str(&format!("n{i},{}\n", i * 3));
    }
    fs::write(src.join("t.csv"), csv).unwrap();
    let cache = tmp.path().join("cache");
    (tmp, src, cache)
}

fn until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Pages pushed to one inode: (offset, bytes).
type Pages = Vec<(u64, Vec<u8>)>;
/// A hint line and the reason it must be rejected for.
type Case = (Vec<u8>, fn(&Rejected) -> bool);

/// Pages pushed, by inode.
#[derive(Default)]
struct Recorder {
    pushed: Mutex<HashMap<u64, Pages>>,
}

impl PageSink for Recorder {
    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> bool {
        let mut p = self.pushed.lock().unwrap();
        p.entry(ino).or_default().push((offset, data.to_vec()));
        true
    }
}

#[test]
fn bad_hints_are_rejected_with_a_reason_counted_and_reads_stay_exact() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let many: Vec<String> = (0..=MAX_RANGES).map(|i| format!("[{i},1]")).collect();
    let cases: Vec<Case> = vec![
        (b"{not json".to_vec(), |e| {
            matches!(e, Rejected::Malformed(_))
        }),
        (b"[1, 2]".to_vec(), |e| matches!(e, Rejected::Malformed(_))),
        (br#"{"path": "big.bin", "ranges": [[0]]}"#.to_vec(), |e| {
            matches!(e, Rejected::Malformed(_))
        }),
        (
            br#"{"path": "big.bin", "ranges": [[-1, 5]]}"#.to_vec(),
            |e| matches!(e, Rejected::Malformed(_)),
        ),
        (
            br#"{"path": "nope.bin", "ranges": [[0, 1]]}"#.to_vec(),
            |e| matches!(e, Rejected::Unknown(_)),
        ),
        (
            br#"{"path": ".npy/t.csv/nope.npy", "ranges": [[0, 1]]}"#.to_vec(),
            |e| matches!(e, Rejected::Unknown(_)),
        ),
        (
            br#"{"path": ".stagefs/stats", "ranges": [[0, 1]]}"#.to_vec(),
            |e| matches!(e, Rejected::Unknown(_)),
        ),
        (
            br#"{"path": "../src/big.bin", "ranges": [[0, 1]]}"#.to_vec(),
            |e| matches!(e, Rejected::BadPath(_)),
        ),
        (
            br#"{"path": "/etc/passwd", "ranges": [[0, 1]]}"#.to_vec(),
            |e| matches!(e, Rejected::BadPath(_)),
        ),
        (
            format!(r#"{{"path": "big.bin", "ranges": [[{}, 2]]}}"#, BIG - 1).into_bytes(),
            |e| matches!(e, Rejected::OutOfRange { .. }),
        ),
        (
            format!(r#"{{"path": "big.bin", "ranges": [[{}, 2]]}}"#, u64::MAX).into_bytes(),
            |e| matches!(e, Rejected::OutOfRange { .. }),
        ),
        (
            format!(r#"{{"path": "big.bin", "ranges": [{}]}}"#, many.join(",")).into_bytes(),
            |e| matches!(e, Rejected::TooManyRanges(_)),
        ),
        (
            br#"{"path": "big.bin", "ranges": [[0, 200000000], [0, 200000000]]}"#.to_vec(),
            |e| matches!(e, Rejected::TooManyBytes(_)),
        ),
        (vec![b' '; MAX_LINE + 1], |e| matches!(e, Rejected::TooLong)),
    ];
    for (i, (line, want)) in cases.iter().enumerate() {
        let got = c.hint(line);
        let e = got.expect_err(&format!("case {i} must be rejected"));
        assert!(want(&e), "case {i}: wrong reason {e:?}");
        assert!(!e.to_string().is_empty());
    }
    let s = c.snapshot();
    assert_eq!(s.hints_rejected, cases.len() as u64);
    assert_eq!(s.hints_accepted, 0);
    assert_eq!(s.hint_bytes, 0);
    // The only fetch is of the table, to list its views (the `.npy/` case): no 1 MiB block
    // of big.bin.
    assert!(
        s.bytes_prefetched < BLOCK_SIZE,
        "a rejected hint fetches nothing: {}",
        s.bytes_prefetched
    );
    // Reads are unaffected, exact.
    let got = read(&c, &rel("big.bin"), 0, BIG as u64, 1 << 20).unwrap();
    assert!(got == pattern(7, BIG), "big.bin read back differs");
    c.shutdown();
}

#[test]
fn an_accepted_hint_fetches_its_source_blocks_and_pushes_them_once_cached() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let rec = Arc::new(Recorder::default());
    c.set_page_sink(Some(rec.clone()));
    let b = BLOCK_SIZE;
    // A row in block 5 and one spanning blocks 2–3, in that order.
    let line = format!(
        r#"{{"path": "big.bin", "ranges": [[{}, 1000], [{}, 100]]}}"#,
        5 * b + 7,
        3 * b - 50
    );
    assert_eq!(c.hint(line.as_bytes()), Ok(1100));
    let s = c.snapshot();
    assert_eq!(
        (s.hints_accepted, s.hint_bytes, s.hints_rejected),
        (1, 1100, 0)
    );
    until("the hinted blocks to be fetched", || {
        c.snapshot().bytes_prefetched >= 3 * b
    });
    // Only the hinted blocks: no reader read anything.
    assert_eq!(c.snapshot().bytes_prefetched, 3 * b);
    assert_eq!(c.snapshot().reads, 0);
    until("the hinted blocks to be pushed", || {
        c.push_hinted();
        rec.pushed
            .lock()
            .unwrap()
            .values()
            .map(Vec::len)
            .sum::<usize>()
            >= 3
    });
    let data = pattern(7, BIG);
    let pushed = rec.pushed.lock().unwrap();
    let pages: Vec<_> = pushed.values().flatten().collect();
    let mut offsets: Vec<u64> = pages.iter().map(|(o, _)| *o).collect();
    offsets.sort_unstable();
    assert_eq!(offsets, vec![2 * b, 3 * b, 5 * b]);
    for (o, bytes) in pages {
        let o = *o as usize;
        assert!(
            bytes[..] == data[o..o + bytes.len()],
            "pushed bytes at {o} differ"
        );
    }
    drop(pushed);
    let got = read(&c, &rel("big.bin"), 0, BIG as u64, 1 << 20).unwrap();
    assert!(got == data);
    c.shutdown();
}

#[test]
fn an_accepted_hint_for_a_view_renders_it_ahead_and_reads_match() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let view = ".npy/t.csv/value.npy";
    let len = lookup(&c, &rel(view)).unwrap().size;
    assert!(len > 8 * ROWS as u64);
    let before = c.snapshot().views_rendered;
    // The last rows, as a shuffled loader would ask for them first.
    let line = format!(r#"{{"path": "{view}", "ranges": [[{}, 80]]}}"#, len - 80);
    assert_eq!(c.hint(line.as_bytes()), Ok(80));
    let rendered = c.snapshot().views_rendered;
    assert!(rendered > before, "the hint rendered the view's last rows");
    let tail = read(&c, &rel(view), len - 80, 80, 1 << 20).unwrap();
    assert_eq!(
        c.snapshot().views_rendered,
        rendered,
        "reading the hinted rows renders nothing more"
    );
    // Byte-exact against an unhinted mount of its own cache.
    let (other, _) = mount(config(&src, &_t.path().join("cache2")));
    let want = read(&other, &rel(view), 0, len, 1 << 20).unwrap();
    assert_eq!(&tail[..], &want[want.len() - 80..]);
    assert_eq!(read(&c, &rel(view), 0, len, 1 << 20).unwrap(), want);
    other.shutdown();
    c.shutdown();
}

fn socket_of(c: &FsCore) -> std::path::PathBuf {
    let v: serde_json::Value = serde_json::from_str(&c.stats_json()).unwrap();
    v["hint_socket"]
        .as_str()
        .expect("hint_socket in the stats")
        .into()
}

#[test]
fn the_socket_takes_lines_rejects_bad_ones_and_goes_away_with_the_mount() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let v: serde_json::Value = serde_json::from_str(&c.stats_json()).unwrap();
    assert!(v["hint_socket"].is_null(), "no socket before it is started");
    let path = c.start_hints(None).unwrap();
    assert_eq!(socket_of(&c), path);
    assert_eq!(
        fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
    let good = format!(r#"{{"path": "big.bin", "ranges": [[{}, 10]]}}"#, BLOCK_SIZE);
    // A good line, garbage, an over-long line, a good line split across writes.
    s.write_all(format!("{good}\n{{garbage\n").as_bytes())
        .unwrap();
    s.write_all(&vec![b'x'; 3 * MAX_LINE]).unwrap();
    s.write_all(b"\n").unwrap();
    let (a, b) = good.split_at(10);
    s.write_all(a.as_bytes()).unwrap();
    s.flush().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    s.write_all(format!("{b}\n").as_bytes()).unwrap();
    until("the lines to be applied", || {
        let st = c.snapshot();
        st.hints_accepted == 2 && st.hints_rejected == 2
    });
    assert_eq!(c.snapshot().hint_bytes, 20);
    until("the hinted block to be fetched", || {
        c.stats().bytes_prefetched.load(Relaxed) >= BLOCK_SIZE
    });
    c.shutdown();
    assert!(!path.exists(), "the socket is removed with the mount");
    assert!(std::os::unix::net::UnixStream::connect(&path).is_err());
}

/// Regression: unmounting woke the hint listener by connecting to its socket; when the socket's
/// path was gone (a test's temporary directory removed, a cache directory cleaned), the connect
/// failed, the listener stayed in accept() and the daemon never exited after the unmount.
#[test]
fn shutdown_ends_the_hint_server_even_when_its_socket_path_is_gone() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let path = c.start_hints(None).unwrap();
    std::fs::remove_file(&path).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        c.shutdown();
        let _ = tx.send(());
    });
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .expect("shutdown hung on the hint listener");
}

/// Settles background fetches, then the bytes read from the source so far.
fn source_read(c: &FsCore) -> u64 {
    let mut last = u64::MAX;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = c.stats().source_bytes_read.load(Relaxed);
        if now == last && c.stats().fetches_in_flight.load(Relaxed) == 0 {
            return now;
        }
        last = now;
    }
}

#[test]
fn a_declared_part_bounds_read_ahead_and_is_all_that_hinted_staging_stages() {
    let b = BLOCK_SIZE;
    let (_t, src, cache) = setup();
    fs::write(src.join("other.bin"), pattern(9, BIG)).unwrap();
    let mut cfg = config(&src, &cache);
    cfg.stage = true;
    cfg.stage_hinted = true;
    let (c, _) = mount(cfg);
    // Nothing is staged before a loader declares its part.
    assert_eq!(source_read(&c), 0);
    let line = format!(
        r#"{{"path": "big.bin", "scope": 1, "ranges": [[{}, {}]]}}"#,
        4 * b,
        2 * b
    );
    assert_eq!(c.hint(line.as_bytes()), Ok(2 * b));
    until("the part staged", || {
        c.stats().source_bytes_read.load(Relaxed) >= 2 * b
    });
    assert_eq!(source_read(&c), 2 * b, "staging stayed inside the part");
    // A header read at offset 0 reads its block and speculates nothing (first read of a
    // handle); a sequential reader of the part reads ahead only inside it.
    let got = read(&c, &rel("big.bin"), 0, 4096, 4096).unwrap();
    assert_eq!(got, pattern(7, BIG)[..4096]);
    assert_eq!(source_read(&c), 3 * b);
    let got = read(&c, &rel("big.bin"), 4 * b, 2 * b, 128 << 10).unwrap();
    assert_eq!(got, pattern(7, BIG)[(4 * b) as usize..(6 * b) as usize]);
    assert_eq!(source_read(&c), 3 * b, "read-ahead went past the part");
    // A file without a declared part: sequential reads speculate, but only as a reader's
    // read-ahead (cross-file speculation and staging skip it).
    let before = source_read(&c);
    read(&c, &rel("other.bin"), 0, 2 * b, 128 << 10).unwrap();
    assert!(
        source_read(&c) > before + 2 * b,
        "read-ahead of an undeclared file is unchanged"
    );
    assert_eq!(c.stats().hints_rejected.load(Relaxed), 0);
}

/// An image view's declared part is staged from the source: the rows a node's loaders will
/// read name JPEGs, and those files (whole), not the other class's, are what a hinted mount
/// stages (before, a view's scope line was accepted and staged nothing: the node's first
/// epoch read every image from the source on demand).
#[test]
fn a_declared_part_of_an_image_view_stages_its_source_images() {
    let (_t, src, cache) = setup();
    let mut sizes = Vec::new();
    for class in ["c0", "c1"] {
        fs::create_dir_all(src.join("imgs").join(class)).unwrap();
        for i in 0..10 {
            // Staging reads bytes; they need not decode.
            let bytes = pattern(i, 20_000 + 1000 * i as usize);
            sizes.push(bytes.len() as u64);
            fs::write(src.join(format!("imgs/{class}/{i}.jpg")), bytes).unwrap();
        }
    }
    let mut cfg = config(&src, &cache);
    cfg.stage = true;
    cfg.stage_hinted = true;
    let slot = u64::from(cfg.image_size).pow(2) * 3;
    let header = stagefs_views::image::images_len(20, cfg.image_size) - 20 * slot;
    let (c, _) = mount(cfg);
    assert_eq!(source_read(&c), 0);
    // Rows 0..10 are class c0's images (ImageFolder order).
    let line = format!(
        r#"{{"path": ".npy/imgs/images.npy", "scope": 1, "ranges": [[{header}, {}]]}}"#,
        10 * slot
    );
    assert_eq!(c.hint(line.as_bytes()), Ok(10 * slot));
    let part: u64 = sizes[..10].iter().sum();
    until("the part's images staged", || {
        c.stats().source_bytes_read.load(Relaxed) >= part
    });
    assert_eq!(source_read(&c), part, "staged exactly class c0's files");
    assert_eq!(c.stats().hints_rejected.load(Relaxed), 0);
}
