//! The snapshot file: `stagefs index` output, and the copy a mount keeps in its cache.
//!
//! Little-endian, one fixed header then packed sections, then a CRC-32 of everything before it:
//!
//! ```text
//! header (128 bytes)  magic "STGFSIDX", format version, header length, snapshot id,
//!                     creation time, the length of every section, scan statistics
//! root                the source root's path (bytes)
//! owners              (uid u32, gid u32) per interned owner
//! nodes               46 bytes per node, breadth first:
//!                     kind u8, flags u8 (0), perm u16, name length u16, owner u32,
//!                     nlink u32, size u64, mtime ns i64, inode u64, ctime ns i64
//! names               all names, in node order (the root's is empty)
//! dirs                per directory node, in node order: child count u32,
//!                     state u8 (0 listed, 1 failed, 2 not listed), errno i32
//! links               per symlink node, in node order: target length u32; then all targets
//! devs                per device node, in node order: rdev u64
//! errors              per kept error message: length u32; then all messages
//! crc32               of all of the above
//! ```
//!
//! Nodes are written breadth first, so each directory's children are the next `count` ids after
//! the previous directory's: ranges, parents and per-kind side records are all implied by
//! order, and there are no stored offsets or ids to trust. Loading streams the file through a
//! 1 MiB buffer (the names go straight into the tree's arena; no copy of the file is held) and
//! still trusts nothing: the section lengths must add up to the file's exact size before
//! anything is allocated (and each allocation is fallible), every kind, flag, owner index and
//! name is checked, each directory's children must be later nodes (so the tree is acyclic and
//! every node has one parent), and names must be strictly increasing within a directory. The
//! checksum catches damage (on an inconsistency the rest is still read, so damage is reported as
//! a checksum mismatch rather than as its first symptom); the checks make a hostile file that
//! carries a valid checksum an error rather than a panic or an out-of-memory abort.
//!
//! The file is written to a new `0600` temporary with a random name (`O_EXCL`) in the target's
//! directory, fsynced and renamed over the target, and the directory fsynced: a reader sees the
//! old file or the new one, never a torn one.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, UNIX_EPOCH};

use rustix::fs::{Mode, OFlags};
use stagefs_prefetch::cachedir::{create_temp_in, CacheDir};
use stagefs_prefetch::source::FileKind;

use super::tree::{valid_name, Dir, DirState, Fields, Node, Tree, MAX_ERRORS, MAX_NODES, NO_AUX};
use super::{Inner, NodeId, Queue, ScanOptions, Snapshot, SnapshotError};

/// First bytes of every snapshot file.
pub(crate) const MAGIC: [u8; 8] = *b"STGFSIDX";
/// The format version this code writes and reads (2: nodes carry the ctime; a file of
/// version 1 is refused, and a mount lists the source again).
pub(crate) const VERSION: u32 = 2;
/// Size of the header.
const HEADER_LEN: usize = 128;
/// Size of a node record.
const NODE_LEN: u64 = 46;
/// Node records read per batch (46 KiB).
const NODE_BATCH: usize = 1024;
/// Size of a directory record.
const DIR_LEN: u64 = 9;
/// Size of an owner record.
const OWNER_LEN: u64 = 8;
/// Size of the checksum after the sections.
const TRAILER_LEN: usize = 4;

/// Directory states as stored.
const DIR_LISTED: u8 = 0;
const DIR_FAILED: u8 = 1;
const DIR_UNLISTED: u8 = 2;

/// Loads a snapshot file named by the user (symlinks followed: the user chose the path).
pub(crate) fn load(path: &Path) -> Result<Arc<Snapshot>, SnapshotError> {
    // O_NONBLOCK: a FIFO given as the index must not hang the mount.
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    )
    .map_err(|e| SnapshotError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    load_file(File::from(fd), path)
}

/// Loads file `name` of the private cache directory.
pub(crate) fn load_from(dir: &CacheDir, name: &str) -> Result<Arc<Snapshot>, SnapshotError> {
    let path = dir.path().join(name);
    let file = dir.open_read(name).map_err(|source| SnapshotError::Io {
        path: path.clone(),
        source,
    })?;
    load_file(file, &path)
}

/// Streams an open regular file through the parser (at most its size at open: a file growing
/// meanwhile cannot make the load read more).
fn load_file(file: File, path: &Path) -> Result<Arc<Snapshot>, SnapshotError> {
    let io_err = |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = file.metadata().map_err(io_err)?;
    if !meta.is_file() {
        return Err(io_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        )));
    }
    let len = meta.len();
    parse_from(BufReader::with_capacity(1 << 20, file.take(len)), len, path)
}

/// Writes `snap` to `path` atomically.
pub(crate) fn save(snap: &Snapshot, path: &Path) -> Result<(), SnapshotError> {
    let io_err = |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    };
    let name = path.file_name().ok_or_else(|| {
        io_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the index path names no file",
        ))
    })?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = rustix::fs::open(
        parent,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err(e.into()))?;
    let (file, temp) = create_temp_in(dir.as_fd(), ".stagefs-index").map_err(io_err)?;
    let written = write_file(snap, file).and_then(|()| {
        rustix::fs::renameat(&dir, &temp, &dir, name)?;
        rustix::fs::fsync(&dir)?;
        Ok(())
    });
    if let Err(e) = written {
        let _ = rustix::fs::unlinkat(&dir, &temp, rustix::fs::AtFlags::empty());
        return Err(io_err(e));
    }
    Ok(())
}

/// Writes `snap` as file `name` of the private cache directory, atomically.
pub(crate) fn save_to(snap: &Snapshot, dir: &CacheDir, name: &str) -> Result<(), SnapshotError> {
    let io_err = |source| SnapshotError::Io {
        path: dir.path().join(name),
        source,
    };
    let (file, temp) = dir.create_temp(name).map_err(io_err)?;
    let written = write_file(snap, file).and_then(|()| {
        dir.rename(&temp, name)?;
        dir.sync()
    });
    if let Err(e) = written {
        let _ = dir.remove(&temp);
        return Err(io_err(e));
    }
    Ok(())
}

/// Writes the snapshot into `file` and flushes it to disk.
fn write_file(snap: &Snapshot, file: File) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(1 << 20, file);
    write_all(snap, &mut w)?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()
}

/// Writes the whole file format, checksum included, to `w`.
pub(crate) fn write_all(snap: &Snapshot, w: &mut impl Write) -> io::Result<()> {
    let mut w = CrcWriter {
        inner: w,
        crc: crc32fast::Hasher::new(),
    };
    write_snapshot(snap, &mut w)?;
    let crc = w.crc.finalize();
    w.inner.write_all(&crc.to_le_bytes())?;
    w.inner.flush()
}

/// A writer that checksums what passes through.
struct CrcWriter<W: Write> {
    inner: W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Writes header and sections (everything but the checksum).
fn write_snapshot(snap: &Snapshot, w: &mut impl Write) -> io::Result<()> {
    let inner = &snap.inner;
    let t = inner.read();
    // Breadth-first order of the visible tree, and each directory's record.
    let mut order: Vec<NodeId> = vec![0];
    let mut dirs: Vec<(u32, u8, i32)> = Vec::new();
    let mut i = 0;
    while let Some(&id) = order.get(i) {
        i += 1;
        let Some(node) = t.node(id) else { continue };
        if node.kind() != FileKind::Dir {
            continue;
        }
        let Some(d) = t.dir_index(id) else {
            dirs.push((0, DIR_UNLISTED, 0));
            continue;
        };
        let dir = t.dirs[d as usize];
        match dir.state {
            DirState::Ready => {
                let kids = t.kids(d);
                let before = order.len();
                order.extend(
                    (0..kids.len())
                        .map(|k| kids.get(k))
                        .filter(|&k| t.node(k).is_some_and(|n| n.visible())),
                );
                dirs.push(((order.len() - before) as u32, DIR_LISTED, 0));
            }
            DirState::Failed => dirs.push((0, DIR_FAILED, dir.errno)),
            _ => dirs.push((0, DIR_UNLISTED, 0)),
        }
    }
    let mut names_len = 0u64;
    let (mut links, mut link_bytes, mut devs) = (0u32, 0u64, 0u32);
    for &id in &order {
        names_len += t.name(id).len() as u64;
        match t.nodes[id as usize].kind() {
            FileKind::Symlink => {
                links += 1;
                link_bytes += t.link(id).map_or(0, |l| l.len() as u64);
            }
            FileKind::CharDevice | FileKind::BlockDevice => devs += 1,
            _ => {}
        }
    }
    let errors = &t.errors;
    let error_bytes: u64 = errors.iter().map(|e| e.len() as u64).sum();
    let created = inner.created.duration_since(UNIX_EPOCH).unwrap_or_default();
    let root = inner.root.as_os_str().as_bytes();
    let elapsed = if inner.complete.load(Ordering::SeqCst) {
        inner.elapsed_ns.load(Ordering::SeqCst)
    } else {
        0
    };

    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&(HEADER_LEN as u32).to_le_bytes());
    h.extend_from_slice(&inner.id.to_le_bytes());
    h.extend_from_slice(&(created.as_secs() as i64).to_le_bytes());
    h.extend_from_slice(&created.subsec_nanos().to_le_bytes());
    h.extend_from_slice(&(root.len() as u32).to_le_bytes());
    h.extend_from_slice(&(order.len() as u32).to_le_bytes());
    h.extend_from_slice(&(dirs.len() as u32).to_le_bytes());
    h.extend_from_slice(&names_len.to_le_bytes());
    h.extend_from_slice(&links.to_le_bytes());
    h.extend_from_slice(&devs.to_le_bytes());
    h.extend_from_slice(&link_bytes.to_le_bytes());
    h.extend_from_slice(&(t.owners.len() as u32).to_le_bytes());
    h.extend_from_slice(&(errors.len() as u32).to_le_bytes());
    h.extend_from_slice(&t.errors_total.to_le_bytes());
    h.extend_from_slice(&error_bytes.to_le_bytes());
    let requests = inner.loaded_requests + inner.requests.load(Ordering::SeqCst);
    h.extend_from_slice(&requests.to_le_bytes());
    h.extend_from_slice(&elapsed.to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    debug_assert_eq!(h.len(), HEADER_LEN);
    w.write_all(&h)?;
    w.write_all(root)?;
    for &(uid, gid) in &t.owners {
        w.write_all(&uid.to_le_bytes())?;
        w.write_all(&gid.to_le_bytes())?;
    }
    let mut rec = [0u8; NODE_LEN as usize];
    for &id in &order {
        let f = t.nodes[id as usize].fields();
        rec[0] = f.kind as u8;
        rec[1] = 0;
        rec[2..4].copy_from_slice(&f.perm.to_le_bytes());
        rec[4..6].copy_from_slice(&(t.name(id).len() as u16).to_le_bytes());
        rec[6..10].copy_from_slice(&f.owner.to_le_bytes());
        rec[10..14].copy_from_slice(&f.nlink.to_le_bytes());
        rec[14..22].copy_from_slice(&f.size.to_le_bytes());
        rec[22..30].copy_from_slice(&f.mtime_ns.to_le_bytes());
        rec[30..38].copy_from_slice(&f.ino.to_le_bytes());
        rec[38..46].copy_from_slice(&f.ctime_ns.to_le_bytes());
        w.write_all(&rec)?;
    }
    for &id in &order {
        w.write_all(t.name(id))?;
    }
    for &(count, state, errno) in &dirs {
        w.write_all(&count.to_le_bytes())?;
        w.write_all(&[state])?;
        w.write_all(&errno.to_le_bytes())?;
    }
    let symlinks = || {
        order
            .iter()
            .filter(|&&id| t.nodes[id as usize].kind() == FileKind::Symlink)
    };
    for &id in symlinks() {
        w.write_all(&(t.link(id).map_or(0, <[u8]>::len) as u32).to_le_bytes())?;
    }
    for &id in symlinks() {
        w.write_all(t.link(id).unwrap_or_default())?;
    }
    for &id in &order {
        if let Some(a) = t.attr(id) {
            if matches!(a.kind, FileKind::CharDevice | FileKind::BlockDevice) {
                w.write_all(&a.rdev.to_le_bytes())?;
            }
        }
    }
    for e in errors {
        w.write_all(&(e.len() as u32).to_le_bytes())?;
    }
    for e in errors {
        w.write_all(e.as_bytes())?;
    }
    Ok(())
}

/// Reads the file's sections in order, checksumming as it goes: a load holds the tree it
/// builds, never a copy of the file. Running out is corruption, never a panic.
struct Reader<'a, R: Read> {
    inner: R,
    crc: crc32fast::Hasher,
    /// Bytes read so far.
    pos: u64,
    /// The file's size.
    len: u64,
    path: &'a Path,
}

impl<R: Read> Reader<'_, R> {
    fn corrupt(&self, reason: impl Into<String>) -> SnapshotError {
        SnapshotError::Corrupt {
            path: self.path.to_path_buf(),
            reason: reason.into(),
        }
    }

    fn read_err(&self, e: io::Error) -> SnapshotError {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            self.corrupt(format!("truncated at byte {}", self.pos))
        } else {
            SnapshotError::Io {
                path: self.path.to_path_buf(),
                source: e,
            }
        }
    }

    /// Fills `buf` with the next bytes.
    fn fill(&mut self, buf: &mut [u8]) -> Result<(), SnapshotError> {
        self.inner.read_exact(buf).map_err(|e| self.read_err(e))?;
        self.crc.update(buf);
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], SnapshotError> {
        let mut a = [0u8; N];
        self.fill(&mut a)?;
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.array::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn i32(&mut self) -> Result<i32, SnapshotError> {
        Ok(i32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn i64(&mut self) -> Result<i64, SnapshotError> {
        Ok(i64::from_le_bytes(self.array()?))
    }
    fn u128(&mut self) -> Result<u128, SnapshotError> {
        Ok(u128::from_le_bytes(self.array()?))
    }

    /// The next `n` bytes, in a fallibly allocated vector (`n` is already bounded by the file's
    /// size).
    fn bytes(&mut self, n: usize, what: &str) -> Result<Vec<u8>, SnapshotError> {
        let mut v = self.vec(n, what)?;
        (&mut self.inner)
            .take(n as u64)
            .read_to_end(&mut v)
            .map_err(|e| self.read_err(e))?;
        if v.len() != n {
            return Err(self.read_err(io::ErrorKind::UnexpectedEof.into()));
        }
        self.crc.update(&v);
        self.pos += n as u64;
        Ok(v)
    }

    /// A vector with room for `n` elements, or a corruption error (never an abort).
    fn vec<T>(&self, n: usize, what: &str) -> Result<Vec<T>, SnapshotError> {
        let mut v = Vec::new();
        v.try_reserve_exact(n)
            .map_err(|_| self.corrupt(format!("{n} {what} do not fit in memory")))?;
        Ok(v)
    }

    /// Whether the trailer matches the checksum of everything read.
    fn trailer_matches(&mut self) -> Result<bool, SnapshotError> {
        let mut t = [0u8; TRAILER_LEN];
        self.inner
            .read_exact(&mut t)
            .map_err(|e| self.read_err(e))?;
        Ok(self.crc.clone().finalize() == u32::from_le_bytes(t))
    }

    /// After an inconsistency: reads the rest of the file, so that damage (a checksum
    /// mismatch) is reported as damage rather than as its first symptom.
    fn diagnose(&mut self, reason: String) -> SnapshotError {
        let rest = self.len.saturating_sub(self.pos + TRAILER_LEN as u64);
        let mut buf = vec![0u8; 64 << 10];
        let mut left = rest;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            if self.inner.read_exact(&mut buf[..n]).is_err() {
                return self.corrupt(reason);
            }
            self.crc.update(&buf[..n]);
            left -= n as u64;
        }
        match self.trailer_matches() {
            Ok(false) => self.corrupt(format!(
                "damaged or truncated (checksum mismatch; first inconsistency: {reason})"
            )),
            _ => self.corrupt(reason),
        }
    }
}

/// Parses and validates a snapshot file's contents.
pub(crate) fn parse(bytes: &[u8], path: &Path) -> Result<Arc<Snapshot>, SnapshotError> {
    parse_from(bytes, bytes.len() as u64, path)
}

/// Parses and validates the `len` bytes of a snapshot file that `inner` yields.
fn parse_from(inner: impl Read, len: u64, path: &Path) -> Result<Arc<Snapshot>, SnapshotError> {
    let started = Instant::now();
    let r = &mut Reader {
        inner,
        crc: crc32fast::Hasher::new(),
        pos: 0,
        len,
        path,
    };
    let not_index = || SnapshotError::WrongFormat {
        path: path.to_path_buf(),
        reason: "not a stagefs index (written by `stagefs index`)".into(),
    };
    if len < MAGIC.len() as u64 {
        return Err(not_index());
    }
    if r.array::<8>()? != MAGIC {
        return Err(not_index());
    }
    if len < (HEADER_LEN + TRAILER_LEN) as u64 {
        return Err(r.corrupt(format!("truncated: {len} bytes")));
    }
    let version = r.u32()?;
    if version != VERSION {
        return Err(SnapshotError::WrongFormat {
            path: path.to_path_buf(),
            reason: format!(
                "stagefs index format version {version}, but this stagefs reads version \
                 {VERSION}; write it again with this stagefs's `stagefs index`"
            ),
        });
    }
    let inner = match parse_body(r) {
        Ok(inner) => inner,
        Err(SnapshotError::Corrupt { reason, .. }) => return Err(r.diagnose(reason)),
        Err(e) => return Err(e),
    };
    if !r.trailer_matches()? {
        return Err(r.corrupt("damaged (checksum mismatch)"));
    }
    tracing::debug!(
        "loaded {} entries from {} in {:?}",
        inner.read().nodes.len(),
        path.display(),
        started.elapsed()
    );
    Ok(Arc::new(Snapshot {
        inner: Arc::new(inner),
    }))
}

/// Everything after the magic and version, up to the trailer.
fn parse_body<R: Read>(r: &mut Reader<'_, R>) -> Result<Inner, SnapshotError> {
    let header_len = r.u32()?;
    let id = r.u128()?;
    let created_secs = r.i64()?;
    let created_nanos = r.u32()?;
    let root_len = r.u32()?;
    let n_nodes = r.u32()?;
    let n_dirs = r.u32()?;
    let names_len = r.u64()?;
    let n_links = r.u32()?;
    let n_devs = r.u32()?;
    let link_bytes = r.u64()?;
    let n_owners = r.u32()?;
    let n_errors = r.u32()?;
    let errors_total = r.u64()?;
    let error_bytes = r.u64()?;
    let loaded_requests = r.u64()?;
    let elapsed_ns = r.u64()?;
    let reserved = r.u64()?;
    if header_len as usize != HEADER_LEN || reserved != 0 {
        return Err(r.corrupt("unknown header layout"));
    }
    // The sections must add up to the file's exact size: every count is bounded by the bytes
    // actually there before anything is allocated from it.
    let expected = [
        HEADER_LEN as u64,
        u64::from(root_len),
        u64::from(n_owners) * OWNER_LEN,
        u64::from(n_nodes) * NODE_LEN,
        names_len,
        u64::from(n_dirs) * DIR_LEN,
        u64::from(n_links) * 4,
        link_bytes,
        u64::from(n_devs) * 8,
        u64::from(n_errors) * 4,
        error_bytes,
        TRAILER_LEN as u64,
    ]
    .iter()
    .try_fold(0u64, |a, &b| a.checked_add(b));
    if expected != Some(r.len) {
        return Err(r.corrupt(format!(
            "section lengths do not add up to the file's size ({} bytes)",
            r.len
        )));
    }
    if n_nodes == 0 || n_nodes as usize > MAX_NODES {
        return Err(r.corrupt(format!("{n_nodes} entries")));
    }
    if names_len > u64::from(u32::MAX) || link_bytes > u64::from(u32::MAX) {
        return Err(r.corrupt("names or link targets longer than 4 GiB"));
    }
    if created_secs < 0 || created_nanos >= 1_000_000_000 || errors_total < u64::from(n_errors) {
        return Err(r.corrupt("invalid header values"));
    }
    let created = UNIX_EPOCH + Duration::new(created_secs as u64, created_nanos);

    let root_bytes = r.bytes(root_len as usize, "root path bytes")?;
    if root_bytes.first() != Some(&b'/') || root_bytes.contains(&0) {
        return Err(r.corrupt("the recorded source root is not an absolute path"));
    }
    let root = PathBuf::from(std::ffi::OsString::from_vec(root_bytes));

    let mut tree = Tree::empty();
    tree.owners = r.vec(n_owners as usize, "owners")?;
    for _ in 0..n_owners {
        let uid = r.u32()?;
        let gid = r.u32()?;
        tree.owners.push((uid, gid));
    }
    tree.index_owners();

    let n = n_nodes as usize;
    let mut nodes: Vec<Node> = r.vec(n, "entries")?;
    let mut dir_nodes: Vec<NodeId> = r.vec(n_dirs as usize, "directories")?;
    let (mut links, mut devs) = (0u32, 0u32);
    let mut name_off = 0u64;
    // Records are read (and checksummed) a batch at a time: per-record calls cost more than
    // the decoding.
    let mut batch = vec![0u8; NODE_BATCH * NODE_LEN as usize];
    for i in 0..n {
        let in_batch = i % NODE_BATCH;
        if in_batch == 0 {
            let k = (n - i).min(NODE_BATCH) * NODE_LEN as usize;
            r.fill(&mut batch[..k])?;
        }
        let rec = &batch[in_batch * NODE_LEN as usize..][..NODE_LEN as usize];
        let le16 = |o: usize| u16::from_le_bytes([rec[o], rec[o + 1]]);
        let le32 = |o: usize| u32::from_le_bytes([rec[o], rec[o + 1], rec[o + 2], rec[o + 3]]);
        let le64 = |o: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&rec[o..o + 8]);
            u64::from_le_bytes(b)
        };
        let kind = FileKind::from_u8(rec[0])
            .ok_or_else(|| r.corrupt(format!("entry {i}: invalid type {}", rec[0])))?;
        let (flags, perm, name_len, owner) = (rec[1], le16(2), le16(4), le32(6));
        let f = Fields {
            kind,
            perm,
            owner,
            nlink: le32(10),
            size: le64(14),
            mtime_ns: le64(22) as i64,
            ctime_ns: le64(38) as i64,
            ino: le64(30),
        };
        if flags != 0 || perm > 0o7777 || owner >= n_owners {
            return Err(r.corrupt(format!("entry {i}: invalid flags, mode or owner")));
        }
        if (i == 0) != (name_len == 0) || (i == 0 && kind != FileKind::Dir) {
            return Err(r.corrupt(format!("entry {i}: invalid name length or root type")));
        }
        let aux = match kind {
            FileKind::Dir => {
                if dir_nodes.len() == n_dirs as usize {
                    return Err(r.corrupt("more directories than the header says"));
                }
                dir_nodes.push(i as NodeId);
                dir_nodes.len() as u32 - 1
            }
            FileKind::Symlink => {
                links += 1;
                links - 1
            }
            FileKind::CharDevice | FileKind::BlockDevice => {
                devs += 1;
                devs - 1
            }
            _ => NO_AUX,
        };
        // Offsets past `names_len` are refused right after the loop, before any name is read.
        nodes.push(Node::from_fields(&f, name_off as u32, name_len, aux));
        name_off += u64::from(name_len);
    }
    if name_off != names_len {
        return Err(r.corrupt("name lengths do not add up to the names section"));
    }
    if dir_nodes.len() != n_dirs as usize || links != n_links || devs != n_devs {
        return Err(r.corrupt("entry types do not match the header's counts"));
    }
    tree.names = r.bytes(names_len as usize, "name bytes")?;
    tree.nodes = nodes;
    // No name may hold `/` or NUL: one scan of the whole arena; then only `.` and `..` remain
    // to refuse (every name but the root's is non-empty, checked above).
    let clean_arena = !tree.names.contains(&b'/') && !tree.names.contains(&0);
    for id in 1..n as NodeId {
        let name = tree.name(id);
        if (!clean_arena || name.len() <= 2) && !valid_name(name) {
            return Err(r.corrupt(format!(
                "entry {id}: invalid name {:?}",
                OsStr::from_bytes(name)
            )));
        }
    }

    tree.dirs = r.vec(n_dirs as usize, "directories")?;
    let mut next_child = 1u64;
    for &d in &dir_nodes {
        let count = r.u32()?;
        let state = r.u8()?;
        let errno = r.i32()?;
        let state = match state {
            DIR_LISTED => DirState::Ready,
            DIR_FAILED => DirState::Failed,
            DIR_UNLISTED => DirState::Lazy,
            s => return Err(r.corrupt(format!("directory {d}: invalid state {s}"))),
        };
        if state != DirState::Ready && count != 0 {
            return Err(r.corrupt(format!("directory {d}: entries in an unlisted directory")));
        }
        let first = next_child;
        let end = first + u64::from(count);
        // Children after their directory and inside the tree: acyclic, one parent each.
        if count > 0 && (first <= u64::from(d) || end > n as u64) {
            return Err(r.corrupt(format!("directory {d}: entries out of order or range")));
        }
        for k in first..end {
            tree.nodes[k as usize].parent = d;
            if k > first && tree.name(k as NodeId - 1) >= tree.name(k as NodeId) {
                return Err(r.corrupt(format!("directory {d}: names not sorted and unique")));
            }
        }
        next_child = end;
        tree.dirs.push(Dir {
            node: d,
            first: first as u32,
            count,
            state,
            errno,
        });
        if state == DirState::Ready {
            tree.dirs_listed += 1;
        }
    }
    if next_child != n as u64 {
        return Err(r.corrupt("entries that belong to no directory"));
    }

    tree.links = r.vec(n_links as usize, "symlinks")?;
    let mut off = 0u64;
    for _ in 0..n_links {
        let len = r.u32()?;
        tree.links.push((off as u32, len));
        off += u64::from(len);
        if off > link_bytes {
            return Err(r.corrupt("link target lengths exceed their section"));
        }
    }
    if off != link_bytes {
        return Err(r.corrupt("link target lengths do not add up to their section"));
    }
    tree.link_bytes = r.bytes(link_bytes as usize, "link target bytes")?;
    for &(off, len) in &tree.links {
        let target = &tree.link_bytes[off as usize..(off + len) as usize];
        if target.is_empty() || target.contains(&0) {
            return Err(r.corrupt("an empty symlink target or one with a NUL byte"));
        }
    }
    tree.devs = r.vec(n_devs as usize, "devices")?;
    for _ in 0..n_devs {
        let rdev = r.u64()?;
        tree.devs.push(rdev);
    }

    let mut lens: Vec<usize> = r.vec(n_errors as usize, "errors")?;
    let mut sum = 0u64;
    for _ in 0..n_errors {
        let len = r.u32()?;
        sum += u64::from(len);
        if sum > error_bytes {
            return Err(r.corrupt("error lengths exceed their section"));
        }
        lens.push(len as usize);
    }
    if sum != error_bytes {
        return Err(r.corrupt("error lengths do not add up to their section"));
    }
    for len in lens {
        let text = r.bytes(len, "error bytes")?;
        tree.record_error(String::from_utf8_lossy(&text).into_owned());
    }
    // Errors beyond the first `MAX_ERRORS` were counted, not kept.
    tree.errors_total = errors_total.max(tree.errors.len() as u64);
    tree.errors.truncate(MAX_ERRORS);
    if r.pos + TRAILER_LEN as u64 != r.len {
        return Err(r.corrupt("unexpected bytes after the sections"));
    }
    tree.entries = n as u64;

    Ok(Inner {
        tree: RwLock::new(tree),
        queue: Mutex::new(Queue::default()),
        work: Condvar::new(),
        done: Condvar::new(),
        source: OnceLock::new(),
        opts: ScanOptions::default(),
        id,
        root,
        created,
        started: Instant::now(),
        requests: 0.into(),
        loaded_requests,
        unfinished: 0.into(),
        workers: 0.into(),
        complete: true.into(),
        broken: false.into(),
        cancel: false.into(),
        elapsed_ns: elapsed_ns.into(),
        relist: Mutex::new(()),
    })
}
