//! Planning a pass: walk SRC and DST side by side and list what must change.
//!
//! Symlinks are never followed (a link in SRC becomes the same link in DST). Entries that are
//! neither files, directories nor symlinks (sockets, FIFOs, devices) are skipped and reported.
//! Stagefs temporaries in SRC are ignored; in DST they are listed for removal unless a live
//! process owns them.

use crate::error::SyncError;
use crate::stamp::Stamp;
use crate::temp;
use std::collections::HashSet;
use std::ffi::OsString;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What exists at a destination path before the pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DstKind {
    /// Nothing there.
    Missing,
    /// A directory, which must be removed before a file or link can replace it.
    Dir,
    /// A file or a link, which a rename replaces atomically.
    Other,
}

/// One regular file to copy.
#[derive(Debug, Clone)]
pub struct FileCopy {
    /// Path relative to the roots.
    pub rel: PathBuf,
    /// The source's stamp when it was planned.
    pub stamp: Stamp,
    /// When that stamp was taken (a witness for torn-write detection, see [`crate::copy`]).
    pub seen_at: Instant,
    /// What the destination holds now.
    pub dst: DstKind,
}

/// One symbolic link to (re)create.
#[derive(Debug, Clone)]
pub struct LinkCopy {
    /// Path relative to the roots.
    pub rel: PathBuf,
    /// The link's target, copied verbatim.
    pub target: PathBuf,
    /// What the destination holds now.
    pub dst: DstKind,
}

/// One directory to create.
#[derive(Debug, Clone)]
pub struct DirCreate {
    /// Path relative to the roots.
    pub rel: PathBuf,
    /// Permission bits of the source directory.
    pub mode: u32,
    /// Whether a non-directory occupies the path and must be removed first.
    pub replace: bool,
}

/// Everything one pass will do.
#[derive(Debug, Default)]
pub struct Plan {
    /// Source root.
    pub src: PathBuf,
    /// Destination root.
    pub dst: PathBuf,
    /// Directories to create, parents before children.
    pub dirs: Vec<DirCreate>,
    /// Files to copy.
    pub files: Vec<FileCopy>,
    /// Links to create.
    pub links: Vec<LinkCopy>,
    /// Destination paths absent from the source (only with `delete`).
    pub deletes: Vec<PathBuf>,
    /// Leftover temporaries to remove (absolute paths).
    pub stale_temps: Vec<PathBuf>,
    /// Entries already up to date.
    pub unchanged: u64,
    /// Source entries skipped, with the reason (unsupported type, vanished while walking).
    pub skipped: Vec<(PathBuf, String)>,
}

impl Plan {
    /// Bytes the file copies will move.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.stamp.size).sum()
    }
}

/// Walks `src` and `dst` (both existing directories) and builds the plan.
pub fn build(src: &Path, dst: &Path, verify: bool, delete: bool) -> Result<Plan, SyncError> {
    let mut plan = Plan {
        src: src.to_path_buf(),
        dst: dst.to_path_buf(),
        ..Plan::default()
    };
    walk(&mut plan, Path::new(""), verify, delete, true)?;
    Ok(plan)
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SyncError {
    let path = path.to_path_buf();
    move |source| SyncError::Io { op, path, source }
}

fn dst_kind(meta: Option<&fs::Metadata>) -> DstKind {
    match meta {
        None => DstKind::Missing,
        Some(m) if m.is_dir() => DstKind::Dir,
        Some(_) => DstKind::Other,
    }
}

/// Plans directory `rel`; `dst_exists` says whether DST/rel is already a directory.
fn walk(
    plan: &mut Plan,
    rel: &Path,
    verify: bool,
    delete: bool,
    dst_exists: bool,
) -> Result<(), SyncError> {
    let src_dir = plan.src.join(rel);
    let dst_dir = plan.dst.join(rel);
    let mut names: Vec<OsString> = Vec::new();
    for entry in fs::read_dir(&src_dir).map_err(io_err("read directory", &src_dir))? {
        let entry = entry.map_err(io_err("read directory", &src_dir))?;
        names.push(entry.file_name());
    }
    // Directory order is arbitrary; sorted order makes runs and logs reproducible.
    names.sort();
    let mut seen: HashSet<OsString> = HashSet::with_capacity(names.len());
    for name in names {
        if temp::is_temp(&name) {
            continue;
        }
        let rel_path = rel.join(&name);
        let src_path = plan.src.join(&rel_path);
        let dst_path = plan.dst.join(&rel_path);
        let src_meta = match fs::symlink_metadata(&src_path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                plan.skipped
                    .push((rel_path, "vanished before it could be copied".into()));
                continue;
            }
            Err(e) => return Err(io_err("stat", &src_path)(e)),
        };
        seen.insert(name);
        let dst_meta = if dst_exists {
            fs::symlink_metadata(&dst_path).ok()
        } else {
            None
        };
        let kind = dst_kind(dst_meta.as_ref());
        let ft = src_meta.file_type();
        if ft.is_dir() {
            let exists = kind == DstKind::Dir;
            if !exists {
                plan.dirs.push(DirCreate {
                    rel: rel_path.clone(),
                    mode: Stamp::of(&src_meta).mode,
                    replace: kind == DstKind::Other,
                });
            }
            walk(plan, &rel_path, verify, delete, exists)?;
        } else if ft.is_symlink() {
            let target = fs::read_link(&src_path).map_err(io_err("read link", &src_path))?;
            let same = dst_meta
                .as_ref()
                .is_some_and(|m| m.file_type().is_symlink())
                && fs::read_link(&dst_path).ok().as_deref() == Some(target.as_path());
            if same {
                plan.unchanged += 1;
            } else {
                plan.links.push(LinkCopy {
                    rel: rel_path,
                    target,
                    dst: kind,
                });
            }
        } else if ft.is_file() {
            let stamp = Stamp::of(&src_meta);
            let seen_at = Instant::now();
            let same = dst_meta.as_ref().is_some_and(|m| {
                m.file_type().is_file()
                    && stamp.same_version(&Stamp::of(m))
                    && stamp.mode == Stamp::of(m).mode
            }) && (!verify || same_bytes(&src_path, &dst_path).unwrap_or(false));
            if same {
                plan.unchanged += 1;
            } else {
                plan.files.push(FileCopy {
                    rel: rel_path,
                    stamp,
                    seen_at,
                    dst: kind,
                });
            }
        } else {
            plan.skipped.push((
                rel_path,
                "not a regular file, directory or symlink (socket, FIFO or device)".into(),
            ));
        }
    }
    if dst_exists {
        scan_dst_extras(plan, rel, &dst_dir, &seen, delete)?;
    }
    Ok(())
}

/// Lists leftover temporaries and (with `delete`) entries SRC no longer has.
fn scan_dst_extras(
    plan: &mut Plan,
    rel: &Path,
    dst_dir: &Path,
    seen: &HashSet<OsString>,
    delete: bool,
) -> Result<(), SyncError> {
    for entry in fs::read_dir(dst_dir).map_err(io_err("read directory", dst_dir))? {
        let entry = entry.map_err(io_err("read directory", dst_dir))?;
        let name = entry.file_name();
        if temp::is_temp(&name) {
            if !temp::owned_by_live_process(&name) {
                plan.stale_temps.push(dst_dir.join(&name));
            }
        } else if delete && !seen.contains(&name) {
            plan.deletes.push(rel.join(&name));
        }
    }
    Ok(())
}

/// Whether two files have identical contents (`--verify`). A direct comparison rather than two
/// hashes: both files must be read in full either way, and it stops at the first difference.
pub fn same_bytes(a: &Path, b: &Path) -> std::io::Result<bool> {
    const CHUNK: usize = 1 << 20;
    let mut fa = fs::File::open(a)?;
    let mut fb = fs::File::open(b)?;
    if fa.metadata()?.len() != fb.metadata()?.len() {
        return Ok(false);
    }
    let mut ba = vec![0u8; CHUNK];
    let mut bb = vec![0u8; CHUNK];
    loop {
        let na = read_full(&mut fa, &mut ba)?;
        let nb = read_full(&mut fb, &mut bb)?;
        if na != nb || ba[..na] != bb[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

fn read_full(f: &mut fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}
