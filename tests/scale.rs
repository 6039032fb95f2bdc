//! A many-small-file dataset through a real mount: 200,000 files read byte-exact, a remount
//! that lists nothing and re-reads nothing from the source, and a cache whose file count grows
//! with bytes, not files. And the daemon's memory bound over 10,000 files of 4 MiB.
#![allow(missing_docs, clippy::unwrap_used)]

mod common;

use stagefs_test_support::{files_under, test, Need};

use std::fs;
use std::os::unix::fs::FileExt;
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
    // A copy of its own per file (what a direct reader is handed), and a handful of others.
    let cached = files_under(&m.cache);
    assert!(
        (DIRS * PER_DIR..DIRS * PER_DIR + 16).contains(&cached),
        "{cached} files on scratch for {} cached",
        DIRS * PER_DIR
    );
    m.mount();
    assert_eq!(read_all(&m.mnt), DIRS * PER_DIR);
    let s = m.stats();
    assert_eq!(s["snapshot"], "cache", "{s}");
    // Every copy trusted by its record (one fstatat each, in the background), none read again.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let mut t = s.clone();
    while t["copies_trusted"].as_u64() != Some((DIRS * PER_DIR) as u64) {
        assert!(std::time::Instant::now() < deadline, "{t}");
        std::thread::sleep(std::time::Duration::from_millis(200));
        t = m.stats();
    }
    assert_eq!(t["copies_verified"], 0, "{t}");
    // One stat, of the source root (is it still the tree the kept snapshot is of?).
    assert_eq!(
        s["metadata_requests"], 1,
        "the remount listed the source: {s}"
    );
    assert_eq!(s["bytes_from_source"], 0, "the remount re-read data: {s}");
    m.umount();
}

/// The daemon's documented memory bound (docs/architecture.md#memory-is-bounded): the remembered blocks'
/// budget (`fs::files::MEMO_BUDGET`, 64 MiB), the push queue (64 blocks of 1 MiB: the rest of
/// each block a random reader touched), blocks in flight (32 fetch threads and 2 pushers,
/// 1 MiB each, counted twice: a block and the reply being written), and a fixed base (the
/// binary, the snapshot, allocator slack) of 128 MiB.
const RSS_BOUND: u64 = (64 + 64 + 2 * 34 + 128) << 20;

/// The daemon's resident memory stays within [`RSS_BOUND`] whatever the number and
/// size of the files read: 10,000 files of 4 MiB (sparse: the source costs no disk), 8
/// readers, each read landing in another 1 MiB block of its file. Every file's last block
/// remembered (what the daemon did before the budget) would be 10 GB.
fn daemon_rss_stays_bounded_reading_ten_thousand_files_of_4_mib() {
    const N: u64 = 10_000;
    const SIZE: u64 = 4 << 20;
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let path = |i: u64| format!("d{:03}/f{i:05}", i / 100);
    for i in 0..N {
        if i % 100 == 0 {
            fs::create_dir_all(src.join(format!("d{:03}", i / 100))).unwrap();
        }
        let f = fs::File::create(src.join(path(i))).unwrap();
        f.set_len(SIZE).unwrap();
        f.write_all_at(&i.to_le_bytes(), (i % 4) << 20).unwrap();
    }
    let m = Mount::new(tmp.path(), &src, &["--cache-size", "256M"]);
    let pid = m.stats()["pid"].as_u64().unwrap();
    std::thread::scope(|sc| {
        for t in 0..8 {
            let (m, path) = (&m, &path);
            sc.spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                for i in (t..N).step_by(8) {
                    let f = fs::File::open(m.mnt.join(path(i))).unwrap();
                    f.read_exact_at(&mut buf, (i % 4) << 20).unwrap();
                    assert_eq!(buf[..8], i.to_le_bytes(), "file {i}");
                    assert!(buf[8..].iter().all(|b| *b == 0), "file {i}");
                }
            });
        }
    });
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib = |key: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(key)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let (hwm, rss) = (kib("VmHWM:") << 10, kib("VmRSS:") << 10);
    eprintln!(
        "daemon RSS: peak {} MiB, now {} MiB (bound {} MiB)",
        hwm >> 20,
        rss >> 20,
        RSS_BOUND >> 20
    );
    assert!(hwm <= RSS_BOUND, "peak RSS {hwm} B over the bound");
    assert_eq!(m.stats()["error_count"], 0);
}

fn main() -> std::process::ExitCode {
    stagefs_test_support::run(vec![
        test!(
            two_hundred_thousand_small_files_read_exact_and_remount_lists_nothing,
            Need::Fuse
        ),
        test!(
            daemon_rss_stays_bounded_reading_ten_thousand_files_of_4_mib,
            Need::Fuse
        ),
    ])
}
