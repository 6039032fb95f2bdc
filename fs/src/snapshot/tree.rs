//! The compact in-memory tree: one fixed-size record per node, all names in one arena, children
//! as id ranges.
//!
//! A directory's entries are given consecutive ids when it is listed, in name order, so its
//! children are the range `first..first + count` — no per-directory child array, no per-node
//! heap allocation, and a lookup is a binary search over that range. Only a directory re-listed by
//! revalidation (whose kept names keep their ids and whose new names get new ones) holds an
//! explicit sorted id list, in [`Tree::relisted`].
//!
//! A [`Node`] is 60 bytes: the 64-bit fields are stored as two `u32` halves so the record has
//! 4-byte alignment and no padding; owners are interned as `(uid, gid)` pairs, and the rarely
//! used per-kind data (a directory's range, a symlink's target, a device's number) lives in side
//! tables reached through [`Node::aux`]. With ImageNet's ~20-byte names that is ~80 bytes per
//! file. The ctime (8 of those bytes) is kept because it is the part of a file's identity that
//! no user can set back (see [`stagefs_prefetch::Version`]).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use stagefs_prefetch::source::{FileKind, Meta};

use super::{NodeAttr, NodeId, SnapshotError};

/// Flag: the node's attributes are not known yet (its directory's stats are still running).
pub(crate) const PENDING: u8 = 1;
/// Flag: the node is in no listing and has no attributes (its stat failed, it vanished while
/// being listed, or revalidation found it gone).
pub(crate) const MISSING: u8 = 2;
/// [`Node::parent`] of the root.
pub(crate) const NO_PARENT: u32 = u32::MAX;
/// [`Node::aux`] of a node without side data.
pub(crate) const NO_AUX: u32 = u32::MAX;
/// The most nodes a tree holds: ids are `u32`, and `u32::MAX` is the "none" marker.
pub(crate) const MAX_NODES: usize = u32::MAX as usize - 1;
/// Errors kept with their text (the rest are only counted): enough to see the pattern, bounded
/// so a tree with a million unreadable entries cannot grow the daemon.
pub(crate) const MAX_ERRORS: usize = 1000;

/// A `u64` as two `u32` halves: keeps [`Node`] 4-byte aligned, hence unpadded.
#[derive(Clone, Copy, Default)]
struct U64([u32; 2]);

impl U64 {
    fn new(v: u64) -> U64 {
        U64([v as u32, (v >> 32) as u32])
    }
    fn get(self) -> u64 {
        u64::from(self.0[0]) | (u64::from(self.0[1]) << 32)
    }
}

/// One entry of the tree.
#[derive(Clone, Copy)]
pub(crate) struct Node {
    size: U64,
    mtime: U64,
    ctime: U64,
    ino: U64,
    /// The directory holding this node ([`NO_PARENT`] for the root).
    pub parent: u32,
    name_off: u32,
    nlink: u32,
    /// Index into the side table of the node's kind: [`Tree::dirs`], [`Tree::links`] or
    /// [`Tree::devs`]; [`NO_AUX`] for other kinds.
    pub aux: u32,
    owner: u32,
    name_len: u16,
    perm: u16,
    /// [`FileKind`] as its `repr(u8)`.
    pub kind: u8,
    /// [`PENDING`], [`MISSING`].
    pub flags: u8,
}

const _: () = assert!(std::mem::size_of::<Node>() == 60);

impl Node {
    /// A node with a name and no attributes yet.
    fn placeholder(parent: u32, name_off: u32, name_len: u16) -> Node {
        Node {
            size: U64::default(),
            mtime: U64::default(),
            ctime: U64::default(),
            ino: U64::default(),
            parent,
            name_off,
            nlink: 0,
            aux: NO_AUX,
            owner: 0,
            name_len,
            perm: 0,
            kind: FileKind::File as u8,
            flags: PENDING,
        }
    }

    /// A node read from a snapshot file (its parent is set once the directories are read).
    pub fn from_fields(f: &Fields, name_off: u32, name_len: u16, aux: u32) -> Node {
        Node {
            size: U64::new(f.size),
            mtime: U64::new(f.mtime_ns as u64),
            ctime: U64::new(f.ctime_ns as u64),
            ino: U64::new(f.ino),
            parent: NO_PARENT,
            name_off,
            nlink: f.nlink,
            aux,
            owner: f.owner,
            name_len,
            perm: f.perm,
            kind: f.kind as u8,
            flags: 0,
        }
    }

    /// The stored fields of the node (for writing it to a file).
    pub fn fields(&self) -> Fields {
        Fields {
            kind: self.kind(),
            perm: self.perm,
            owner: self.owner,
            nlink: self.nlink,
            size: self.size.get(),
            mtime_ns: self.mtime.get() as i64,
            ctime_ns: self.ctime.get() as i64,
            ino: self.ino.get(),
        }
    }

    /// Whether the node is listed and has attributes.
    pub fn visible(&self) -> bool {
        self.flags & (PENDING | MISSING) == 0
    }

    /// The node's kind.
    pub fn kind(&self) -> FileKind {
        FileKind::from_u8(self.kind).unwrap_or(FileKind::File)
    }
}

/// A node's attributes as stored (owner as an index into [`Tree::owners`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fields {
    /// Type.
    pub kind: FileKind,
    /// Permission bits.
    pub perm: u16,
    /// Index into [`Tree::owners`].
    pub owner: u32,
    /// Hard links.
    pub nlink: u32,
    /// Size.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// Status change time, nanoseconds since the epoch.
    pub ctime_ns: i64,
    /// Inode number on the source.
    pub ino: u64,
}

/// Where a directory's listing stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DirState {
    /// Waiting in the scan pool's queue.
    Queued,
    /// Not listed and not queued: listed on the caller's thread when first needed (directories
    /// found by revalidation, or saved before they were listed).
    Lazy,
    /// Names read, entries being statted (see [`Tree::progress`]), or the names being read.
    Listing,
    /// Complete.
    Ready,
    /// The listing failed; the directory serves no entries.
    Failed,
}

/// A directory's side record.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dir {
    /// The directory's node.
    pub node: NodeId,
    /// Its first child (children are `first..first + count`, unless in [`Tree::relisted`]).
    pub first: u32,
    /// Number of children.
    pub count: u32,
    /// Listing state.
    pub state: DirState,
    /// For [`DirState::Failed`]: the errno of the failure (0 if none).
    pub errno: i32,
}

/// The stat progress of a directory whose names are read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Progress {
    /// Next chunk to hand out.
    pub next: u32,
    /// Number of chunks.
    pub chunks: u32,
    /// Chunks not finished yet.
    pub left: u32,
    /// Entries per chunk.
    pub chunk_len: u32,
    /// Listed on callers' threads rather than by the scan pool.
    pub inline: bool,
}

/// A directory's children: a range of ids, or (after revalidation) an explicit list.
#[derive(Clone, Copy)]
pub(crate) enum Kids<'a> {
    /// `first..first + count`.
    Range(u32, u32),
    /// Sorted by name.
    List(&'a [NodeId]),
}

impl Kids<'_> {
    /// Number of children (including ones marked missing).
    pub fn len(&self) -> usize {
        match self {
            Kids::Range(_, n) => *n as usize,
            Kids::List(l) => l.len(),
        }
    }

    /// The `i`-th child in name order.
    pub fn get(&self, i: usize) -> NodeId {
        match self {
            Kids::Range(first, _) => first + i as u32,
            Kids::List(l) => l[i],
        }
    }
}

/// The tree and its side tables. Guarded by the snapshot's `RwLock`.
pub(crate) struct Tree {
    /// Nodes by id.
    pub nodes: Vec<Node>,
    /// All names, each `name_len` bytes at `name_off`.
    pub names: Vec<u8>,
    /// Directories.
    pub dirs: Vec<Dir>,
    /// Interned `(uid, gid)` pairs.
    pub owners: Vec<(u32, u32)>,
    owner_ids: HashMap<(u32, u32), u32>,
    /// Symlink targets: `(offset, len)` into [`Tree::link_bytes`].
    pub links: Vec<(u32, u32)>,
    /// All symlink targets.
    pub link_bytes: Vec<u8>,
    /// Device numbers of device nodes.
    pub devs: Vec<u64>,
    /// Stat progress of directories being listed, by directory index.
    pub progress: HashMap<u32, Progress>,
    /// Explicit children of directories re-listed by revalidation, by directory index.
    pub relisted: HashMap<u32, Vec<NodeId>>,
    /// When each node was last checked against the source, in tenths of a second after the
    /// snapshot's creation; empty until the first revalidation (missing entries read as 0).
    pub checked: Vec<u32>,
    /// Skipped entries and directories, with paths (at most [`MAX_ERRORS`]).
    pub errors: Vec<String>,
    /// Number of errors, including those not kept.
    pub errors_total: u64,
    /// Nodes with attributes.
    pub entries: u64,
    /// Directories listed.
    pub dirs_listed: u64,
}

impl Tree {
    /// An empty tree (no root yet).
    pub fn empty() -> Tree {
        Tree {
            nodes: Vec::new(),
            names: Vec::new(),
            dirs: Vec::new(),
            owners: Vec::new(),
            owner_ids: HashMap::new(),
            links: Vec::new(),
            link_bytes: Vec::new(),
            devs: Vec::new(),
            progress: HashMap::new(),
            relisted: HashMap::new(),
            checked: Vec::new(),
            errors: Vec::new(),
            errors_total: 0,
            entries: 0,
            dirs_listed: 0,
        }
    }

    /// A tree holding only the root, a directory with attributes `meta`, in `state`.
    pub fn with_root(meta: &Meta, state: DirState) -> Tree {
        let mut t = Tree::empty();
        t.nodes.push(Node::placeholder(NO_PARENT, 0, 0));
        // The root is a directory (checked by the caller), so this creates its record.
        t.fill(0, meta, None, state);
        t
    }

    /// Appends a node without attributes named `name` in directory node `parent`.
    pub fn push_placeholder(
        &mut self,
        parent: NodeId,
        name: &[u8],
    ) -> Result<NodeId, SnapshotError> {
        let id = self.nodes.len();
        if id >= MAX_NODES {
            return Err(SnapshotError::TooLarge { what: "entries" });
        }
        let off = u32::try_from(self.names.len())
            .ok()
            .filter(|o| o.checked_add(name.len() as u32).is_some())
            .ok_or(SnapshotError::TooLarge {
                what: "total length of names",
            })?;
        let len = u16::try_from(name.len()).map_err(|_| SnapshotError::TooLarge {
            what: "name length",
        })?;
        self.names.extend_from_slice(name);
        self.nodes.push(Node::placeholder(parent, off, len));
        Ok(id as NodeId)
    }

    /// Interns an owner pair.
    pub fn intern_owner(&mut self, uid: u32, gid: u32) -> u32 {
        if let Some(&i) = self.owner_ids.get(&(uid, gid)) {
            return i;
        }
        let i = self.owners.len() as u32;
        self.owners.push((uid, gid));
        self.owner_ids.insert((uid, gid), i);
        i
    }

    /// Rebuilds the owner index after [`Tree::owners`] was filled directly (loading).
    pub fn index_owners(&mut self) {
        self.owner_ids = self
            .owners
            .iter()
            .enumerate()
            .map(|(i, &o)| (o, i as u32))
            .rev()
            .collect();
    }

    /// Sets node `id`'s attributes from `meta` (and its target, for a symlink), clearing
    /// [`PENDING`]. A node that becomes a directory gets a directory record in `dir_state`;
    /// returns its index if one was created.
    pub fn fill(
        &mut self,
        id: NodeId,
        meta: &Meta,
        link: Option<&[u8]>,
        dir_state: DirState,
    ) -> Option<u32> {
        let owner = self.intern_owner(meta.uid, meta.gid);
        let kind = meta.kind as u8;
        let old = self.nodes[id as usize];
        // Revalidation of a node that kept its kind keeps its side record.
        let had_aux = old.kind == kind && old.aux != NO_AUX && old.flags & PENDING == 0;
        let mut new_dir = None;
        let aux = if had_aux {
            match meta.kind {
                FileKind::Symlink => link.map_or(old.aux, |t| self.push_link(t)),
                FileKind::CharDevice | FileKind::BlockDevice => {
                    if let Some(d) = self.devs.get_mut(old.aux as usize) {
                        *d = meta.rdev;
                    }
                    old.aux
                }
                _ => old.aux,
            }
        } else {
            match meta.kind {
                FileKind::Dir => {
                    let d = self.dirs.len() as u32;
                    self.dirs.push(Dir {
                        node: id,
                        first: 0,
                        count: 0,
                        state: dir_state,
                        errno: 0,
                    });
                    new_dir = Some(d);
                    d
                }
                FileKind::Symlink => link.map_or(NO_AUX, |t| self.push_link(t)),
                FileKind::CharDevice | FileKind::BlockDevice => {
                    self.devs.push(meta.rdev);
                    self.devs.len() as u32 - 1
                }
                _ => NO_AUX,
            }
        };
        let n = &mut self.nodes[id as usize];
        if n.flags & PENDING != 0 || n.flags & MISSING != 0 {
            self.entries += 1;
        }
        n.size = U64::new(meta.size);
        n.mtime = U64::new(meta.mtime_ns as u64);
        n.ctime = U64::new(meta.ctime_ns as u64);
        n.ino = U64::new(meta.ino);
        n.nlink = meta.nlink;
        n.aux = aux;
        n.owner = owner;
        n.perm = meta.perm & 0o7777;
        n.kind = kind;
        n.flags = 0;
        new_dir
    }

    fn push_link(&mut self, target: &[u8]) -> u32 {
        // A target that would overflow the 32-bit arena is stored empty rather than failing the
        // listing: 4 GiB of symlink targets is far beyond any dataset.
        let off = u32::try_from(self.link_bytes.len()).unwrap_or(u32::MAX);
        let len = u32::try_from(target.len()).unwrap_or(0);
        let (off, len) = if off.checked_add(len).is_some() {
            self.link_bytes.extend_from_slice(target);
            (off, len)
        } else {
            (0, 0)
        };
        self.links.push((off, len));
        self.links.len() as u32 - 1
    }

    /// Marks node `id` missing (in no listing, no attributes).
    pub fn mark_missing(&mut self, id: NodeId) {
        if let Some(n) = self.nodes.get_mut(id as usize) {
            if n.flags == 0 {
                self.entries = self.entries.saturating_sub(1);
            }
            n.flags = MISSING;
        }
    }

    /// Records that node `id` was checked against the source at `now` (see [`Tree::checked`]).
    pub fn set_checked(&mut self, id: NodeId, now: u32) {
        if self.checked.len() < self.nodes.len() {
            self.checked.resize(self.nodes.len(), 0);
        }
        if let Some(c) = self.checked.get_mut(id as usize) {
            *c = now;
        }
    }

    /// Marks directory `d` as failed to list with `e` (its listings answer that errno) and
    /// records it: the scan and the re-listing of `--revalidate` skip it alike.
    pub fn dir_failed(&mut self, d: u32, e: &stagefs_prefetch::SourceError) {
        if let Some(dir) = self.dirs.get_mut(d as usize) {
            dir.state = DirState::Failed;
            dir.errno = e.errno();
        }
        self.record_error(format!("{e}; directory skipped"));
    }

    /// Records a skipped entry or directory.
    pub fn record_error(&mut self, msg: String) {
        self.errors_total += 1;
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(msg);
        }
    }

    /// The node, if `id` is in range.
    pub fn node(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(id as usize)
    }

    /// The name of node `id` (empty for the root).
    pub fn name(&self, id: NodeId) -> &[u8] {
        let n = &self.nodes[id as usize];
        let off = n.name_off as usize;
        &self.names[off..off + n.name_len as usize]
    }

    /// The attributes of a visible node.
    pub fn attr(&self, id: NodeId) -> Option<NodeAttr> {
        let n = self.node(id)?;
        if !n.visible() {
            return None;
        }
        let kind = n.kind();
        let (uid, gid) = self.owners.get(n.owner as usize).copied().unwrap_or((0, 0));
        let rdev = match kind {
            FileKind::CharDevice | FileKind::BlockDevice => {
                self.devs.get(n.aux as usize).copied().unwrap_or(0)
            }
            _ => 0,
        };
        Some(NodeAttr {
            kind,
            perm: n.perm,
            uid,
            gid,
            size: n.size.get(),
            mtime_ns: n.mtime.get() as i64,
            ctime_ns: n.ctime.get() as i64,
            ino: n.ino.get(),
            nlink: n.nlink,
            rdev,
        })
    }

    /// The target of symlink node `id`.
    pub fn link(&self, id: NodeId) -> Option<&[u8]> {
        let n = self.node(id)?;
        if !n.visible() || n.kind() != FileKind::Symlink {
            return None;
        }
        let &(off, len) = self.links.get(n.aux as usize)?;
        self.link_bytes
            .get(off as usize..off as usize + len as usize)
    }

    /// The directory record index of directory node `id`.
    pub fn dir_index(&self, id: NodeId) -> Option<u32> {
        let n = self.node(id)?;
        (n.kind() == FileKind::Dir && (n.aux as usize) < self.dirs.len()).then_some(n.aux)
    }

    /// The children of directory record `d`, in name order.
    pub fn kids(&self, d: u32) -> Kids<'_> {
        match self.relisted.get(&d) {
            Some(l) => Kids::List(l),
            None => {
                let dir = &self.dirs[d as usize];
                Kids::Range(dir.first, dir.count)
            }
        }
    }

    /// The visible child of directory record `d` named `name`.
    pub fn find(&self, d: u32, name: &[u8]) -> Option<NodeId> {
        let kids = self.kids(d);
        let (mut lo, mut hi) = (0, kids.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let id = kids.get(mid);
            match self.name(id).cmp(name) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => {
                    return self.nodes[id as usize].visible().then_some(id);
                }
            }
        }
        None
    }

    /// The path of node `id` relative to the root (`""` for the root).
    pub fn path(&self, id: NodeId) -> PathBuf {
        let mut parts = Vec::new();
        let mut cur = id;
        // Bounded by the node count: the tree is acyclic by construction (and checked on load),
        // but a walk up must never loop.
        for _ in 0..self.nodes.len() {
            let Some(n) = self.node(cur) else { break };
            if n.parent == NO_PARENT {
                break;
            }
            parts.push(self.name(cur));
            cur = n.parent;
        }
        let mut p = PathBuf::with_capacity(parts.iter().map(|s| s.len() + 1).sum());
        for part in parts.iter().rev() {
            p.push(OsStr::from_bytes(part));
        }
        p
    }

    /// Allocated bytes, by capacity.
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        // A hashbrown entry costs its key and value plus one control byte.
        fn map<K, V>(m: &HashMap<K, V>) -> usize {
            m.capacity() * (size_of::<(K, V)>() + 1)
        }
        self.nodes.capacity() * size_of::<Node>()
            + self.names.capacity()
            + self.dirs.capacity() * size_of::<Dir>()
            + self.owners.capacity() * size_of::<(u32, u32)>()
            + map(&self.owner_ids)
            + self.links.capacity() * size_of::<(u32, u32)>()
            + self.link_bytes.capacity()
            + self.devs.capacity() * size_of::<u64>()
            + map(&self.progress)
            + map(&self.relisted)
            + self
                .relisted
                .values()
                .map(|l| l.capacity() * size_of::<NodeId>())
                .sum::<usize>()
            + self.checked.capacity() * size_of::<u32>()
            + self.errors.iter().map(|e| e.capacity()).sum::<usize>()
            + self.errors.capacity() * size_of::<String>()
    }

    /// Returns unused capacity (after a scan completes: growth leaves up to half unused).
    pub fn shrink(&mut self) {
        self.nodes.shrink_to_fit();
        self.names.shrink_to_fit();
        self.dirs.shrink_to_fit();
        self.links.shrink_to_fit();
        self.link_bytes.shrink_to_fit();
        self.devs.shrink_to_fit();
        self.progress.shrink_to_fit();
    }
}

/// Whether `name` may be an entry of a directory: non-empty, at most `u16::MAX` bytes, no `/`
/// or NUL, not `.` or `..`. Every name in a snapshot passes this, so every path built from them
/// stays beneath the source root.
pub(crate) fn valid_name(name: &[u8]) -> bool {
    !name.is_empty()
        && name.len() <= u16::MAX as usize
        && name != b"."
        && name != b".."
        && !name.contains(&b'/')
        && !name.contains(&0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(kind: FileKind, size: u64) -> Meta {
        Meta {
            kind,
            perm: 0o644,
            uid: 1,
            gid: 2,
            size,
            mtime_ns: -5,
            ctime_ns: i64::MIN + 3,
            ino: u64::MAX - 1,
            nlink: 1,
            rdev: 7,
        }
    }

    #[test]
    fn node_fields_round_trip_including_extremes() {
        let mut t = Tree::with_root(&meta(FileKind::Dir, 4096), DirState::Ready);
        let a = t.push_placeholder(0, b"a").unwrap();
        assert!(t.attr(a).is_none(), "a pending node has no attributes");
        t.fill(a, &meta(FileKind::File, u64::MAX), None, DirState::Queued);
        let got = t.attr(a).unwrap();
        assert_eq!(
            (got.size, got.mtime_ns, got.ctime_ns, got.ino),
            (u64::MAX, -5, i64::MIN + 3, u64::MAX - 1)
        );
        assert_eq!((got.uid, got.gid, got.perm), (1, 2, 0o644));
        let dev = t.push_placeholder(0, b"dev").unwrap();
        t.fill(dev, &meta(FileKind::CharDevice, 0), None, DirState::Queued);
        assert_eq!(t.attr(dev).unwrap().rdev, 7);
        assert_eq!(t.attr(a).unwrap().rdev, 0);
        assert_eq!(t.owners.len(), 1, "owners are interned");
    }

    #[test]
    fn names_that_could_leave_the_directory_are_invalid() {
        for bad in [&b""[..], b".", b"..", b"a/b", b"/", b"a\0b"] {
            assert!(!valid_name(bad), "{bad:?}");
        }
        assert!(valid_name(b"..."));
        assert!(valid_name("ünïcode".as_bytes()));
    }
}
