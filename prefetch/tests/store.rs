//! The cache store without FUSE: blocks round-trip through segments and own files, checksums
//! catch corruption, the index survives remounts and kills, capacity and pins hold.
#![allow(missing_docs, clippy::unwrap_used)]

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use stagefs_prefetch::fds::DATA_FILES as OPEN_DATA_FILES;
use stagefs_prefetch::{
    block_count, block_len, CacheError, CacheStore, KeyKind, Loaded, Stats, StoreConfig, Version,
    BLOCK_SIZE,
};
use stagefs_test_support::{files_under, pattern};

const MB: u64 = BLOCK_SIZE;

fn open(dir: &Path, capacity: u64) -> (Arc<CacheStore>, Loaded, Arc<Stats>) {
    let stats = Arc::new(Stats::default());
    let (s, loaded) = CacheStore::open(
        &StoreConfig {
            dir: dir.to_path_buf(),
            capacity,
            direct_reads: true,
        },
        stats.clone(),
    )
    .unwrap();
    (Arc::new(s), loaded, stats)
}

fn v(size: u64, mtime_ns: i64) -> Version {
    Version {
        size,
        mtime_ns,
        ctime_ns: 3,
        ino: 7,
    }
}

/// Creates a raw entry for a file of `data` and stores all of its blocks.
fn put(s: &CacheStore, key: &str, data: &[u8], own: bool, owner: u32) -> u32 {
    let size = data.len() as u64;
    let id = s.create(
        KeyKind::Raw,
        key.as_bytes(),
        v(size, 1),
        block_count(size) as u32,
        own,
        owner,
    );
    for b in 0..block_count(size) {
        let lo = (b * MB) as usize;
        let hi = lo + block_len(size, b) as usize;
        assert!(s.insert(id, b as u32, &data[lo..hi]));
    }
    id
}

#[test]
fn blocks_round_trip_packed_and_in_own_files_across_a_remount() {
    let tmp = tempfile::tempdir().unwrap();
    let small = pattern(1, 100_000);
    let large = pattern(2, (5 * MB + 1234) as usize);
    {
        let (s, loaded, _) = open(tmp.path(), 1 << 30);
        assert!(loaded.entries.is_empty());
        let a = put(&s, "d/small.jpg", &small, false, 11);
        let b = put(&s, "d/large.bin", &large, true, 12);
        assert_eq!(&s.read(a, 0).unwrap()[..], &small[..]);
        assert_eq!(&s.read(b, 5).unwrap()[..], &large[5 * MB as usize..]);
        assert!(s.is_complete(a) && s.is_complete(b));
        s.set_snapshot(42).unwrap();
        s.close().unwrap();
    }
    let (s, loaded, stats) = open(tmp.path(), 1 << 30);
    assert_eq!(loaded.snapshot, 42);
    assert_eq!(loaded.entries.len(), 2);
    let by_key = |k: &str| {
        loaded
            .entries
            .iter()
            .find(|e| loaded.key(e) == k.as_bytes())
            .unwrap()
    };
    let a = by_key("d/small.jpg");
    assert_eq!((a.owner, a.version, a.slots), (11, v(100_000, 1), 1));
    let b = by_key("d/large.bin");
    assert_eq!(&s.read(a.id, 0).unwrap()[..], &small[..]);
    for blk in 0..6u32 {
        let lo = blk as usize * MB as usize;
        let hi = (lo + MB as usize).min(large.len());
        assert_eq!(&s.read(b.id, blk).unwrap()[..], &large[lo..hi]);
    }
    assert_eq!(
        stats
            .files_staged
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    // The large file is an exact copy, usable by passthrough once verified in this mount.
    assert!(s.pin_passthrough(b.id).is_none(), "not verified yet");
    assert!(s.verify(b.id));
    let f = s.pin_passthrough(b.id).unwrap();
    assert_eq!(f.metadata().unwrap().len(), large.len() as u64);
    let mut copy = Vec::new();
    std::io::Read::read_to_end(&mut &f, &mut copy).unwrap();
    assert!(copy == large);
    s.unpin(b.id);
}

#[test]
fn small_files_are_packed_one_scratch_file_per_hundreds() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _, _) = open(tmp.path(), 1 << 30);
    let before = files_under(tmp.path());
    for i in 0..2000u32 {
        put(
            &s,
            &format!("c{}/img{i}.jpg", i % 10),
            &pattern(u64::from(i), 3000),
            false,
            i,
        );
    }
    s.flush().unwrap();
    let after = files_under(tmp.path());
    assert!(
        after - before <= 2000 / 100,
        "{} scratch files for 2000 small files",
        after - before
    );
}

#[test]
fn corrupted_block_is_a_miss_never_wrong_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _, stats) = open(tmp.path(), 1 << 30);
    let data = pattern(3, 50_000);
    let id = put(&s, "x", &data, false, 0);
    s.flush().unwrap();
    // Flip a byte in the (only) segment file.
    let seg = fs::read_dir(tmp.path().join("v2/segments"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = fs::read(&seg).unwrap();
    bytes[100] ^= 0xff;
    fs::write(&seg, &bytes).unwrap();
    assert!(s.read(id, 0).is_none());
    assert_eq!(
        stats
            .corrupt_blocks
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert!(!s.contains(id, 0), "the bad block is dropped");
    assert!(s.insert(id, 0, &data), "and can be fetched again");
    assert_eq!(&s.read(id, 0).unwrap()[..], &data[..]);
}

/// Pages of `path` in the page cache (`mincore` over a mapping that touches none).
fn resident_pages(path: &Path) -> usize {
    let f = fs::File::open(path).unwrap();
    // SAFETY: a read-only mapping of a file this test owns; only its residency is queried,
    // its bytes are never read.
    let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
    let pages = map.len().div_ceil(4096);
    let mut vec = vec![0u8; pages];
    // SAFETY: `vec` has one byte per page of the mapping, which stays alive for the call.
    let rc = unsafe { libc::mincore(map.as_ptr() as *mut _, map.len(), vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    vec.iter().filter(|b| *b & 1 == 1).count()
}

/// Large files' blocks are read back with O_DIRECT: exact (the short last block too), a
/// corrupt one is a miss, and reading leaves none of the file in scratch's page cache (the
/// mount's page cache holds the only copy in memory).
#[test]
fn own_file_blocks_read_directly_are_exact_verified_and_not_cached_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _, stats) = open(tmp.path(), 1 << 30);
    // Over 4 MiB: a large copy (small ones are read through the page cache, as readers do).
    let data = pattern(9, (5 * MB + 12_345) as usize);
    let id = put(&s, "big", &data, true, 0);
    s.flush().unwrap();
    let own = fs::read_dir(tmp.path().join("v2/files"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    // Written back and dropped from the page cache, as after a remount or memory pressure.
    let f = fs::File::open(&own).unwrap();
    f.sync_all().unwrap();
    // SAFETY: advice on a descriptor we own; it touches no memory.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0);
    let droppable = resident_pages(&own) == 0;
    for b in 0..6u64 {
        let got = s.read(id, b as u32).unwrap();
        let lo = (b * MB) as usize;
        assert!(got[..] == data[lo..lo + block_len(data.len() as u64, b) as usize]);
    }
    if droppable {
        assert_eq!(
            resident_pages(&own),
            0,
            "a direct read went through the page cache"
        );
    } else {
        eprintln!("skipped: the page-cache check needs a TMPDIR on a disk (this one keeps pages)");
    }
    // One flipped byte in block 2: never served, dropped, fetched again.
    let w = fs::OpenOptions::new().write(true).open(&own).unwrap();
    w.write_all_at(&[data[2 * MB as usize + 7] ^ 0x5a], 2 * MB + 7)
        .unwrap();
    assert!(s.read(id, 2).is_none());
    assert_eq!(
        stats
            .corrupt_blocks
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert!(!s.contains(id, 2));
    assert!(s.read(id, 1).is_some(), "its neighbours are intact");
}

#[test]
fn blocks_cached_after_the_last_flush_are_forgotten_not_corrupt() {
    let tmp = tempfile::tempdir().unwrap();
    let data = pattern(4, 3 * MB as usize);
    {
        let (s, _, _) = open(tmp.path(), 1 << 30);
        let id = s.create(KeyKind::Raw, b"f", v(3 * MB, 1), 3, true, 0);
        assert!(s.insert(id, 0, &data[..MB as usize]));
        s.flush().unwrap();
        assert!(s.insert(id, 1, &data[MB as usize..2 * MB as usize]));
        // Killed here: block 1 is on scratch but not in the index (and the kernel drops the
        // dead process's lock).
        s.abandon();
        std::mem::forget(s);
    }
    let (s, loaded, stats) = open(tmp.path(), 1 << 30);
    let e = &loaded.entries[0];
    assert_eq!(e.present, 1);
    assert_eq!(&s.read(e.id, 0).unwrap()[..], &data[..MB as usize]);
    assert!(s.read(e.id, 1).is_none());
    assert_eq!(
        stats
            .corrupt_blocks
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[test]
fn torn_index_tail_keeps_every_record_before_it() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let (s, _, _) = open(tmp.path(), 1 << 30);
        for i in 0..10u32 {
            put(&s, &format!("f{i}"), &pattern(u64::from(i), 1000), false, i);
        }
        s.close().unwrap();
    }
    let log = tmp.path().join("v2/cache.log");
    let len = fs::metadata(&log).unwrap().len();
    let f = fs::OpenOptions::new().write(true).open(&log).unwrap();
    f.set_len(len - 5).unwrap(); // tear the last record
    drop(f);
    let (s, loaded, _) = open(tmp.path(), 1 << 30);
    // The last block record is gone; everything before it is served.
    let present: u32 = loaded.entries.iter().map(|e| e.present).sum();
    assert_eq!(present, 9);
    for e in &loaded.entries {
        let i: u64 = std::str::from_utf8(loaded.key(e)).unwrap()[1..]
            .parse()
            .unwrap();
        if let Some(b) = s.read(e.id, 0) {
            assert_eq!(&b[..], &pattern(i, 1000)[..]);
        }
    }
}

#[test]
fn index_larger_than_the_replay_window_loads_every_record() {
    // The log is replayed through a 4 MiB window; records of up to 4 KiB keys must be read
    // whole wherever the window's edges fall, and a torn tail still ends the replay cleanly.
    let tmp = tempfile::tempdir().unwrap();
    let n = 6000u32;
    let key = |i: u32| format!("{i:05}/{}", "k".repeat(100 + (i as usize * 37) % 3900));
    {
        let (s, _, _) = open(tmp.path(), 1 << 30);
        for i in 0..n {
            put(&s, &key(i), &pattern(u64::from(i), 10), false, i);
        }
        s.close().unwrap();
    }
    let log = tmp.path().join("v2/cache.log");
    let len = fs::metadata(&log).unwrap().len();
    assert!(
        len > 3 * (4 << 20),
        "log of {len} bytes spans several windows"
    );
    let check = |tear: bool| {
        let (s, loaded, _) = open(tmp.path(), 1 << 30);
        let expect = if tear { n - 1 } else { n };
        let present: u32 = loaded.entries.iter().map(|e| e.present).sum();
        assert_eq!(present, expect, "blocks after replay (torn tail: {tear})");
        for e in &loaded.entries {
            let k = std::str::from_utf8(loaded.key(e)).unwrap();
            let i: u32 = k[..5].parse().unwrap();
            assert_eq!(k, key(i));
            if let Some(b) = s.read(e.id, 0) {
                assert_eq!(&b[..], &pattern(u64::from(i), 10)[..]);
            }
        }
    };
    check(false);
    let f = fs::OpenOptions::new().write(true).open(&log).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 5).unwrap(); // tear the last record
    drop(f);
    check(true);
}

#[test]
fn capacity_holds_with_lru_eviction_and_empty_segments_are_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _, stats) = open(tmp.path(), 4 * MB);
    let mut ids = Vec::new();
    for i in 0..40u32 {
        ids.push(put(
            &s,
            &format!("f{i}"),
            &pattern(u64::from(i), 400_000),
            false,
            i,
        ));
        assert!(s.used() <= 4 * MB);
    }
    // The most recent files are there, the oldest evicted.
    assert!(s.contains(ids[39], 0));
    assert!(!s.contains(ids[0], 0));
    assert!(
        stats
            .blocks_evicted
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    // Touching an old-but-present file keeps it over newer ones.
    let keep = ids.iter().position(|id| s.contains(*id, 0)).unwrap();
    assert!(s.read(ids[keep], 0).is_some());
    for i in 40..45u32 {
        put(
            &s,
            &format!("f{i}"),
            &pattern(u64::from(i), 400_000),
            false,
            i,
        );
    }
    assert!(s.contains(ids[keep], 0));
}

#[test]
fn lower_capacity_at_remount_evicts_down_to_it() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let (s, _, _) = open(tmp.path(), 100 * MB);
        for i in 0..20u32 {
            put(
                &s,
                &format!("f{i}"),
                &pattern(u64::from(i), MB as usize),
                false,
                i,
            );
        }
        s.close().unwrap();
    }
    let (s, loaded, _) = open(tmp.path(), 5 * MB);
    assert!(s.used() <= 5 * MB);
    let present: u32 = loaded.entries.iter().map(|e| e.present).sum();
    assert!(present <= 5 && present > 0);
}

#[test]
fn pinned_entry_survives_eviction_pressure() {
    let tmp = tempfile::tempdir().unwrap();
    let (s, _, _) = open(tmp.path(), 12 * MB);
    let big = pattern(9, 6 * MB as usize);
    let id = put(&s, "big", &big, true, 0);
    assert!(s.verify(id));
    let _f = s.pin_passthrough(id).unwrap();
    for i in 0..20u32 {
        put(
            &s,
            &format!("f{i}"),
            &pattern(u64::from(i), MB as usize),
            false,
            i,
        );
    }
    assert!(
        s.is_complete(id),
        "a passthrough file lost blocks to eviction"
    );
    s.unpin(id);
    for i in 20..40u32 {
        put(
            &s,
            &format!("f{i}"),
            &pattern(u64::from(i), MB as usize),
            false,
            i,
        );
    }
    assert!(!s.is_complete(id), "unpinned, it is evictable again");
}

#[test]
fn forgotten_entry_is_gone_after_remount() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let (s, _, _) = open(tmp.path(), 1 << 30);
        let a = put(&s, "a", &pattern(1, 5000), false, 0);
        put(&s, "b", &pattern(2, 5000), false, 1);
        s.forget(a);
        assert!(s.read(a, 0).is_none());
        s.close().unwrap();
    }
    let (_, loaded, _) = open(tmp.path(), 1 << 30);
    let keys: Vec<_> = loaded
        .entries
        .iter()
        .map(|e| loaded.key(e).to_vec())
        .collect();
    assert_eq!(keys, vec![b"b".to_vec()]);
}

#[test]
fn index_of_another_format_is_discarded() {
    let tmp = tempfile::tempdir().unwrap();
    fs::create_dir_all(tmp.path().join("v2")).unwrap();
    fs::write(
        tmp.path().join("v2/cache.log"),
        b"{\"format\": 1}\n garbage",
    )
    .unwrap();
    let (s, loaded, _) = open(tmp.path(), 1 << 30);
    assert!(loaded.entries.is_empty());
    let id = put(&s, "a", &pattern(1, 10), false, 0);
    assert!(s.read(id, 0).is_some());
}

#[test]
fn an_older_cache_format_is_removed() {
    let tmp = tempfile::tempdir().unwrap();
    fs::create_dir_all(tmp.path().join("v1/ab")).unwrap();
    fs::write(tmp.path().join("v1/ab/0000.data"), b"x").unwrap();
    let _ = open(tmp.path(), 1 << 30);
    assert!(!tmp.path().join("v1").exists());
}

#[test]
fn regression_many_small_files_do_not_exhaust_descriptors() {
    // The v1 cache kept one descriptor per cached file (EMFILE after ~1000 files).
    let fds = || fs::read_dir("/proc/self/fd").unwrap().count();
    let tmp = tempfile::tempdir().unwrap();
    let (s, _, _) = open(tmp.path(), 1 << 30);
    let before = fds();
    for i in 0..3 * OPEN_DATA_FILES as u32 {
        let id = put(&s, &format!("c/{i}"), &[i as u8; 100], false, i);
        assert!(s.read(id, 0).is_some());
    }
    assert!(
        fds() <= before + 8,
        "descriptors grew from {before} to {}",
        fds()
    );
}

#[test]
fn two_mounts_on_one_cache_the_second_is_refused() {
    // Regression: two mounts sharing a cache directory overwrote each other's blocks.
    let tmp = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        dir: tmp.path().to_path_buf(),
        capacity: 1 << 30,
        direct_reads: true,
    };
    let (first, _, _) = open(tmp.path(), 1 << 30);
    let err = CacheStore::open(&cfg, Arc::new(Stats::default()))
        .err()
        .expect("a second open of a cache in use was accepted");
    let me = std::process::id();
    assert!(
        matches!(err, CacheError::InUse { pid: Some(p), .. } if p == me),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("in use by another mount") && msg.contains(&format!("pid {me}")),
        "{msg}"
    );
    // Released at close, and by a holder that stops without closing (as a killed one would).
    first.close().unwrap();
    let (second, _, _) = open(tmp.path(), 1 << 30);
    second.abandon();
    let _third = open(tmp.path(), 1 << 30);
}

#[test]
fn large_image_size_slot_survives_a_remount() {
    // Regression: with --image-size >= ~4730 a rendered slot is over 64 MiB, which the
    // log replay rejected (damaged=true) although insert had stored it.
    let tmp = tempfile::tempdir().unwrap();
    let slot = pattern(5, 4800 * 4800 * 3);
    assert!(slot.len() as u64 > 64 * MB);
    let size = 2 * slot.len() as u64;
    {
        let (s, _, _) = open(tmp.path(), 1 << 30);
        let id = s.create(
            KeyKind::View,
            b".npy/imgs/images.npy",
            v(size, 9),
            2,
            false,
            3,
        );
        assert!(s.insert(id, 1, &slot));
        s.close().unwrap();
    }
    let (s, loaded, _) = open(tmp.path(), 1 << 30);
    assert_eq!(loaded.entries.len(), 1, "the entry was lost at replay");
    let e = &loaded.entries[0];
    assert_eq!(
        (e.present, loaded.key(e)),
        (1, &b".npy/imgs/images.npy"[..])
    );
    assert!(s.read(e.id, 1).is_some_and(|b| b[..] == slot[..]));
}

#[test]
fn close_compacts_a_log_larger_than_the_read_window_keeping_every_live_key() {
    // close() streams the log through the replay window (it used to read it whole): keys of
    // live entries spread over more than one window must all survive the rewrite. Short keys:
    // the log's garbage estimate counts a dropped entry's record without its key.
    let tmp = tempfile::tempdir().unwrap();
    let key = |i: u32| format!("{i:08}");
    let n = 50_000u32; // ~4.7 MB of entry and block records: more than the 4 MiB window
    {
        let (s, _, _) = open(tmp.path(), 1 << 30);
        for i in 0..n {
            put(&s, &key(i), &[i as u8; 10], false, i);
        }
        s.flush().unwrap();
        for id in 0..n {
            if id % 3 != 0 {
                s.forget(id);
            }
        }
        let log = tmp.path().join("v2/cache.log");
        let before = fs::metadata(&log).unwrap().len();
        assert!(before > 4 << 20);
        s.close().unwrap();
        assert!(
            fs::metadata(&log).unwrap().len() < before / 2,
            "close did not compact the log"
        );
    }
    let (s, loaded, _) = open(tmp.path(), 1 << 30);
    let mut keys: Vec<Vec<u8>> = loaded
        .entries
        .iter()
        .map(|e| {
            assert!(s.read(e.id, 0).is_some());
            loaded.key(e).to_vec()
        })
        .collect();
    keys.sort();
    let want: Vec<Vec<u8>> = (0..n)
        .filter(|i| i % 3 == 0)
        .map(|i| key(i).into_bytes())
        .collect();
    assert!(
        keys == want,
        "{} of {} live entries kept",
        keys.len(),
        want.len()
    );
}

/// Bytes of disk allocated to `path`.
fn allocated(path: &Path) -> u64 {
    std::os::unix::fs::MetadataExt::blocks(&fs::metadata(path).unwrap()) * 512
}

#[test]
fn own_copy_is_allocated_whole_at_its_first_block_when_the_cache_has_room() {
    for (capacity, whole) in [(256 * MB, true), (6 * MB, false)] {
        let dir = tempfile::tempdir().unwrap();
        let (s, _, _) = open(dir.path(), capacity);
        let size = 8 * MB + 1234;
        let data = pattern(5, size as usize);
        let id = s.create(KeyKind::Raw, b"big", v(size, 1), 9, true, 1);
        // One block in the middle, as a random reader's first read would store.
        assert!(s.insert(id, 3, &data[(3 * MB) as usize..(4 * MB) as usize]));
        let files = dir.path().join("v2/files");
        let copy = fs::read_dir(&files)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        assert_eq!(
            fs::metadata(&copy).unwrap().len(),
            4 * MB,
            "size grows with the blocks"
        );
        if whole {
            assert!(allocated(&copy) >= 9 * MB, "{}", allocated(&copy));
        } else {
            assert!(allocated(&copy) < 2 * MB, "no room: {}", allocated(&copy));
        }
    }
}

/// A copy written whole in this mount is trusted at once (its bytes are the ones checksummed as
/// they were written); one completed in a later mount holds blocks that mount never wrote, so
/// it is read back, and a block corrupted on scratch in between is caught, never trusted.
#[test]
fn a_copy_resumed_from_an_earlier_mount_is_read_back_before_it_is_trusted() {
    let tmp = tempfile::tempdir().unwrap();
    let data = pattern(9, (3 * MB + 777) as usize);
    let whole = pattern(10, 200_000);
    let key = "d/resumed.bin";
    {
        let (s, _, stats) = open(tmp.path(), 1 << 30);
        let w = put(&s, "d/whole.bin", &whole, true, 1);
        assert!(s.verify(w), "written whole here: trusted");
        assert_eq!(stats.copies_verified.load(Relaxed), 1);
        let id = s.create(
            KeyKind::Raw,
            key.as_bytes(),
            v(data.len() as u64, 1),
            4,
            true,
            2,
        );
        for b in 0..2u32 {
            let lo = b as usize * MB as usize;
            assert!(s.insert(id, b, &data[lo..lo + MB as usize]));
        }
        assert!(!s.verify(id), "not complete");
        s.set_snapshot(1).unwrap();
        s.close().unwrap();
    }
    // Corrupt block 0 of the resumed copy, written by the first mount.
    let copies: Vec<_> = fs::read_dir(tmp.path().join("v2/files"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| fs::metadata(p).unwrap().len() >= 2 * MB)
        .collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    let f = fs::OpenOptions::new().write(true).open(&copies[0]).unwrap();
    f.write_all_at(b"CORRUPT", 5).unwrap();
    drop(f);
    let (s, loaded, stats) = open(tmp.path(), 1 << 30);
    let e = loaded
        .entries
        .iter()
        .find(|e| loaded.key(e) == key.as_bytes())
        .unwrap();
    for b in 2..4u32 {
        let lo = b as usize * MB as usize;
        let hi = (lo + MB as usize).min(data.len());
        assert!(s.insert(e.id, b, &data[lo..hi]));
    }
    assert!(
        s.is_complete(e.id),
        "every block stored, the bad one not read yet"
    );
    assert!(
        !s.verify(e.id),
        "a corrupt block written by an earlier mount was trusted"
    );
    assert_eq!(stats.corrupt_blocks.load(Relaxed), 1);
    assert!(
        !s.contains(e.id, 0),
        "the bad block is dropped, to be fetched again"
    );
    // Fetched again (a copy evicted whole loses every block with the bad one).
    for b in 0..4u32 {
        let lo = b as usize * MB as usize;
        let hi = (lo + MB as usize).min(data.len());
        if !s.contains(e.id, b) {
            assert!(s.insert(e.id, b, &data[lo..hi]));
        }
    }
    assert!(s.verify(e.id));
    for b in 0..4u32 {
        let lo = b as usize * MB as usize;
        let hi = (lo + MB as usize).min(data.len());
        assert!(s.read(e.id, b).unwrap()[..] == data[lo..hi]);
    }
}
