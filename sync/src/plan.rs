//! Planning a pass: walk SRC and DST side by side and list what must change.
//!
//! SRC and DST are walked side by side through directory descriptors ([`crate::beneath`]):
//! both roots are opened once, each subdirectory is opened `O_NOFOLLOW` from its parent and
//! entries are `fstatat`'ed without following, so a directory swapped for a symlink during the
//! walk is refused, never listed (in DST, a symlink where SRC has a directory is planned to be
//! replaced by a directory, never entered). The root descriptors go into the [`Plan`]: the pass
//! reaches both trees only beneath them ([`crate::copy`], [`crate::dst`]). Symlinks are never
//! followed (a link in SRC becomes the same link in DST). Entries that are neither files,
//! directories nor symlinks (sockets, FIFOs, devices) are skipped and reported. The walk holds
//! two descriptors per directory level it is in (SRC's and DST's), closed as it comes back up:
//! bounded by the depth, not by the number of files.
//!
//! Stagefs temporaries (exactly stagefs's own name pattern, [`crate::temp`]) in SRC are
//! ignored; in DST they are listed for removal when [`temp::judge`] finds them stale. Files
//! that only look similar are a user's files and are synced like any other.
//!
//! When SRC lies inside DST (allowed only without `--delete`, see [`crate::pass`]), `protect`
//! is SRC's path inside DST: nothing is planned that would write into SRC or replace SRC or a
//! directory above it.
//!
//! Without `--delete`, a directory in DST where SRC now has a file or link is not removed
//! (it may hold files synced earlier that SRC no longer has): that path fails and is named.

use crate::beneath;
use crate::error::SyncError;
use crate::stamp::Stamp;
use crate::temp;
use rustix::fs::{AtFlags, FileType, Stat};
use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

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
    /// The source root as opened for planning; copies open their files beneath it.
    pub src_root: Option<Arc<OwnedFd>>,
    /// The destination root as opened for planning; every change to DST is made beneath it.
    pub dst_root: Option<Arc<OwnedFd>>,
    /// Directories to create, parents before children.
    pub dirs: Vec<DirCreate>,
    /// Files to copy.
    pub files: Vec<FileCopy>,
    /// Links to create.
    pub links: Vec<LinkCopy>,
    /// Destination paths absent from the source (only with `delete`).
    pub deletes: Vec<PathBuf>,
    /// Leftover temporaries to remove (relative to the roots).
    pub stale_temps: Vec<PathBuf>,
    /// Entries already up to date.
    pub unchanged: u64,
    /// Source entries skipped, with the reason (unsupported type, vanished while walking).
    pub skipped: Vec<(PathBuf, String)>,
    /// Source entries that cannot be synced this way, with the reason (reported as failed).
    pub refused: Vec<(PathBuf, String)>,
}

impl Plan {
    /// Bytes the file copies will move.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.stamp.size).sum()
    }
}

/// How a pass is planned.
#[derive(Debug, Clone, Default)]
pub struct PlanOptions {
    /// Compare contents of files whose size and mtime match.
    pub verify: bool,
    /// List destination entries that the source lacks for deletion.
    pub delete: bool,
    /// SRC's path inside DST when SRC lies inside DST: never written, replaced or removed.
    pub protect: Option<PathBuf>,
}

/// Walks `src` and `dst` (both existing directories) and builds the plan.
pub fn build(src: &Path, dst: &Path, opts: &PlanOptions) -> Result<Plan, SyncError> {
    let root = beneath::open_root(src).map_err(io_err("open source directory", src))?;
    let root = Arc::new(root);
    let dst_root = beneath::open_root(dst).map_err(io_err("open destination directory", dst))?;
    let dst_root = Arc::new(dst_root);
    let mut plan = Plan {
        src: src.to_path_buf(),
        dst: dst.to_path_buf(),
        src_root: Some(root.clone()),
        dst_root: Some(dst_root.clone()),
        ..Plan::default()
    };
    walk(&mut plan, &root, Path::new(""), opts, Some(&dst_root))?;
    Ok(plan)
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SyncError {
    let path = path.to_path_buf();
    move |source| SyncError::Io { op, path, source }
}

fn dst_kind(st: Option<&Stat>) -> DstKind {
    match st.map(|st| FileType::from_raw_mode(st.st_mode)) {
        None => DstKind::Missing,
        Some(FileType::Directory) => DstKind::Dir,
        Some(_) => DstKind::Other,
    }
}

/// The names in directory `dir`, sorted (directory order is arbitrary; sorted order makes runs
/// and logs reproducible).
fn list(dir: &OwnedFd, path: &Path) -> Result<Vec<OsString>, SyncError> {
    let mut names = Vec::new();
    let entries =
        rustix::fs::Dir::read_from(dir).map_err(|e| io_err("read directory", path)(e.into()))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_err("read directory", path)(e.into()))?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        if name != "." && name != ".." {
            names.push(name.to_os_string());
        }
    }
    names.sort();
    Ok(names)
}

/// Plans directory `rel` (open as `dir`); `dst_dir` is DST/rel opened (`None`: not a
/// directory in DST, so everything in it is to be created).
fn walk(
    plan: &mut Plan,
    dir: &OwnedFd,
    rel: &Path,
    opts: &PlanOptions,
    dst_dir: Option<&OwnedFd>,
) -> Result<(), SyncError> {
    let src_dir = plan.src.join(rel);
    let dst_dir_path = plan.dst.join(rel);
    let names = list(dir, &src_dir)?;
    let mut seen: HashSet<OsString> = HashSet::with_capacity(names.len());
    for name in names {
        if temp::is_temp(&name) {
            continue;
        }
        let rel_path = rel.join(&name);
        let src_path = plan.src.join(&rel_path);
        let dst_path = plan.dst.join(&rel_path);
        let st = match rustix::fs::statat(dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(rustix::io::Errno::NOENT) => {
                plan.skipped
                    .push((rel_path, "vanished before it could be copied".into()));
                continue;
            }
            Err(e) => return Err(io_err("stat", &src_path)(e.into())),
        };
        seen.insert(name.clone());
        // Not following: a symlink in DST is an entry to replace, never a way elsewhere.
        let dst_st = dst_dir
            .and_then(|d| rustix::fs::statat(d, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW).ok());
        let mut kind = dst_kind(dst_st.as_ref());
        let ft = FileType::from_raw_mode(st.st_mode);
        let stamp = Stamp::from_stat(&st);
        if let Some(protect) = &opts.protect {
            // DST/rel_path is SRC itself or a directory above it.
            if protect.starts_with(&rel_path) {
                let descend =
                    ft == FileType::Directory && kind == DstKind::Dir && *protect != rel_path;
                if !descend {
                    plan.skipped.push((
                        rel_path,
                        format!(
                            "its destination {} is the source directory or holds it (SRC lies \
                             inside DST); not written",
                            dst_path.display()
                        ),
                    ));
                    continue;
                }
            }
        }
        if ft != FileType::Directory && kind == DstKind::Dir && !opts.delete {
            plan.refused.push((
                rel_path,
                format!(
                    "{} is a directory in DST but not in SRC; it is not removed without \
                     --delete (it may hold files synced earlier)",
                    dst_path.display()
                ),
            ));
            continue;
        }
        match ft {
            FileType::Directory => {
                let sub = match beneath::open_dir(dir, Path::new(&name)) {
                    Ok(d) => d,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        plan.skipped
                            .push((rel_path, "vanished before it could be copied".into()));
                        continue;
                    }
                    Err(e) if beneath::is_not_followed(&e) => {
                        plan.skipped.push((
                            rel_path,
                            "changed into a symlink while being planned; not followed".into(),
                        ));
                        continue;
                    }
                    Err(e) => return Err(io_err("open directory", &src_path)(e)),
                };
                let dst_sub = match dst_dir {
                    Some(d) if kind == DstKind::Dir => {
                        match beneath::open_dir(d, Path::new(&name)) {
                            Ok(sub) => Some(sub),
                            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                                kind = DstKind::Missing;
                                None
                            }
                            // Swapped for a link or file since the stat: replaced like one.
                            Err(e) if beneath::is_not_followed(&e) => {
                                kind = DstKind::Other;
                                None
                            }
                            Err(e) => {
                                return Err(io_err("open destination directory", &dst_path)(e))
                            }
                        }
                    }
                    _ => None,
                };
                if dst_sub.is_none() {
                    plan.dirs.push(DirCreate {
                        rel: rel_path.clone(),
                        mode: stamp.mode,
                        replace: kind == DstKind::Other,
                    });
                }
                walk(plan, &sub, &rel_path, opts, dst_sub.as_ref())?;
            }
            FileType::Symlink => {
                let target = match rustix::fs::readlinkat(dir, name.as_os_str(), Vec::new()) {
                    Ok(t) => PathBuf::from(OsStr::from_bytes(t.to_bytes())),
                    Err(e) => return Err(io_err("read link", &src_path)(e.into())),
                };
                let same = dst_st
                    .as_ref()
                    .is_some_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink)
                    && dst_dir.is_some_and(|d| {
                        rustix::fs::readlinkat(d, name.as_os_str(), Vec::new())
                            .is_ok_and(|t| t.as_bytes() == target.as_os_str().as_bytes())
                    });
                if same {
                    plan.unchanged += 1;
                } else {
                    plan.links.push(LinkCopy {
                        rel: rel_path,
                        target,
                        dst: kind,
                    });
                }
            }
            FileType::RegularFile => {
                let seen_at = Instant::now();
                let same = dst_st.as_ref().is_some_and(|st| {
                    let d = Stamp::from_stat(st);
                    FileType::from_raw_mode(st.st_mode) == FileType::RegularFile
                        && stamp.same_version(&d)
                        && stamp.copy_mode() == d.mode
                }) && (!opts.verify
                    || dst_dir.is_some_and(|d| same_src_dst(dir, &name, d)));
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
            }
            _ => plan.skipped.push((
                rel_path,
                "not a regular file, directory or symlink (socket, FIFO or device)".into(),
            )),
        }
    }
    if let Some(d) = dst_dir {
        scan_dst_extras(plan, rel, d, &dst_dir_path, &seen, opts.delete)?;
    }
    Ok(())
}

/// `--verify`: whether SRC's `name` in `dir` has the bytes of DST's `name` in `dst_dir` (both
/// opened without following, both regular files).
fn same_src_dst(dir: &OwnedFd, name: &OsStr, dst_dir: &OwnedFd) -> bool {
    let open = |d: &OwnedFd| {
        beneath::open_file_in(d, Path::new(name))
            .ok()
            .filter(|f| f.metadata().is_ok_and(|m| m.is_file()))
    };
    match (open(dir), open(dst_dir)) {
        (Some(src), Some(dst)) => same_bytes(src, dst).unwrap_or(false),
        _ => false,
    }
}

/// Lists leftover temporaries and (with `delete`) entries SRC no longer has in DST's
/// directory `rel`, open as `dst_dir` (at `dst_path`, for messages).
fn scan_dst_extras(
    plan: &mut Plan,
    rel: &Path,
    dst_dir: &OwnedFd,
    dst_path: &Path,
    seen: &HashSet<OsString>,
    delete: bool,
) -> Result<(), SyncError> {
    let now = SystemTime::now();
    for name in list(dst_dir, dst_path)? {
        if let Some(t) = temp::parse(&name) {
            // Not following: a temporary may be a link.
            let Ok(st) = rustix::fs::statat(dst_dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)
            else {
                continue;
            };
            if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                continue;
            }
            let changed = Stamp::from_stat(&st);
            let ctime = SystemTime::UNIX_EPOCH
                + std::time::Duration::new(
                    u64::try_from(changed.ctime_sec).unwrap_or(0),
                    u32::try_from(changed.ctime_nsec).unwrap_or(0),
                );
            let age = now.duration_since(ctime).ok();
            if temp::judge(&name, &t, age) == temp::Verdict::Stale {
                plan.stale_temps.push(rel.join(&name));
            }
        } else if delete && !seen.contains(&name) {
            plan.deletes.push(rel.join(&name));
        }
    }
    Ok(())
}

/// Whether two files have identical contents (`--verify`). A direct comparison rather than two
/// hashes: both files must be read in full either way, and it stops at the first difference.
pub fn same_bytes(mut fa: fs::File, mut fb: fs::File) -> std::io::Result<bool> {
    const CHUNK: usize = 1 << 20;
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
