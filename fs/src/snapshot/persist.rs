//! The snapshot file: `stagefs index` output, and the copy a mount keeps in its cache.
//!
//! Little-endian, one fixed header then packed sections, then a CRC-32 of everything before it:
//!
//! ```text
//! header (128 bytes)  magic "STGFSIDX", format version, header length, snapshot id,
//!                     creation time, the length of every section, scan statistics
//! root                the source root's path (bytes)
//! owners              (uid u32, gid u32) per interned owner
//! nodes               38 bytes per node, breadth first:
//!                     kind u8, flags u8 (0), perm u16, name length u16, owner u32,
//!                     nlink u32, size u64, mtime ns i64, inode u64
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
//! order, and there are no stored offsets or ids to trust. Loading still trusts nothing: the
//! section lengths must add up to the file's exact size before anything is allocated (and each
//! allocation is fallible), every kind, flag, owner index and name is checked, each directory's
//! children must be later nodes (so the tree is acyclic and every node has one parent), and
//! names must be strictly increasing within a directory. The checksum catches damage; the checks
//! make a hostile file that carries a valid checksum an error rather than a panic or an
//! out-of-memory abort.
//!
//! The file is written to a new `0600` temporary with a random name (`O_EXCL`) in the target's
//! directory, fsynced and renamed over the target, and the directory fsynced: a reader sees the
//! old file or the new one, never a torn one.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, UNIX_EPOCH};

use rustix::fs::{Mode, OFlags};
use stagefs_prefetch::cachedir::{random_u64, CacheDir, FILE_MODE};
use stagefs_prefetch::source::FileKind;

use super::tree::{valid_name, Dir, DirState, Fields, Node, Tree, MAX_ERRORS, MAX_NODES, NO_AUX};
use super::{Inner, NodeId, Queue, ScanOptions, Snapshot, SnapshotError};

/// First bytes of every snapshot file.
pub(crate) const MAGIC: [u8; 8] = *b"STGFSIDX";
/// The format version this code writes and reads.
pub(crate) const VERSION: u32 = 1;
/// Size of the header.
const HEADER_LEN: usize = 128;
/// Size of a node record.
const NODE_LEN: u64 = 38;
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
    let io_err = |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    };
    // O_NONBLOCK: a FIFO given as the index must not hang the mount.
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    )
    .map_err(|e| io_err(e.into()))?;
    let file = File::from(fd);
    let bytes = read_all(&file).map_err(io_err)?;
    parse(&bytes, path)
}

/// Loads file `name` of the private cache directory.
pub(crate) fn load_from(dir: &CacheDir, name: &str) -> Result<Arc<Snapshot>, SnapshotError> {
    let path = dir.path().join(name);
    let io_err = |source| SnapshotError::Io {
        path: path.clone(),
        source,
    };
    let file = dir.open_read(name).map_err(io_err)?;
    let bytes = read_all(&file).map_err(io_err)?;
    parse(&bytes, &path)
}

/// The whole of a regular file, allocated fallibly.
fn read_all(file: &File) -> io::Result<Vec<u8>> {
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let len = usize::try_from(meta.len())
        .map_err(|_| io::Error::new(io::ErrorKind::OutOfMemory, "too large to load"))?;
    let mut buf = Vec::new();
    buf.try_reserve_exact(len).map_err(|_| {
        io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!("{len} bytes do not fit in memory"),
        )
    })?;
    // At most `len` bytes: a file growing while read cannot grow the buffer.
    file.take(len as u64).read_to_end(&mut buf)?;
    if buf.len() != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the file shrank while being read",
        ));
    }
    Ok(buf)
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
    let (file, temp) = create_temp(&dir).map_err(io_err)?;
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

/// A new `0600` file with an unpredictable name in `dir` (`O_EXCL`, never through a symlink).
fn create_temp(dir: &std::os::fd::OwnedFd) -> io::Result<(File, std::ffi::OsString)> {
    for _ in 0..16 {
        let name = std::ffi::OsString::from(format!(".stagefs-index.{:016x}.tmp", random_u64()?));
        match rustix::fs::openat(
            dir,
            &name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(FILE_MODE),
        ) {
            Ok(fd) => return Ok((File::from(fd), name)),
            Err(rustix::io::Errno::EXIST) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        "no free temporary name after 16 tries",
    ))
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

/// A cursor over the file's bytes; running out is corruption, never a panic.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn corrupt(&self, reason: impl Into<String>) -> SnapshotError {
        SnapshotError::Corrupt {
            path: self.path.to_path_buf(),
            reason: reason.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| self.corrupt(format!("truncated at byte {}", self.pos)))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], SnapshotError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, SnapshotError> {
        Ok(u16::from_le_bytes(self.array()?))
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
}

/// A vector with room for `n` elements, or a corruption error (never an abort).
fn vec_with<T>(n: usize, c: &Cursor<'_>, what: &str) -> Result<Vec<T>, SnapshotError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| c.corrupt(format!("{n} {what} do not fit in memory")))?;
    Ok(v)
}

/// Parses and validates a snapshot file's bytes.
pub(crate) fn parse(bytes: &[u8], path: &Path) -> Result<Arc<Snapshot>, SnapshotError> {
    let started = Instant::now();
    let c = &mut Cursor {
        bytes,
        pos: 0,
        path,
    };
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(SnapshotError::WrongFormat {
            path: path.to_path_buf(),
            reason: "not a stagefs index (written by `stagefs index`)".into(),
        });
    }
    if bytes.len() < HEADER_LEN + TRAILER_LEN {
        return Err(c.corrupt(format!("truncated: {} bytes", bytes.len())));
    }
    c.take(MAGIC.len())?;
    let version = c.u32()?;
    if version != VERSION {
        return Err(SnapshotError::WrongFormat {
            path: path.to_path_buf(),
            reason: format!(
                "stagefs index format version {version}, but this stagefs reads version \
                 {VERSION}; write it again with this stagefs's `stagefs index`"
            ),
        });
    }
    let body_end = bytes.len() - TRAILER_LEN;
    let mut stored = [0u8; TRAILER_LEN];
    stored.copy_from_slice(&bytes[body_end..]);
    if crc32fast::hash(&bytes[..body_end]) != u32::from_le_bytes(stored) {
        return Err(c.corrupt("checksum mismatch (damaged or truncated)"));
    }
    let header_len = c.u32()?;
    let id = c.u128()?;
    let created_secs = c.i64()?;
    let created_nanos = c.u32()?;
    let root_len = c.u32()?;
    let n_nodes = c.u32()?;
    let n_dirs = c.u32()?;
    let names_len = c.u64()?;
    let n_links = c.u32()?;
    let n_devs = c.u32()?;
    let link_bytes = c.u64()?;
    let n_owners = c.u32()?;
    let n_errors = c.u32()?;
    let errors_total = c.u64()?;
    let error_bytes = c.u64()?;
    let loaded_requests = c.u64()?;
    let elapsed_ns = c.u64()?;
    let reserved = c.u64()?;
    if header_len as usize != HEADER_LEN || reserved != 0 {
        return Err(c.corrupt("unknown header layout"));
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
    if expected != Some(bytes.len() as u64) {
        return Err(c.corrupt(format!(
            "section lengths do not add up to the file's size ({} bytes)",
            bytes.len()
        )));
    }
    if n_nodes == 0 || n_nodes as usize > MAX_NODES {
        return Err(c.corrupt(format!("{n_nodes} entries")));
    }
    if names_len > u64::from(u32::MAX) || link_bytes > u64::from(u32::MAX) {
        return Err(c.corrupt("names or link targets longer than 4 GiB"));
    }
    if created_secs < 0 || created_nanos >= 1_000_000_000 || errors_total < u64::from(n_errors) {
        return Err(c.corrupt("invalid header values"));
    }
    let created = UNIX_EPOCH + Duration::new(created_secs as u64, created_nanos);

    let root_bytes = c.take(root_len as usize)?;
    if root_bytes.first() != Some(&b'/') || root_bytes.contains(&0) {
        return Err(c.corrupt("the recorded source root is not an absolute path"));
    }
    let root = PathBuf::from(OsStr::from_bytes(root_bytes));

    let mut tree = Tree::empty();
    tree.owners = vec_with(n_owners as usize, c, "owners")?;
    for _ in 0..n_owners {
        let uid = c.u32()?;
        let gid = c.u32()?;
        tree.owners.push((uid, gid));
    }
    tree.index_owners();

    let n = n_nodes as usize;
    let mut nodes: Vec<Node> = vec_with(n, c, "entries")?;
    let mut dir_nodes: Vec<NodeId> = vec_with(n_dirs as usize, c, "directories")?;
    let (mut links, mut devs) = (0u32, 0u32);
    let mut name_off = 0u64;
    for i in 0..n {
        let kind = c.u8()?;
        let kind = FileKind::from_u8(kind)
            .ok_or_else(|| c.corrupt(format!("entry {i}: invalid type {kind}")))?;
        let flags = c.u8()?;
        let perm = c.u16()?;
        let name_len = c.u16()?;
        let owner = c.u32()?;
        let f = Fields {
            kind,
            perm,
            owner,
            nlink: c.u32()?,
            size: c.u64()?,
            mtime_ns: c.i64()?,
            ino: c.u64()?,
        };
        if flags != 0 || perm > 0o7777 || owner >= n_owners {
            return Err(c.corrupt(format!("entry {i}: invalid flags, mode or owner")));
        }
        if (i == 0) != (name_len == 0) || (i == 0 && kind != FileKind::Dir) {
            return Err(c.corrupt(format!("entry {i}: invalid name length or root type")));
        }
        let aux = match kind {
            FileKind::Dir => {
                if dir_nodes.len() == n_dirs as usize {
                    return Err(c.corrupt("more directories than the header says"));
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
        // Bounded by `names_len` (checked below), itself at most `u32::MAX`.
        nodes.push(Node::from_fields(&f, name_off as u32, name_len, aux));
        name_off += u64::from(name_len);
    }
    if name_off != names_len {
        return Err(c.corrupt("name lengths do not add up to the names section"));
    }
    if dir_nodes.len() != n_dirs as usize || links != n_links || devs != n_devs {
        return Err(c.corrupt("entry types do not match the header's counts"));
    }
    tree.names = vec_with(names_len as usize, c, "name bytes")?;
    tree.names.extend_from_slice(c.take(names_len as usize)?);
    tree.nodes = nodes;
    for id in 1..n as NodeId {
        if !valid_name(tree.name(id)) {
            return Err(c.corrupt(format!(
                "entry {id}: invalid name {:?}",
                OsStr::from_bytes(tree.name(id))
            )));
        }
    }

    tree.dirs = vec_with(n_dirs as usize, c, "directories")?;
    let mut next_child = 1u64;
    for &d in &dir_nodes {
        let count = c.u32()?;
        let state = c.u8()?;
        let errno = c.i32()?;
        let state = match state {
            DIR_LISTED => DirState::Ready,
            DIR_FAILED => DirState::Failed,
            DIR_UNLISTED => DirState::Lazy,
            s => return Err(c.corrupt(format!("directory {d}: invalid state {s}"))),
        };
        if state != DirState::Ready && count != 0 {
            return Err(c.corrupt(format!("directory {d}: entries in an unlisted directory")));
        }
        let first = next_child;
        let end = first + u64::from(count);
        // Children after their directory and inside the tree: acyclic, one parent each.
        if count > 0 && (first <= u64::from(d) || end > n as u64) {
            return Err(c.corrupt(format!("directory {d}: entries out of order or range")));
        }
        for k in first..end {
            tree.nodes[k as usize].parent = d;
            if k > first && tree.name(k as NodeId - 1) >= tree.name(k as NodeId) {
                return Err(c.corrupt(format!("directory {d}: names not sorted and unique")));
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
        return Err(c.corrupt("entries that belong to no directory"));
    }

    tree.links = vec_with(n_links as usize, c, "symlinks")?;
    let mut off = 0u64;
    for _ in 0..n_links {
        let len = c.u32()?;
        tree.links.push((off as u32, len));
        off += u64::from(len);
        if off > link_bytes {
            return Err(c.corrupt("link target lengths exceed their section"));
        }
    }
    if off != link_bytes {
        return Err(c.corrupt("link target lengths do not add up to their section"));
    }
    tree.link_bytes = vec_with(link_bytes as usize, c, "link target bytes")?;
    tree.link_bytes
        .extend_from_slice(c.take(link_bytes as usize)?);
    for &(off, len) in &tree.links {
        let target = &tree.link_bytes[off as usize..(off + len) as usize];
        if target.is_empty() || target.contains(&0) {
            return Err(c.corrupt("an empty symlink target or one with a NUL byte"));
        }
    }
    tree.devs = vec_with(n_devs as usize, c, "devices")?;
    for _ in 0..n_devs {
        let rdev = c.u64()?;
        tree.devs.push(rdev);
    }

    let mut lens = vec_with(n_errors as usize, c, "errors")?;
    for _ in 0..n_errors {
        lens.push(c.u32()? as usize);
    }
    for len in lens {
        let text = String::from_utf8_lossy(c.take(len)?).into_owned();
        tree.record_error(text);
    }
    // Errors beyond the first `MAX_ERRORS` were counted, not kept.
    tree.errors_total = errors_total.max(tree.errors.len() as u64);
    tree.errors.truncate(MAX_ERRORS);
    if c.pos != body_end {
        return Err(c.corrupt("unexpected bytes after the sections"));
    }
    tree.entries = n as u64;
    tracing::debug!(
        "loaded {} entries from {} in {:?}",
        n,
        path.display(),
        started.elapsed()
    );

    let inner = Arc::new(Inner {
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
    });
    Ok(Arc::new(Snapshot { inner }))
}
