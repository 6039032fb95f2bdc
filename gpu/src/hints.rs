//! Read-order hints to a stagefs mount: a [`crate::Loader`] over files in a mount tells the
//! daemon which byte ranges its readers will read next, so the daemon fetches, renders (`.npy/`
//! views) and pushes them into the page cache ahead of the readers.
//!
//! The channel is the mount's hint socket (`fs/src/hints.rs` in the daemon): a Unix socket in
//! the mount's private cache directory, named by the `hint_socket` field of the mount's
//! `.stagefs/stats`. A file's mount is found by walking up from its canonical path to the first
//! directory that is a mount point (another device than its parent) and has `.stagefs/stats`;
//! the socket must belong to this process's user, so a planted `.stagefs` on a shared node
//! learns nothing. One JSON line per batch and file: `{"path": REL, "ranges": [[off, len], ..]}`,
//! consecutive rows merged into one range, cut to the daemon's bounds ([`MAX_RANGES`],
//! [`MAX_LINE_BYTES`]).
//!
//! Hints are only ever an optimisation: a file not on a mount, a missing socket, a refused
//! connection or a failed write turns hints off for that loader with one debug log line, never
//! an error. A write waits at most [`WRITE_TIMEOUT`] (the daemon applies back-pressure when it is
//! behind); a write that fails or times out may have cut a line, so hints stop there.

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tracing::debug;

use crate::source::Source;

/// Batches hinted ahead of the last one handed to a reader (the ring's slots are read ahead
/// already; hints run this much further, so fetches and renders start a few batches early).
pub const AHEAD_BATCHES: u64 = 4;
/// At most this many bytes hinted ahead (fewer batches when batches are large): the daemon's
/// cache and page cache hold them until the readers come.
pub const AHEAD_BYTES: u64 = 256 << 20;
/// Ranges per line: the daemon's bound.
pub use stagefs_protocol::MAX_RANGES;
/// Bytes named per line: a quarter of the daemon's bound (256 MiB), so a line is a batch or less.
pub const MAX_LINE_BYTES: u64 = stagefs_protocol::MAX_HINT_BYTES / 4;
/// How long one write may wait for the daemon.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Largest stats file read (they are a few KiB).
const MAX_STATS: u64 = 1 << 20;

/// Batches to hint ahead for batches of `batch_bytes` (hinted files only): 1..=AHEAD_BATCHES.
pub fn batches_ahead(batch_bytes: u64) -> u64 {
    (AHEAD_BYTES / batch_bytes.max(1)).clamp(1, AHEAD_BATCHES)
}

/// One file of the loader as the daemon names it.
struct Target {
    /// Index of the loader's source.
    source: usize,
    /// The path relative to the mount, as a JSON string.
    path_json: String,
    offset: u64,
    row_bytes: u64,
}

/// A loader's connection to the hint socket of the mount holding its files.
pub struct Hinter {
    stream: Mutex<Option<UnixStream>>,
    targets: Vec<Target>,
    off: AtomicBool,
}

/// The mount root holding `path` and its hint socket, if `path` is on a stagefs mount.
pub fn find_mount(path: &Path) -> Option<(PathBuf, PathBuf)> {
    let path = std::fs::canonicalize(path).ok()?;
    let me = std::fs::metadata("/proc/self").ok()?.uid();
    let mut dir = path.parent();
    while let Some(d) = dir {
        let stats = d.join(".stagefs").join("stats");
        let parent_dev = d
            .parent()
            .and_then(|p| std::fs::metadata(p).ok())
            .map(|m| m.dev());
        let is_mount = std::fs::metadata(d).ok().map(|m| m.dev()) != parent_dev;
        if is_mount && stats.is_file() {
            let mut text = String::new();
            std::fs::File::open(&stats)
                .ok()?
                .take(MAX_STATS)
                .read_to_string(&mut text)
                .ok()?;
            let v: serde_json::Value = serde_json::from_str(&text).ok()?;
            let socket = PathBuf::from(v.get("hint_socket")?.as_str()?);
            // Ours only: a socket of another user would learn our read order.
            let m = std::fs::symlink_metadata(&socket).ok()?;
            if m.uid() != me {
                return None;
            }
            return Some((d.to_path_buf(), socket));
        }
        dir = d.parent();
    }
    None
}

use stagefs_protocol::connect;

impl Hinter {
    /// A connection for the sources in `hinted` (indices into `sources`) that lie on one
    /// stagefs mount; `None` (with a debug line) when there is none or it cannot be reached.
    pub fn connect(sources: &[Source], hinted: &[usize]) -> Option<Hinter> {
        let mut mount: Option<(PathBuf, PathBuf)> = None;
        let mut targets = Vec::new();
        for &i in hinted {
            let s = &sources[i];
            let Some((root, socket)) = find_mount(&s.path) else {
                continue;
            };
            if mount.as_ref().is_some_and(|(r, _)| *r != root) {
                continue; // One socket per loader: files on another mount get no hints.
            }
            let Ok(canon) = std::fs::canonicalize(&s.path) else {
                continue;
            };
            let Ok(rel) = canon.strip_prefix(&root) else {
                continue;
            };
            let Some(rel) = rel.to_str() else { continue };
            let Ok(path_json) = serde_json::to_string(rel) else {
                continue;
            };
            targets.push(Target {
                source: i,
                path_json,
                offset: s.offset,
                row_bytes: s.row_bytes,
            });
            mount.get_or_insert((root, socket));
        }
        let (_, socket) = mount?;
        let stream = match connect(&socket).and_then(|s| {
            s.set_write_timeout(Some(WRITE_TIMEOUT))?;
            Ok(s)
        }) {
            Ok(s) => s,
            Err(e) => {
                debug!(socket = %socket.display(), error = %e, "read-order hints off: no socket");
                return None;
            }
        };
        Some(Hinter {
            stream: Mutex::new(Some(stream)),
            targets,
            off: AtomicBool::new(false),
        })
    }

    /// Whether hints were turned off (the socket broke).
    pub fn is_off(&self) -> bool {
        self.off.load(Ordering::Relaxed)
    }

    /// Sends the byte ranges of `rows` (in read order) of every hinted file; false once hints
    /// are off.
    pub fn send(&self, rows: &[u64]) -> bool {
        if self.is_off() {
            return false;
        }
        let mut text = String::new();
        for t in &self.targets {
            lines(t, rows, &mut text);
        }
        self.write(&text)
    }

    /// Declares the rows `ranges` (of every hinted file) as what this node reads in epochs
    /// `generation` and the next: the mount stages that set instead of the whole tree, and its
    /// read-ahead stays inside it. Lines carry `"scope": generation`; the daemon replaces a
    /// file's scope with a newer generation's and adds lines of the same one, so the ranks of
    /// a node, each sending the same set, need not coordinate. False once hints are off.
    pub fn send_scope(&self, generation: u64, ranges: &[std::ops::Range<u64>]) -> bool {
        if self.is_off() {
            return false;
        }
        let mut text = String::new();
        for t in &self.targets {
            scope_lines(t, generation, ranges, &mut text);
        }
        self.write(&text)
    }

    fn write(&self, text: &str) -> bool {
        let mut guard = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let Some(stream) = guard.as_mut() else {
            return false;
        };
        if let Err(e) = stream.write_all(text.as_bytes()) {
            debug!(error = %e, "read-order hints off: the socket failed");
            guard.take();
            self.off.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// The loader's sources that get hints.
    pub fn sources(&self) -> impl Iterator<Item = usize> + '_ {
        self.targets.iter().map(|t| t.source)
    }
}

/// Appends the scope lines for row ranges `ranges` of `t` to `out`: byte ranges, merged when
/// adjacent, [`MAX_RANGES`] per line (a scope line is a declaration, not a fetch request, so
/// the per-line byte bound of read hints does not apply).
fn scope_lines(t: &Target, generation: u64, ranges: &[std::ops::Range<u64>], out: &mut String) {
    use std::fmt::Write as _;
    let mut bytes: Vec<(u64, u64)> = Vec::new();
    let mut sorted: Vec<_> = ranges.iter().filter(|r| !r.is_empty()).cloned().collect();
    sorted.sort_unstable_by_key(|r| r.start);
    for r in sorted {
        let off = t.offset.saturating_add(r.start.saturating_mul(t.row_bytes));
        let end = t.offset.saturating_add(r.end.saturating_mul(t.row_bytes));
        match bytes.last_mut() {
            Some((o, l)) if *o + *l >= off => *l = (*l).max(end - *o),
            _ => bytes.push((off, end - off)),
        }
    }
    for part in bytes.chunks(MAX_RANGES) {
        let _ = write!(
            out,
            "{{\"path\":{},\"scope\":{generation},\"ranges\":[",
            t.path_json
        );
        for (k, (o, l)) in part.iter().enumerate() {
            let sep = if k == 0 { "" } else { "," };
            let _ = write!(out, "{sep}[{o},{l}]");
        }
        out.push_str("]}\n");
    }
}

/// Appends the hint lines for `rows` of `t` to `out`: runs of consecutive rows merged, cut at
/// [`MAX_RANGES`] ranges or [`MAX_LINE_BYTES`] bytes per line.
fn lines(t: &Target, rows: &[u64], out: &mut String) {
    use std::fmt::Write as _;
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for &r in rows {
        let off = t.offset.saturating_add(r.saturating_mul(t.row_bytes));
        match ranges.last_mut() {
            Some((o, l)) if *o + *l == off && *l + t.row_bytes <= MAX_LINE_BYTES => {
                *l += t.row_bytes
            }
            _ => ranges.push((off, t.row_bytes)),
        }
    }
    let mut i = 0;
    while i < ranges.len() {
        let mut bytes = 0u64;
        let mut j = i;
        while j < ranges.len() && j - i < MAX_RANGES && bytes + ranges[j].1 <= MAX_LINE_BYTES {
            bytes += ranges[j].1;
            j += 1;
        }
        let j = j.max(i + 1);
        let _ = write!(out, "{{\"path\":{},\"ranges\":[", t.path_json);
        for (k, (o, l)) in ranges[i..j].iter().enumerate() {
            let sep = if k == 0 { "" } else { "," };
            let _ = write!(out, "{sep}[{o},{l}]");
        }
        out.push_str("]}\n");
        i = j;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_become_merged_ranges_cut_at_the_daemons_bounds() {
        let t = Target {
            source: 0,
            path_json: "\"d/x.npy\"".into(),
            offset: 128,
            row_bytes: 10,
        };
        let mut s = String::new();
        lines(&t, &[3, 4, 5, 9, 1], &mut s);
        assert_eq!(
            s,
            "{\"path\":\"d/x.npy\",\"ranges\":[[158,30],[218,10],[138,10]]}\n"
        );
        // 3000 scattered rows: three lines of at most MAX_RANGES ranges.
        let rows: Vec<u64> = (0..3000).map(|i| i * 2).collect();
        let mut s = String::new();
        lines(&t, &rows, &mut s);
        let got: Vec<serde_json::Value> = s
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(got.len(), 3);
        let n: Vec<usize> = got
            .iter()
            .map(|v| v["ranges"].as_array().unwrap().len())
            .collect();
        assert_eq!(n, vec![1024, 1024, 952]);
        assert_eq!(got[2]["ranges"][951][0], 128 + 5998 * 10);
    }
}
