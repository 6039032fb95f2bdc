//! `--revalidate SECONDS`: re-checking the snapshot against a source that changes while mounted.
//!
//! Opt-in, per node, at most once per `max_age`: the caller (the filesystem, on lookup and
//! getattr) asks for a node, and only one last checked longer ago is re-statted. A changed node
//! gets its new attributes in place (same id: the kernel's inode stays valid). A directory
//! whose mtime or ctime changed (an entry was added, removed or renamed, even with the mtime set
//! back) is re-listed: names that still exist keep their ids and attributes (each is
//! revalidated on its own when asked for), new names are statted and get new ids, removed names
//! are marked missing. A directory that could
//! not be listed is retried at every revalidation (its permissions may have been fixed, which
//! does not change its mtime). New subdirectories are lazy: listed when first looked into.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use stagefs_prefetch::locks::lock;
use stagefs_prefetch::source::FileKind;
use stagefs_prefetch::SourceError;

use super::scan::clean;
use super::tree::DirState;
use super::{Inner, NodeAttr, NodeId, SnapshotError};

impl Inner {
    /// See [`super::Snapshot::revalidate`].
    pub(crate) fn revalidate(
        &self,
        id: NodeId,
        max_age: Duration,
    ) -> Result<NodeAttr, SnapshotError> {
        self.settle(id)?;
        let max_age_ds = u32::try_from(max_age.as_millis() / 100).unwrap_or(u32::MAX);
        let now = self.now_ds();
        let (path, old, dir_state) = {
            let t = self.read();
            t.node(id).ok_or(SnapshotError::NoNode(id))?;
            let Some(old) = t.attr(id) else {
                return Err(SourceError::Gone { path: t.path(id) }.into());
            };
            let checked = t.checked.get(id as usize).copied().unwrap_or(0);
            if now.saturating_sub(checked) < max_age_ds {
                return Ok(old);
            }
            let state = t.dir_index(id).map(|d| t.dirs[d as usize].state);
            (t.path(id), old, state)
        };
        let source = self.source()?.clone();
        self.requests.fetch_add(1, Ordering::Relaxed);
        let meta = match source.stat(&path) {
            Ok(m) => m,
            Err(e) => {
                if matches!(e, SourceError::Gone { .. }) {
                    self.write().mark_missing(id);
                }
                return Err(e.into());
            }
        };
        let link = if meta.kind == FileKind::Symlink
            && (old.kind != FileKind::Symlink || old.version() != meta.version())
        {
            self.requests.fetch_add(1, Ordering::Relaxed);
            Some(source.readlink(&path)?)
        } else {
            None
        };
        let relist = meta.kind == FileKind::Dir
            && old.kind == FileKind::Dir
            && match dir_state {
                Some(DirState::Failed) => true,
                // The ctime too: entries replaced with the mtime set back still move it.
                Some(DirState::Ready) => {
                    old.mtime_ns != meta.mtime_ns || old.ctime_ns != meta.ctime_ns
                }
                _ => false,
            };
        let attr = {
            let mut t = self.write();
            t.fill(id, &meta, link.as_deref(), DirState::Lazy);
            t.set_checked(id, now);
            t.attr(id)
        };
        if relist {
            self.relist(id, &path, now)?;
        }
        attr.ok_or(SnapshotError::NoNode(id))
    }

    /// Re-reads directory node `id`'s names (see the module docs).
    fn relist(&self, id: NodeId, path: &Path, now: u32) -> Result<(), SnapshotError> {
        let _one_at_a_time = lock(&self.relist);
        let source = self.source()?.clone();
        let Some(d) = self.read().dir_index(id) else {
            return Ok(());
        };
        self.requests.fetch_add(1, Ordering::Relaxed);
        let names = match source.read_dir(path) {
            Ok(names) => names,
            Err(e) => {
                self.write().dir_failed(d, &e);
                return Ok(());
            }
        };
        let (names, rejected) = clean(path, names);
        // Which names are known already (their ids are kept)?
        let known: Vec<Option<NodeId>> = {
            let t = self.read();
            names.iter().map(|n| t.find(d, n.as_bytes())).collect()
        };
        let fresh: Vec<_> = names
            .iter()
            .zip(&known)
            .filter(|(_, k)| k.is_none())
            .map(|(n, _)| {
                let p = path.join(n);
                let r = self.stat_one(&*source, &p);
                (p, r)
            })
            .collect();
        let mut t = self.write();
        for e in rejected {
            t.record_error(e);
        }
        let old_kids: Vec<NodeId> = {
            let kids = t.kids(d);
            (0..kids.len()).map(|i| kids.get(i)).collect()
        };
        let mut list = Vec::with_capacity(names.len());
        let mut fresh = fresh.into_iter();
        for (name, k) in names.iter().zip(known) {
            if let Some(k) = k {
                list.push(k);
                continue;
            }
            let Some((p, r)) = fresh.next() else { break };
            match r {
                Ok((meta, link)) => {
                    let new = match t.push_placeholder(id, OsStr::as_bytes(name)) {
                        Ok(new) => new,
                        Err(e) => {
                            t.record_error(format!("{}: {e}; skipped", p.display()));
                            continue;
                        }
                    };
                    t.fill(new, &meta, link.as_deref(), DirState::Lazy);
                    t.set_checked(new, now);
                    list.push(new);
                }
                Err(e) => t.record_error(format!("{e}; {} skipped", p.display())),
            }
        }
        let kept: HashSet<NodeId> = list.iter().copied().collect();
        for k in old_kids {
            if !kept.contains(&k) {
                t.mark_missing(k);
            }
        }
        t.relisted.insert(d, list);
        let dir = &mut t.dirs[d as usize];
        dir.state = DirState::Ready;
        dir.errno = 0;
        Ok(())
    }
}
