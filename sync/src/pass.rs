//! Running a pass: remove stale temporaries, create directories, copy files and links in
//! parallel on a rayon pool, delete extras, then fsync every directory that changed.
//!
//! Failures of single paths never stop the pass: they are collected in the [`Report`] so that the
//! caller can name all of them and exit non-zero.

use crate::copy::{self, Outcome};
use crate::error::{FileError, SyncError};
use crate::plan::{self, Plan};
use rayon::prelude::*;
use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Options of a sync pass.
#[derive(Debug, Clone)]
pub struct SyncOptions {
    /// Also compare contents of files whose size and mtime match.
    pub verify: bool,
    /// Remove destination entries that the source does not have.
    pub delete: bool,
    /// Files copied in parallel.
    pub jobs: usize,
}

impl Default for SyncOptions {
    fn default() -> Self {
        SyncOptions {
            verify: false,
            delete: false,
            jobs: default_jobs(),
        }
    }
}

/// Parallel copies by default. A copy mostly waits (on the kernel's copy and on fsync) rather
/// than computes, so the number does not follow the core count: with many fsyncs in flight the
/// journal commits them together (ext4/XFS group commit). Measured on a 2-core VM, 337 MB in
/// 2009 files (bench/sync_bench.sh data): 2 copies 9.0 s, 8 copies 4.6 s, 16 copies 3.9 s.
pub const DEFAULT_JOBS: usize = 16;

/// The default number of parallel copies ([`DEFAULT_JOBS`]).
pub fn default_jobs() -> usize {
    DEFAULT_JOBS
}

/// What a pass did.
#[derive(Debug, Default)]
pub struct Report {
    /// Files and links written.
    pub copied: u64,
    /// Bytes of file data written.
    pub bytes: u64,
    /// Entries already up to date.
    pub unchanged: u64,
    /// Destination entries removed by `delete`.
    pub deleted: u64,
    /// Leftover temporaries of earlier runs removed.
    pub temps_removed: u64,
    /// Copies restarted because the source changed during them.
    pub retries: u64,
    /// Entries skipped, with why (unsupported type, vanished source).
    pub skipped: Vec<(PathBuf, String)>,
    /// Entries that failed, with why.
    pub failed: Vec<(PathBuf, String)>,
    /// Wall time of the pass.
    pub elapsed: Duration,
}

impl Report {
    /// Write throughput in MB/s (10^6 bytes per second).
    pub fn mb_per_s(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.bytes as f64 / 1e6 / secs
        } else {
            0.0
        }
    }

    /// True when nothing failed.
    pub fn ok(&self) -> bool {
        self.failed.is_empty()
    }
}

/// Runs sync passes with a fixed set of options and one thread pool.
pub struct Syncer {
    opts: SyncOptions,
    pool: rayon::ThreadPool,
}

impl Syncer {
    /// Creates a syncer with its copy threads.
    pub fn new(opts: SyncOptions) -> Result<Syncer, SyncError> {
        let jobs = opts.jobs.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(jobs)
            .thread_name(|i| format!("stagefs-sync-{i}"))
            .build()
            .map_err(|e| SyncError::ThreadPool {
                jobs,
                message: e.to_string(),
            })?;
        Ok(Syncer { opts, pool })
    }

    /// Checks the roots (creating DST if needed) and plans a pass from `src` to `dst`.
    pub fn plan(&self, src: &Path, dst: &Path) -> Result<Plan, SyncError> {
        let src_meta = fs::metadata(src).map_err(|source| SyncError::Io {
            op: "open source directory",
            path: src.to_path_buf(),
            source,
        })?;
        if !src_meta.is_dir() {
            return Err(SyncError::SourceNotDir {
                path: src.to_path_buf(),
            });
        }
        fs::create_dir_all(dst).map_err(|source| SyncError::Io {
            op: "create destination directory",
            path: dst.to_path_buf(),
            source,
        })?;
        let canon = |p: &Path| {
            fs::canonicalize(p).map_err(|source| SyncError::Io {
                op: "resolve path",
                path: p.to_path_buf(),
                source,
            })
        };
        let (csrc, cdst) = (canon(src)?, canon(dst)?);
        if cdst.starts_with(&csrc) {
            return Err(SyncError::DestInsideSource {
                src: src.to_path_buf(),
                dst: dst.to_path_buf(),
            });
        }
        plan::build(src, dst, self.opts.verify, self.opts.delete)
    }

    /// Plans and executes one pass.
    pub fn sync(
        &self,
        src: &Path,
        dst: &Path,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<Report, SyncError> {
        let plan = self.plan(src, dst)?;
        Ok(self.execute(plan, progress))
    }

    /// Executes a plan; `progress` is called with the bytes copied as they go.
    pub fn execute(&self, plan: Plan, progress: &(dyn Fn(u64) + Sync)) -> Report {
        let start = Instant::now();
        let mut report = Report {
            unchanged: plan.unchanged,
            skipped: plan.skipped.clone(),
            ..Report::default()
        };
        let touched: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());
        let touch = |p: &Path| {
            if let Some(parent) = p.parent() {
                if let Ok(mut t) = touched.lock() {
                    t.insert(parent.to_path_buf());
                }
            }
        };

        for tmp in &plan.stale_temps {
            match fs::remove_file(tmp) {
                Ok(()) => {
                    report.temps_removed += 1;
                    touch(tmp);
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => report
                    .failed
                    .push((tmp.clone(), format!("remove leftover temporary: {e}"))),
            }
        }

        let mut failed_dirs: Vec<PathBuf> = Vec::new();
        for d in &plan.dirs {
            let path = plan.dst.join(&d.rel);
            if failed_dirs.iter().any(|f| d.rel.starts_with(f)) {
                continue;
            }
            match make_dir(&path, d.replace, d.mode) {
                Ok(()) => touch(&path),
                Err(e) => {
                    report.failed.push((d.rel.clone(), e.to_string()));
                    failed_dirs.push(d.rel.clone());
                }
            }
        }
        let under_failed = |rel: &Path| failed_dirs.iter().any(|f| rel.starts_with(f));

        enum Done {
            File(Result<Outcome, FileError>),
            Link(Result<(), FileError>),
        }
        let results: Vec<(PathBuf, Done)> = self.pool.install(|| {
            let files = plan
                .files
                .par_iter()
                .filter(|f| !under_failed(&f.rel))
                .map(|f| {
                    let dst = plan.dst.join(&f.rel);
                    let r = copy::copy_file(
                        &plan.src.join(&f.rel),
                        &dst,
                        f.dst,
                        f.stamp,
                        f.seen_at,
                        progress,
                    );
                    if matches!(r, Ok(Outcome::Copied(_))) {
                        touch(&dst);
                    }
                    (f.rel.clone(), Done::File(r))
                });
            let links = plan
                .links
                .par_iter()
                .filter(|l| !under_failed(&l.rel))
                .map(|l| {
                    let dst = plan.dst.join(&l.rel);
                    let r = copy::copy_symlink(&l.target, &dst, l.dst);
                    if r.is_ok() {
                        touch(&dst);
                    }
                    (l.rel.clone(), Done::Link(r))
                });
            // Largest files first would balance threads better, but directory order keeps
            // small, related files (a checkpoint and its metadata) close together in time.
            files.chain(links).collect()
        });
        for (rel, done) in results {
            match done {
                Done::File(Ok(Outcome::Copied(c))) => {
                    report.copied += 1;
                    report.bytes += c.bytes;
                    report.retries += u64::from(c.retries);
                }
                Done::File(Ok(Outcome::Vanished)) => report
                    .skipped
                    .push((rel, "vanished before it could be copied".into())),
                Done::Link(Ok(())) => report.copied += 1,
                Done::File(Err(e)) | Done::Link(Err(e)) => report.failed.push((rel, e.to_string())),
            }
        }

        // Deepest first, so that a directory's contents go before it.
        let mut deletes = plan.deletes.clone();
        deletes.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for rel in deletes {
            let path = plan.dst.join(&rel);
            let r = match fs::symlink_metadata(&path) {
                Ok(m) if m.is_dir() => fs::remove_dir_all(&path),
                Ok(_) => fs::remove_file(&path),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            };
            match r {
                Ok(()) => {
                    report.deleted += 1;
                    touch(&path);
                }
                Err(e) => report.failed.push((rel, format!("delete: {e}"))),
            }
        }

        let dirs = touched.into_inner().unwrap_or_default();
        let dir_results: Vec<(PathBuf, std::io::Result<()>)> = self.pool.install(|| {
            dirs.into_par_iter()
                .map(|d| {
                    let r = copy::fsync_dir(&d);
                    (d, r)
                })
                .collect()
        });
        for (d, r) in dir_results {
            if let Err(e) = r {
                let rel = d.strip_prefix(&plan.dst).unwrap_or(&d).to_path_buf();
                report.failed.push((
                    rel,
                    format!("fsync directory: {e} (renames may not be durable)"),
                ));
            }
        }
        report.failed.sort();
        report.elapsed = start.elapsed();
        report
    }
}

fn make_dir(path: &Path, replace: bool, mode: u32) -> Result<(), FileError> {
    if replace {
        fs::remove_file(path).map_err(FileError::io("remove file in the way of a directory"))?;
    }
    match fs::create_dir(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && path.is_dir() => {}
        Err(e) => return Err(FileError::io("create directory")(e)),
    }
    // Keep the owner able to write into it, or the copies into it would fail.
    fs::set_permissions(path, fs::Permissions::from_mode(mode | 0o700))
        .map_err(FileError::io("set directory mode"))
}
