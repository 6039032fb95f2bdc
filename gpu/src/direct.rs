//! Direct reads for a [`crate::Loader`]: a `.npy` file on a stagefs mount whose verified copy
//! is in the mount's cache is read through a read-only descriptor of that copy (handed over by
//! the daemon on its private control socket, [`stagefs_protocol`]), at local speed instead of
//! through FUSE. Per file and silent: a file not on a mount, not staged yet, small, a view, a
//! mount under `--revalidate` or a daemon that cannot be reached is read as before, and the
//! reason is kept for the loader's stats ([`DirectReads::status`]).
//!
//! The pins the daemon holds for these descriptors live as long as the connection, which lives
//! as long as the loader (its sources hold the descriptors): dropping the loader releases them.
//!
//! Ahead of the readers, [`advise`] tells the kernel (`posix_fadvise(WILLNEED)`) which byte
//! ranges of the direct files the next batches read, within the hints' window
//! ([`crate::hints::batches_ahead`], at most [`crate::hints::AHEAD_BYTES`]): the daemon's page
//! pushes go to the mount's pages, which a direct reader never reads.

use std::fs::File;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use stagefs_protocol::{ClientError, DirectClient};
use tracing::debug;

use crate::hints::find_mount;
use crate::source::Source;

/// A loader's direct descriptors and why the other files have none.
pub struct DirectReads {
    /// One connection per mount root (holding the pins).
    conns: Vec<(PathBuf, Mutex<DirectClient>)>,
    /// Per source: `None` read direct, or why not.
    status: Vec<(PathBuf, Option<String>)>,
    /// The direct files, by source index.
    files: Vec<(usize, Arc<File>)>,
}

impl DirectReads {
    /// Reopens through direct descriptors the sources (indices `which`) that can be.
    pub fn open(sources: &mut [Source], which: &[usize]) -> DirectReads {
        let mut d = DirectReads {
            conns: Vec::new(),
            status: Vec::new(),
            files: Vec::new(),
        };
        for &i in which {
            let Some(s) = sources.get_mut(i) else {
                continue;
            };
            let why = match d.reopen(s) {
                Ok(file) => {
                    d.files.push((i, file));
                    None
                }
                Err(why) => {
                    debug!(path = %s.path.display(), why, "read through the mount, not direct");
                    Some(why)
                }
            };
            d.status.push((s.path.clone(), why));
        }
        d
    }

    /// No direct reads (`direct=False`).
    pub fn off() -> DirectReads {
        DirectReads {
            conns: Vec::new(),
            status: Vec::new(),
            files: Vec::new(),
        }
    }

    fn reopen(&mut self, s: &mut Source) -> Result<Arc<File>, String> {
        let (root, socket) = find_mount(&s.path).ok_or("not on a stagefs mount")?;
        let canon = std::fs::canonicalize(&s.path).map_err(|e| e.to_string())?;
        let rel = canon
            .strip_prefix(&root)
            .ok()
            .and_then(Path::to_str)
            .ok_or("not a plain path under the mount")?
            .to_string();
        let at = match self.conns.iter().position(|(r, _)| *r == root) {
            Some(at) => at,
            None => {
                let c = DirectClient::connect(&socket).map_err(|e| format!("no socket: {e}"))?;
                self.conns.push((root, Mutex::new(c)));
                self.conns.len() - 1
            }
        };
        let got = {
            let mut c = self.conns[at].1.lock().unwrap_or_else(|p| p.into_inner());
            c.open(&rel)
        };
        let (fd, granted) = match got {
            Ok(x) => x,
            Err(ClientError::Refused(r)) => return Err(r.to_string()),
            Err(e) => {
                // Out of step: this mount's other files read through it.
                let why = e.to_string();
                self.conns.remove(at);
                return Err(why);
            }
        };
        let file = Arc::new(File::from(fd));
        let size = s.reader.size().map_err(|e| e.to_string())?;
        if size != granted.size {
            return Err(format!(
                "the copy has {} bytes, the file {size}",
                granted.size
            ));
        }
        s.reader = file.clone();
        Ok(file)
    }

    /// Per file given to [`open`](Self::open): its path and `None` if read direct, else why not.
    pub fn status(&self) -> &[(PathBuf, Option<String>)] {
        &self.status
    }

    /// The sources read direct, with their files.
    pub fn files(&self) -> &[(usize, Arc<File>)] {
        &self.files
    }
}

/// Advises the kernel that rows `rows` (in read order) of a direct file whose rows of
/// `row_bytes` start at `offset` are needed soon: runs of consecutive rows as one range.
pub fn advise(file: &File, offset: u64, row_bytes: u64, rows: &[u64]) {
    let mut run: Option<(u64, u64)> = None;
    let flush = |r: Option<(u64, u64)>| {
        if let Some((at, len)) = r {
            let _ =
                rustix::fs::fadvise(file, at, NonZeroU64::new(len), rustix::fs::Advice::WillNeed);
        }
    };
    for &r in rows {
        let at = offset.saturating_add(r.saturating_mul(row_bytes));
        run = match run {
            Some((a, l)) if a.saturating_add(l) == at => Some((a, l.saturating_add(row_bytes))),
            other => {
                flush(other);
                Some((at, row_bytes))
            }
        };
    }
    flush(run);
}
