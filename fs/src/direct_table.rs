//! The mount's direct table ([`stagefs_protocol::table`]): the daemon's list of the copies a
//! reader may open itself, kept in step with what the cache trusts.
//!
//! **When.** Made once the snapshot is complete (it is sized from the tree: one slot per
//! regular file and the bytes of their paths), before the previous mount's copies are checked,
//! so every copy trusted from then on is listed. Copies trusted before it exists (a demand read
//! during the listing) are listed when it is made ([`DirectTable::make`]). Its `complete` flag
//! is set once the remount's check of the cached copies is done ([`DirectTable::complete`]);
//! until then a reader that does not find a file asks over the socket.
//!
//! **What.** The cache's [`TrustEvent`]s: a trusted small copy is listed [`State::Open`] (the
//! reader opens it itself: it is evicted whole, by unlinking, so no pin is needed), a trusted
//! large one [`State::Ask`] (the reader asks for a pinned descriptor, as eviction punches its
//! blocks one by one), and a copy that stops being trusted [`State::Gone`]. Nothing is listed
//! under `--revalidate` (every read must reach the daemon there).
//!
//! **Handed out** over the control socket (`direct_table`): the table's sealed memory file, the
//! readers' counters and an `O_PATH` descriptor of the cache's `files/` directory.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use stagefs_prefetch::locks::lock;
use stagefs_prefetch::store::{TrustEvent, Trusted};
use stagefs_prefetch::{CacheStore, FileKind};
use stagefs_protocol::table::{
    Copy, SharedCounters, Shown, State, TableWriter, FLAG_CLOSED, FLAG_COMPLETE,
};
use tracing::{debug, info, warn};

use crate::snapshot::{NodeId, Snapshot};

/// No slot.
const NONE: u32 = u32::MAX;

/// The table once made.
struct Made {
    writer: TableWriter,
    counters: SharedCounters,
    dir: OwnedFd,
    /// The slot of each node's path (by node id), [`NONE`] if unlisted.
    slots: Vec<AtomicU32>,
}

/// The mount's direct table (see the module docs).
#[derive(Default)]
pub struct DirectTable {
    made: Mutex<Option<Made>>,
}

impl DirectTable {
    /// Makes the table for `snapshot` (complete), copies in `store`'s `files/` directory, and
    /// lists the copies trusted already. A failure (no memory file, say) leaves the mount
    /// without a table: readers then ask over the socket for every open.
    pub fn make(&self, snapshot: &Arc<Snapshot>, store: &CacheStore) {
        let (mut files, mut arena) = (0u64, 0u64);
        // Path lengths by directory, so each file's costs one lookup.
        let mut dir_len: std::collections::HashMap<NodeId, u64> = Default::default();
        snapshot.walk(|id, attr| {
            let own = snapshot.name(id).map_or(0, |n| n.len() as u64);
            let parent = snapshot.parent(id);
            let base = parent.and_then(|p| dir_len.get(&p).copied()).unwrap_or(0);
            // The root's path is empty; a child of it has no leading separator.
            let len = if parent.is_none() {
                0
            } else if base == 0 {
                own
            } else {
                base + 1 + own
            };
            match attr.kind {
                FileKind::Dir => {
                    dir_len.insert(id, len);
                }
                FileKind::File if attr.size > 0 => {
                    files += 1;
                    arena += len;
                }
                _ => {}
            }
        });
        drop(dir_len);
        let dir = match store.files_dir() {
            Ok(d) => d,
            Err(e) => {
                warn!(error = %e, "no direct table: cannot open the cache's files directory");
                return;
            }
        };
        let dev = rustix::fs::fstat(&dir).map_or(0, |st| st.st_dev);
        let made = TableWriter::create(files, arena, dev).and_then(|writer| {
            Ok(Made {
                writer,
                counters: SharedCounters::create()?,
                dir,
                slots: (0..snapshot.len()).map(|_| AtomicU32::new(NONE)).collect(),
            })
        });
        match made {
            Ok(m) => {
                info!(files, arena, "direct table made");
                *lock(&self.made) = Some(m);
            }
            Err(e) => {
                warn!(error = %e, "no direct table: reads ask over the control socket");
                return;
            }
        }
        for (id, t) in store.trusted_all() {
            self.on_event(snapshot, &TrustEvent::Trusted(id, t));
        }
    }

    /// Applies one of the cache's trust events.
    pub fn on_event(&self, snapshot: &Snapshot, ev: &TrustEvent) {
        let mut made = lock(&self.made);
        let Some(m) = made.as_mut() else { return };
        match *ev {
            TrustEvent::Trusted(_, t) => {
                let Some(slot) = m.slots.get(t.owner as usize) else {
                    return;
                };
                let (Some(path), Some(a)) = (snapshot.path(t.owner), snapshot.attr(t.owner)) else {
                    return;
                };
                let state = if t.whole { State::Open } else { State::Ask };
                let copy = copy_of(&t);
                // What `stat` of the path shows on the mount (fscore's attributes).
                let shown = Shown {
                    ino: crate::inode::source_ino(t.owner),
                    mtime_ns: a.mtime_ns,
                    perm: u32::from(a.perm),
                    nlink: a.nlink,
                    uid: a.uid,
                    gid: a.gid,
                };
                match m
                    .writer
                    .put(path.as_os_str().as_bytes(), state, copy, shown)
                {
                    Some(i) => slot.store(i as u32, Relaxed),
                    None => debug!(path = %path.display(), "not listed in the direct table"),
                }
            }
            TrustEvent::Untrusted(_, owner) => {
                let Some(slot) = m.slots.get(owner as usize) else {
                    return;
                };
                let i = slot.swap(NONE, Relaxed);
                if i != NONE {
                    m.writer.remove(u64::from(i));
                }
            }
        }
    }

    /// Marks the table complete: everything the cache trusts is listed, so a reader that does
    /// not find a path reads it through the mount without asking.
    pub fn complete(&self) {
        if let Some(m) = lock(&self.made).as_mut() {
            m.writer.set_flag(FLAG_COMPLETE, true);
            debug!(listed = m.writer.listed(), "direct table complete");
        }
    }

    /// Marks the table closed (the mount ends): readers ignore it from then on.
    pub fn close(&self) {
        if let Some(m) = lock(&self.made).as_mut() {
            m.writer.set_flag(FLAG_CLOSED, true);
        }
    }

    /// Runs `f` with the descriptors a reader gets (table, counters, `files/` directory), if
    /// the table is made.
    pub fn with_fds<R>(&self, f: impl FnOnce([BorrowedFd<'_>; 3]) -> R) -> Option<R> {
        let made = lock(&self.made);
        let m = made.as_ref()?;
        Some(f([m.writer.fd(), m.counters.fd(), m.dir.as_fd()]))
    }

    /// Opens and bytes the readers counted through the table.
    pub fn counted(&self) -> (u64, u64) {
        lock(&self.made)
            .as_ref()
            .map_or((0, 0), |m| m.counters.get())
    }
}

fn copy_of(t: &Trusted) -> Copy {
    Copy {
        no: t.no,
        ino: t.ino,
        size: t.size,
    }
}
