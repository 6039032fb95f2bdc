//! Direct descriptors ([`stagefs_fs::direct`]) over the control socket, without FUSE: byte-exact
//! reads of verified copies, a reason for everything else, pins released on close and when the
//! connection ends (a killed client included), bounded, and never evicted while held.
#![allow(missing_docs, clippy::unwrap_used)]

mod support;

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stagefs_fs::FsCore;
use stagefs_prefetch::BLOCK_SIZE;
use stagefs_protocol::table::{Listing, SharedCounters, TableReader, FLAG_COMPLETE};
use stagefs_protocol::{ClientError, DirectClient, Granted, Refusal, MAX_PINS_PER_CONNECTION};
use support::*;

const BIG: usize = 8 * BLOCK_SIZE as usize + 12345;

fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir_all(src.join("d")).unwrap();
    fs::write(src.join("big.bin"), pattern(7, BIG)).unwrap();
    fs::write(src.join("d/big2.bin"), pattern(8, BIG)).unwrap();
    fs::write(src.join("small.bin"), pattern(9, 1000)).unwrap();
    std::os::unix::fs::symlink("big.bin", src.join("link.bin")).unwrap();
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

/// Reads `rel` whole through the core (caching it).
fn stage(c: &FsCore, rel: &str) {
    let got = read(c, Path::new(rel), 0, BIG as u64, 128 << 10).unwrap();
    assert_eq!(got.len(), BIG);
}

/// Opens `rel` directly, waiting out the verification of a freshly staged copy.
fn open_verified(client: &mut DirectClient, rel: &str) -> (OwnedFd, Granted) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match client.open(rel) {
            Ok(x) => return x,
            Err(ClientError::Refused(Refusal::Verifying)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("direct open of {rel}: {e}"),
        }
    }
}

fn refusal(client: &mut DirectClient, rel: &str) -> Refusal {
    match client.open(rel) {
        Err(ClientError::Refused(r)) => r,
        other => panic!("{rel}: expected a refusal, got {other:?}"),
    }
}

fn read_all(fd: OwnedFd) -> Vec<u8> {
    let mut v = Vec::new();
    fs::File::from(fd).read_to_end(&mut v).unwrap();
    v
}

fn started(c: &Arc<FsCore>) -> PathBuf {
    c.start_hints(None).unwrap()
}

#[test]
fn direct_descriptor_reads_the_staged_copy_byte_exactly_read_only_and_is_counted() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    stage(&c, "big.bin");
    let mut client = DirectClient::connect(&sock).unwrap();
    let (fd, g) = open_verified(&mut client, "big.bin");
    assert_eq!(g.size, BIG as u64);
    let meta = fs::metadata(src.join("big.bin")).unwrap();
    assert_eq!(
        g.mtime_ns,
        std::os::unix::fs::MetadataExt::mtime(&meta) * 1_000_000_000
            + std::os::unix::fs::MetadataExt::mtime_nsec(&meta)
    );
    // SAFETY: fcntl on a descriptor we own.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    assert_eq!(flags & libc::O_ACCMODE, libc::O_RDONLY);
    assert_eq!(
        flags & libc::O_NONBLOCK,
        0,
        "the daemon's O_NONBLOCK is not handed on"
    );
    let mut f = fs::File::from(fd);
    // The copy shows the source's mtime to a reader's fstat.
    assert_eq!(
        f.metadata().unwrap().modified().unwrap(),
        meta.modified().unwrap()
    );
    assert!(f.write_all(b"x").is_err(), "the descriptor must not write");
    let mut got = Vec::new();
    f.read_to_end(&mut got).unwrap();
    assert!(
        got == pattern(7, BIG),
        "bytes through the descriptor differ"
    );
    let s = c.snapshot();
    assert_eq!(s.direct_opens, 1);
    assert_eq!(s.bytes_direct, BIG as u64);
    let json: serde_json::Value = serde_json::from_str(&c.stats_json()).unwrap();
    assert_eq!(json["direct_opens"], 1);
    assert_eq!(c.direct_pins(), 1);
    client.close(g.pin).unwrap();
    until("the pin released", || c.direct_pins() == 0);
    c.shutdown();
}

#[test]
fn partial_view_small_symlink_directory_control_and_missing_files_get_their_reason() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    // One block of big2 only (a lone read without an open: no read-ahead): not staged.
    let a = read_as(
        &c,
        Path::new("d/big2.bin"),
        5 * BLOCK_SIZE,
        4096,
        4096,
        false,
    )
    .unwrap();
    assert!(a == pattern(8, BIG)[5 * BLOCK_SIZE as usize..][..4096]);
    std::thread::sleep(Duration::from_millis(200));
    let mut client = DirectClient::connect(&sock).unwrap();
    let cases = [
        ("d/big2.bin", Refusal::NotStaged),
        ("big.bin", Refusal::NotStaged),
        ("small.bin", Refusal::NotStaged),
        ("link.bin", Refusal::Symlink),
        ("d", Refusal::NotRegular),
        (".stagefs/stats", Refusal::NotRegular),
        (".npy/big.bin", Refusal::View),
        ("nope.bin", Refusal::NotFound),
        ("link.bin/x", Refusal::NotFound),
    ];
    for (rel, want) in cases {
        assert_eq!(refusal(&mut client, rel), want, "{rel}");
    }
    assert_eq!(c.snapshot().direct_refused, cases.len() as u64);
    // Each reason counted apart: what `stagefs stat` shows a user whose reads went through FUSE.
    let by = c.snapshot().direct_refused_by;
    let want: std::collections::BTreeMap<String, u64> = [
        ("not_staged", 3),
        ("symlink", 1),
        ("not_regular", 2),
        ("view", 1),
        ("not_found", 2),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(by, want);
    assert_eq!(c.snapshot().direct_opens, 0);
    assert_eq!(c.direct_pins(), 0);
    c.shutdown();
}

#[test]
fn revalidating_mount_hands_out_no_descriptor() {
    let (_t, src, cache) = setup();
    let mut cfg = config(&src, &cache);
    cfg.revalidate = Some(Duration::from_secs(1));
    let (c, _) = mount(cfg);
    let sock = started(&c);
    stage(&c, "big.bin");
    let mut client = DirectClient::connect(&sock).unwrap();
    assert_eq!(refusal(&mut client, "big.bin"), Refusal::Revalidate);
    c.shutdown();
}

#[test]
fn pins_are_released_on_close_and_when_the_connection_ends() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    stage(&c, "big.bin");
    let mut a = DirectClient::connect(&sock).unwrap();
    let (fd1, g1) = open_verified(&mut a, "big.bin");
    let (_fd2, _) = open_verified(&mut a, "big.bin");
    let mut b = DirectClient::connect(&sock).unwrap();
    let (_fd3, _) = open_verified(&mut b, "big.bin");
    assert_eq!(c.direct_pins(), 3);
    drop(fd1);
    a.close(g1.pin).unwrap();
    until("the closed pin released", || c.direct_pins() == 2);
    // A close of a pin the connection does not hold changes nothing.
    b.close(g1.pin).unwrap();
    b.close(u64::MAX).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(c.direct_pins(), 2);
    drop(a);
    until("the ended connection's pin released", || {
        c.direct_pins() == 1
    });
    drop(b);
    until("all pins released", || c.direct_pins() == 0);
    c.shutdown();
}

/// A client in another process (python3, with `socket.recv_fds`) killed with SIGKILL while it
/// holds a descriptor: its pin goes with its connection.
#[test]
fn pins_of_a_killed_client_are_released() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    stage(&c, "big.bin");
    // Verified first (through a connection of our own).
    let mut a = DirectClient::connect(&sock).unwrap();
    let (_, g) = open_verified(&mut a, "big.bin");
    a.close(g.pin).unwrap();
    until("no pins", || c.direct_pins() == 0);
    let script = r#"
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(b'{"op":"direct_open","path":"big.bin"}\n')
msg, fds, flags, addr = socket.recv_fds(s, 512, 1)
print(msg.decode().strip(), len(fds), flush=True)
time.sleep(60)
"#;
    let mut child = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&sock)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 is needed for this test");
    let mut line = String::new();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert!(
        line.contains("\"pin\"") && line.trim_end().ends_with(" 1"),
        "{line}"
    );
    assert_eq!(c.direct_pins(), 1);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    until("the killed client's pin released", || c.direct_pins() == 0);
    c.shutdown();
}

#[test]
fn pinned_copy_is_never_evicted_and_unpinned_one_is() {
    let (_t, src, cache) = setup();
    let mut cfg = config(&src, &cache);
    // Room for one of the two large files.
    cfg.cache_size = BIG as u64 * 3 / 2;
    let (c, _) = mount(cfg);
    let sock = started(&c);
    stage(&c, "big.bin");
    let mut a = DirectClient::connect(&sock).unwrap();
    let (fd, g) = open_verified(&mut a, "big.bin");
    // Reading the other file needs big.bin's room: the pin keeps it.
    stage(&c, "d/big2.bin");
    let mut b = DirectClient::connect(&sock).unwrap();
    let (fd_b, _) = open_verified(&mut b, "big.bin");
    drop(fd_b);
    drop(b);
    assert!(read_all(fd) == pattern(7, BIG), "the pinned copy changed");
    // Unpinned, the same reads evict it: the test above could have failed.
    a.close(g.pin).unwrap();
    until("no pins", || c.direct_pins() == 0);
    stage(&c, "d/big2.bin");
    assert_eq!(refusal(&mut a, "big.bin"), Refusal::NotStaged);
    c.shutdown();
}

#[test]
fn pins_full_refuses_and_ten_thousand_opens_without_close_leave_the_daemon_serving() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    stage(&c, "big.bin");
    let mut a = DirectClient::connect(&sock).unwrap();
    let (mut granted, mut full) = (0usize, 0usize);
    for _ in 0..10_000 {
        match a.open("big.bin") {
            // Closed here, never told: the pin stays.
            Ok((fd, _)) => {
                drop(fd);
                granted += 1;
            }
            Err(ClientError::Refused(Refusal::PinsFull)) => full += 1,
            Err(ClientError::Refused(Refusal::Verifying)) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(granted, MAX_PINS_PER_CONNECTION);
    assert!(full > 8000, "{full}");
    assert_eq!(c.direct_pins(), MAX_PINS_PER_CONNECTION);
    assert!(c.snapshot().direct_refused >= full as u64);
    // Another connection is served, and the leaked pins go with their connection.
    let mut b = DirectClient::connect(&sock).unwrap();
    let (fd, _) = open_verified(&mut b, "big.bin");
    assert!(read_all(fd) == pattern(7, BIG));
    drop(a);
    until("the leaked pins released", || c.direct_pins() == 1);
    c.shutdown();
}

#[test]
fn hostile_requests_get_refusals_and_the_daemon_keeps_serving() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    stage(&c, "big.bin");
    let mut first = DirectClient::connect(&sock).unwrap();
    drop(open_verified(&mut first, "big.bin"));
    drop(first);
    let refused_before = c.snapshot().direct_refused;
    let mut raw = UnixStream::connect(&sock).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let long = "a/".repeat(3000);
    let lines = [
        r#"{"op":"direct_open","path":"../etc/passwd"}"#.to_string(),
        r#"{"op":"direct_open","path":"/etc/passwd"}"#.to_string(),
        r#"{"op":"direct_open","path":"big.bin\u0000x"}"#.to_string(),
        r#"{"op":"direct_open","path":"d/../big.bin"}"#.to_string(),
        r#"{"op":"direct_open","path":7}"#.to_string(),
        format!(r#"{{"op":"direct_open","path":"{long}x"}}"#),
    ];
    let mut r = std::io::BufReader::new(raw.try_clone().unwrap());
    for l in &lines {
        raw.write_all(l.as_bytes()).unwrap();
        raw.write_all(b"\n").unwrap();
        let mut reply = String::new();
        std::io::BufRead::read_line(&mut r, &mut reply).unwrap();
        assert_eq!(reply, "{\"refused\":\"bad_path\"}\n", "{l}");
    }
    // Lines that are no request at all, and closes of pins never granted: no reply, no harm.
    raw.write_all(b"{not json\n\x00\x01\x02\n[1,2]\n{\"op\":\"direct_close\",\"pin\":5}\n")
        .unwrap();
    raw.write_all(&vec![b'x'; 200 << 10]).unwrap();
    raw.write_all(b"\n").unwrap();
    let mut client = DirectClient::from_stream(raw).unwrap();
    let (fd, _) = open_verified(&mut client, "big.bin");
    assert!(read_all(fd) == pattern(7, BIG));
    assert_eq!(
        c.snapshot().direct_refused - refused_before,
        lines.len() as u64
    );
    assert!(c.snapshot().hints_rejected >= 3);
    c.shutdown();
}

#[test]
fn copies_found_at_remount_are_verified_in_the_background() {
    let (_t, src, cache) = setup();
    {
        let (c, _) = mount(config(&src, &cache));
        stage(&c, "big.bin");
        c.shutdown();
    }
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    let mut client = DirectClient::connect(&sock).unwrap();
    // No open and no read: the copy found at mount is verified in the background, so the
    // first direct open of the warm epoch is granted.
    until("background verification", || {
        c.store().unverified_copies().is_empty()
    });
    let (fd, _) = client.open("big.bin").unwrap();
    assert!(read_all(fd) == pattern(7, BIG));
    assert_eq!(c.snapshot().bytes_from_source, 0);
    assert_eq!(c.stats().direct_opens.load(Relaxed), 1);
    c.shutdown();
}

/// A copy completed in this mount was verified only when its first direct open came (which
/// was refused "verifying"), so the whole second epoch of a job under `stagefs run` opened its
/// files through FUSE. Now a copy is queued for verification as it becomes complete.
#[test]
fn regression_a_copy_staged_in_this_mount_was_refused_verifying_in_the_next_epoch() {
    let (_t, src, cache) = setup();
    let mut cfg = config(&src, &cache);
    cfg.stage = false;
    let (c, _) = mount(cfg);
    let sock = started(&c);
    stage(&c, "big.bin");
    // No open yet: the copy is verified because it became complete.
    until("verification of the completed copy", || {
        c.store().unverified_copies().is_empty()
    });
    let mut client = DirectClient::connect(&sock).unwrap();
    let (fd, _) = client.open("big.bin").unwrap();
    assert!(read_all(fd) == pattern(7, BIG));
    assert_eq!(c.snapshot().direct_refused, 0);
    c.shutdown();
}

/// After a remount the copies are verified in the background, and an epoch that starts at once
/// outran it: every open was refused "verifying" and the whole first warm epoch read through
/// FUSE (bench/mount/direct.sh: 0 direct opens). An open of a complete copy not yet verified is
/// now verified on the spot, through the page cache the reader reads next.
#[test]
fn regression_the_first_epoch_after_a_remount_was_refused_verifying() {
    let (_t, src, cache) = setup();
    {
        let (c, _) = mount(config(&src, &cache));
        stage(&c, "big.bin");
        stage(&c, "d/big2.bin");
        c.shutdown();
    }
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    let mut client = DirectClient::connect(&sock).unwrap();
    for (rel, seed) in [("big.bin", 7), ("d/big2.bin", 8)] {
        let (fd, _) = client.open(rel).expect("granted at once, not refused");
        assert!(read_all(fd) == pattern(seed, BIG));
    }
    assert_eq!(c.snapshot().direct_refused, 0);
    c.shutdown();
}

/// Opens the copy a table listing names, as the preload library does, checked to be the
/// inode listed; `None` if the listing is not `Open` or the copy is not that inode.
fn open_listed(
    table: &TableReader,
    dir: &OwnedFd,
    rel: &str,
) -> Result<fs::File, stagefs_protocol::table::Listing> {
    use rustix::fs::{Mode, OFlags};
    let l = table.lookup(rel.as_bytes());
    let Listing::Open(copy) = l else {
        return Err(l);
    };
    let name = stagefs_protocol::table::copy_name(copy.no);
    let name = std::str::from_utf8(&name).unwrap();
    let fd = rustix::fs::openat(dir, name, OFlags::RDONLY | OFlags::NOFOLLOW, Mode::empty())
        .map_err(|_| l)?;
    let st = rustix::fs::fstat(&fd).unwrap();
    if st.st_ino != copy.ino || st.st_dev != table.dev() || st.st_size as u64 != copy.size {
        return Err(l);
    }
    Ok(fs::File::from(fd))
}

fn table_of(sock: &Path) -> (TableReader, SharedCounters, OwnedFd) {
    let mut client = DirectClient::connect(sock).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let (t, n, d) = loop {
        match client.table() {
            Ok(x) => break x,
            Err(ClientError::Refused(Refusal::NotReady)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("direct table: {e}"),
        }
    };
    (
        TableReader::map(t.as_fd()).unwrap(),
        SharedCounters::map(n.as_fd()).unwrap(),
        d,
    )
}

/// Small files: an exact copy of their own, granted unpinned over the socket and listed in the
/// direct table for readers to open themselves; large ones listed "ask".
#[test]
fn small_files_are_granted_unpinned_and_listed_for_readers_to_open_themselves() {
    let (_t, src, cache) = setup();
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    read(&c, Path::new("small.bin"), 0, 1000, 1000).unwrap();
    stage(&c, "big.bin");
    let (table, counters, dir) = table_of(&sock);
    until("the small copy listed", || {
        matches!(table.lookup(b"small.bin"), Listing::Open(_))
    });
    until("the large copy listed", || {
        table.lookup(b"big.bin") == Listing::Ask
    });
    // Not staged, a directory, nothing at all: the table is complete, so the mount.
    assert_eq!(table.flags() & FLAG_COMPLETE, FLAG_COMPLETE);
    for rel in ["d/big2.bin", "d", "nope", ".npy/small.bin"] {
        assert_eq!(table.lookup(rel.as_bytes()), Listing::Mount, "{rel}");
    }
    let mut f = open_listed(&table, &dir, "small.bin").unwrap();
    let mut got = Vec::new();
    f.read_to_end(&mut got).unwrap();
    assert!(got == pattern(9, 1000));
    assert!(
        f.write_all(b"x").is_err(),
        "a listed copy opened read-only writes nothing"
    );
    counters.add(1000);
    assert_eq!(c.snapshot().direct_table_opens, 1);
    assert_eq!(c.snapshot().direct_opens, 1);
    // Over the socket: granted, no pin to hold.
    let mut client = DirectClient::connect(&sock).unwrap();
    let (fd, g) = client.open("small.bin").unwrap();
    assert_eq!(g.pin, 0);
    assert!(read_all(fd) == pattern(9, 1000));
    assert_eq!(c.direct_pins(), 0);
    c.shutdown();
}

/// A remount trusts the copies an earlier mount verified by their record (inode, size, change
/// time) without reading them again, and lists them in the table at once.
#[test]
fn a_remount_trusts_verified_copies_without_reading_them() {
    let (_t, src, cache) = setup();
    {
        let (c, _) = mount(config(&src, &cache));
        read(&c, Path::new("small.bin"), 0, 1000, 1000).unwrap();
        stage(&c, "big.bin");
        until("both verified", || c.snapshot().copies_verified == 2);
        c.shutdown();
    }
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    let (table, _, dir) = table_of(&sock);
    until("the table complete", || table.flags() & FLAG_COMPLETE != 0);
    let s = c.snapshot();
    assert_eq!(
        (s.copies_trusted, s.copies_verified),
        (2, 0),
        "read again: {s:?}"
    );
    assert!(open_listed(&table, &dir, "small.bin").is_ok());
    assert_eq!(table.lookup(b"big.bin"), Listing::Ask);
    let mut client = DirectClient::connect(&sock).unwrap();
    let (fd, _) = client.open("big.bin").unwrap();
    assert!(read_all(fd) == pattern(7, BIG));
    c.shutdown();
}

/// Anything done to a copy between mounts — bytes changed in place (same size), truncated,
/// replaced by another file — is found before any descriptor of it is handed out: the copy is
/// read again, a bad one dropped and fetched again, and readers only ever get the source's
/// bytes.
#[test]
fn a_copy_changed_between_mounts_is_verified_again_and_never_served_wrong() {
    for how in ["flip", "truncate", "replace", "rewrite_same"] {
        let (_t, src, cache) = setup();
        {
            let (c, _) = mount(config(&src, &cache));
            read(&c, Path::new("small.bin"), 0, 1000, 1000).unwrap();
            stage(&c, "big.bin");
            until("both verified", || c.snapshot().copies_verified == 2);
            c.shutdown();
        }
        for e in fs::read_dir(cache.join("v2/files")).unwrap() {
            let p = e.unwrap().path();
            let mut b = fs::read(&p).unwrap();
            match how {
                "flip" => {
                    b[500] ^= 0x55;
                    fs::OpenOptions::new()
                        .write(true)
                        .open(&p)
                        .unwrap()
                        .write_all(&b)
                        .unwrap();
                }
                "truncate" => fs::OpenOptions::new()
                    .write(true)
                    .open(&p)
                    .unwrap()
                    .set_len(100)
                    .unwrap(),
                "replace" => {
                    b[10] ^= 1;
                    let tmp = p.with_extension("new");
                    fs::write(&tmp, &b).unwrap();
                    fs::rename(&tmp, &p).unwrap();
                }
                // The same bytes written again: the copy is intact, but must be read to know.
                _ => fs::write(&p, &b).unwrap(),
            }
        }
        let (c, _) = mount(config(&src, &cache));
        let sock = started(&c);
        let (table, _, dir) = table_of(&sock);
        until("the table complete", || table.flags() & FLAG_COMPLETE != 0);
        assert_eq!(
            c.snapshot().copies_trusted,
            0,
            "{how}: a changed copy was trusted"
        );
        let mut client = DirectClient::connect(&sock).unwrap();
        for (rel, seed, len) in [("small.bin", 9, 1000), ("big.bin", 7, BIG)] {
            // Listed only once verified again; the bytes are the source's whatever we get.
            if let Ok(mut f) = open_listed(&table, &dir, rel) {
                let mut got = Vec::new();
                f.read_to_end(&mut got).unwrap();
                assert!(
                    got == pattern(seed, len),
                    "{how}: {rel} listed with wrong bytes"
                );
            }
            match client.open(rel) {
                Ok((fd, _)) => assert!(read_all(fd) == pattern(seed, len), "{how}: {rel}"),
                Err(ClientError::Refused(Refusal::NotStaged | Refusal::Verifying)) => {}
                Err(e) => panic!("{how}: {rel}: {e}"),
            }
            let got = read(&c, Path::new(rel), 0, len as u64, 1 << 20).unwrap();
            assert!(got == pattern(seed, len), "{how}: {rel} through the mount");
        }
        if how == "rewrite_same" {
            until("both verified again", || c.snapshot().copies_verified == 2);
        } else {
            assert!(
                c.snapshot().corrupt_blocks >= 1 || how == "truncate",
                "{how}"
            );
        }
        c.shutdown();
    }
}

/// A copy verified and then cut short by a killed daemon's lost log is never trusted: the
/// `Trusted` record is written only with (after) the blocks it vouches for.
#[test]
fn a_killed_daemon_leaves_no_record_trusting_a_copy_it_had_not_logged() {
    let (_t, src, cache) = setup();
    {
        let (c, _) = mount(config(&src, &cache));
        stage(&c, "big.bin");
        until("verified", || c.snapshot().copies_verified == 1);
        c.abandon(); // kill -9 before the flush: no block records, no trust record
    }
    let (c, _) = mount(config(&src, &cache));
    let sock = started(&c);
    let (table, _, _) = table_of(&sock);
    until("the table complete", || table.flags() & FLAG_COMPLETE != 0);
    assert_eq!(c.snapshot().copies_trusted, 0);
    assert_eq!(table.lookup(b"big.bin"), Listing::Mount);
    let got = read(&c, Path::new("big.bin"), 0, BIG as u64, 1 << 20).unwrap();
    assert!(got == pattern(7, BIG));
    c.shutdown();
}

/// A small copy is evicted whole, by unlinking: a descriptor a reader already holds (no pin)
/// still reads every byte, and the table stops listing it.
#[test]
fn an_evicted_small_copy_is_unlisted_and_an_open_descriptor_keeps_its_bytes() {
    let (_t, src, cache) = setup();
    for i in 0..6 {
        fs::write(src.join(format!("s{i}.bin")), pattern(20 + i, 600_000)).unwrap();
    }
    let mut cfg = config(&src, &cache);
    // Room for three of the six, and no prefetch of the next files.
    cfg.cache_size = 3 * 600_000 + 3 * 4096;
    cfg.cross_file = 0;
    let (c, _) = mount(cfg);
    let sock = started(&c);
    let (table, _, dir) = table_of(&sock);
    read(&c, Path::new("s0.bin"), 0, 600_000, 1 << 20).unwrap();
    until("s0 listed", || {
        matches!(table.lookup(b"s0.bin"), Listing::Open(_))
    });
    let mut held = open_listed(&table, &dir, "s0.bin").unwrap();
    for i in 1..6 {
        read(&c, Path::new(&format!("s{i}.bin")), 0, 600_000, 1 << 20).unwrap();
    }
    until("s0 evicted and unlisted", || {
        table.lookup(b"s0.bin") == Listing::Mount
    });
    assert!(open_listed(&table, &dir, "s0.bin").is_err());
    let mut got = Vec::new();
    held.read_to_end(&mut got).unwrap();
    assert!(
        got == pattern(20, 600_000),
        "an evicted copy's open descriptor read other bytes"
    );
    c.shutdown();
}
