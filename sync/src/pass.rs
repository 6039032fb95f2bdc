//! Running a pass: remove stale temporaries, create directories, copy files and links in
//! parallel on a rayon pool, delete extras, then fsync every directory that changed.
//!
//! Every change to DST is made through descriptors beneath the DST root the plan opened
//! ([`crate::dst`]); paths are only kept relative to it, for bookkeeping and messages.
//!
//! Failures of single paths never stop the pass: they are collected in the [`Report`] so that the
//! caller can name all of them and exit non-zero.

use crate::copy::{self, Outcome};
use crate::dst;
use crate::error::{FileError, SyncError};
use crate::plan::{self, Plan};
use rayon::prelude::*;
use std::collections::BTreeSet;
use std::fs;
use std::os::fd::AsFd;
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
        let canon = |p: &Path| {
            canonical_maybe_missing(p).map_err(|source| SyncError::Io {
                op: "resolve path",
                path: p.to_path_buf(),
                source,
            })
        };
        // Checked before DST is created, so that a refused DST is not left behind in SRC.
        let (csrc, cdst) = (canon(src)?, canon(dst)?);
        if cdst.starts_with(&csrc) {
            return Err(SyncError::DestInsideSource {
                src: src.to_path_buf(),
                dst: dst.to_path_buf(),
            });
        }
        // SRC inside DST: with --delete, SRC itself (absent from SRC's own listing) and
        // everything else in DST would be deleted. Without it the pass may run, but never
        // writes into or over SRC (plan's `protect`).
        let protect = csrc.strip_prefix(&cdst).ok().map(Path::to_path_buf);
        if protect.is_some() && self.opts.delete {
            return Err(SyncError::SourceInsideDest {
                src: src.to_path_buf(),
                dst: dst.to_path_buf(),
            });
        }
        fs::create_dir_all(dst).map_err(|source| SyncError::Io {
            op: "create destination directory",
            path: dst.to_path_buf(),
            source,
        })?;
        let opts = plan::PlanOptions {
            verify: self.opts.verify,
            delete: self.opts.delete,
            protect,
        };
        plan::build(src, dst, &opts)
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
            failed: plan.refused.clone(),
            ..Report::default()
        };
        let (Some(root), Some(dst_root)) = (plan.src_root.clone(), plan.dst_root.clone()) else {
            report.failed.push((
                PathBuf::new(),
                "internal: plan has no root descriptors".into(),
            ));
            return report;
        };
        // Directories (relative to DST) whose entries changed: fsynced at the end.
        let touched: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());
        let touch = |rel: &Path| {
            if let Some(parent) = rel.parent() {
                if let Ok(mut t) = touched.lock() {
                    t.insert(parent.to_path_buf());
                }
            }
        };

        for tmp in &plan.stale_temps {
            match dst::remove(dst_root.as_fd(), tmp) {
                Ok(true) => {
                    report.temps_removed += 1;
                    touch(tmp);
                }
                Ok(false) => {}
                Err(e) => report.failed.push((
                    tmp.clone(),
                    FileError::dst("remove leftover temporary")(e).to_string(),
                )),
            }
        }

        let mut failed_dirs: Vec<PathBuf> = Vec::new();
        for d in &plan.dirs {
            if failed_dirs.iter().any(|f| d.rel.starts_with(f)) {
                continue;
            }
            match dst::make_dir(dst_root.as_fd(), &d.rel, d.mode, d.replace) {
                Ok(()) => touch(&d.rel),
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
                    let r = copy::copy_file(
                        root.as_fd(),
                        &f.rel,
                        dst_root.as_fd(),
                        f.dst,
                        f.stamp,
                        f.seen_at,
                        progress,
                    );
                    if matches!(r, Ok(Outcome::Copied(_))) {
                        touch(&f.rel);
                    }
                    (f.rel.clone(), Done::File(r))
                });
            let links = plan
                .links
                .par_iter()
                .filter(|l| !under_failed(&l.rel))
                .map(|l| {
                    let r = copy::copy_symlink(&l.target, dst_root.as_fd(), &l.rel, l.dst);
                    if r.is_ok() {
                        touch(&l.rel);
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
                Done::File(Ok(Outcome::Skipped(why))) => report.skipped.push((rel, why)),
                Done::Link(Ok(())) => report.copied += 1,
                Done::File(Err(e)) | Done::Link(Err(e)) => report.failed.push((rel, e.to_string())),
            }
        }

        // Deepest first, so that a directory's contents go before it.
        let mut deletes = plan.deletes.clone();
        deletes.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for rel in deletes {
            match dst::remove(dst_root.as_fd(), &rel) {
                Ok(_) => {
                    report.deleted += 1;
                    touch(&rel);
                }
                Err(e) => {
                    let e = FileError::dst("delete")(e);
                    report.failed.push((rel, e.to_string()));
                }
            }
        }

        let dirs = touched.into_inner().unwrap_or_default();
        let dir_results: Vec<(PathBuf, Result<(), FileError>)> = self.pool.install(|| {
            dirs.into_par_iter()
                .map(|d| {
                    let r = dst::fsync_dir(dst_root.as_fd(), &d);
                    (d, r)
                })
                .collect()
        });
        for (rel, r) in dir_results {
            if let Err(e) = r {
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

/// `p` made absolute with symlinks resolved, also when its last components do not exist yet
/// (the nearest existing ancestor is resolved and the rest appended).
fn canonical_maybe_missing(p: &Path) -> std::io::Result<PathBuf> {
    let mut missing = Vec::new();
    let mut cur = p;
    loop {
        match fs::canonicalize(cur) {
            Ok(mut c) => {
                for name in missing.iter().rev() {
                    c.push(name);
                }
                return Ok(c);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                match (cur.parent(), cur.file_name()) {
                    (Some(parent), Some(name)) => {
                        missing.push(name.to_os_string());
                        cur = if parent.as_os_str().is_empty() {
                            Path::new(".")
                        } else {
                            parent
                        };
                    }
                    _ => return Err(e),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)
mod tests {
    //! The source changing between planning and copying: plan, change the tree, execute.
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::time::SystemTime;

    struct Tree {
        _t: tempfile::TempDir,
        src: PathBuf,
        dst: PathBuf,
        secret: PathBuf,
    }

    /// SRC with `d/f` and `g`, dated in the past so that copies need not wait; a secret
    /// outside SRC.
    fn tree() -> Tree {
        let t = tempfile::tempdir().unwrap();
        let (src, dst) = (t.path().join("src"), t.path().join("dst"));
        fs::create_dir_all(src.join("d")).unwrap();
        for (rel, data) in [("d/f", "planned f"), ("g", "planned g")] {
            fs::write(src.join(rel), data).unwrap();
            age(&src.join(rel));
        }
        let secret = t.path().join("secret");
        fs::write(&secret, "SECRET outside SRC").unwrap();
        Tree {
            _t: t,
            src,
            dst,
            secret,
        }
    }

    fn age(p: &Path) {
        let f = fs::File::options().write(true).open(p).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(10))
            .unwrap();
    }

    fn syncer() -> Syncer {
        Syncer::new(SyncOptions {
            jobs: 2,
            ..SyncOptions::default()
        })
        .unwrap()
    }

    fn skipped_why(r: &Report, rel: &str) -> String {
        r.skipped
            .iter()
            .find(|(p, _)| p == Path::new(rel))
            .map(|(_, w)| w.clone())
            .unwrap_or_else(|| panic!("{rel} not skipped: {r:?}"))
    }

    #[test]
    fn file_swapped_for_symlink_after_planning_is_not_followed() {
        let t = tree();
        let s = syncer();
        let plan = s.plan(&t.src, &t.dst).unwrap();
        fs::remove_file(t.src.join("g")).unwrap();
        std::os::unix::fs::symlink(&t.secret, t.src.join("g")).unwrap();
        let r = s.execute(plan, &|_| {});
        assert!(r.ok(), "{r:?}");
        assert!(skipped_why(&r, "g").contains("symlink"), "{r:?}");
        assert!(fs::symlink_metadata(t.dst.join("g")).is_err());
        assert_eq!(fs::read_to_string(t.dst.join("d/f")).unwrap(), "planned f");
        // The next pass copies the link as a link.
        let r = s.sync(&t.src, &t.dst, &|_| {}).unwrap();
        assert!(r.ok(), "{r:?}");
        assert_eq!(fs::read_link(t.dst.join("g")).unwrap(), t.secret);
    }

    #[test]
    fn directory_swapped_for_symlink_after_planning_is_not_followed() {
        let t = tree();
        let outside = t.secret.parent().unwrap().join("outside");
        fs::create_dir_all(&outside).unwrap();
        fs::write(outside.join("f"), "SECRET in a directory outside SRC").unwrap();
        let s = syncer();
        let plan = s.plan(&t.src, &t.dst).unwrap();
        fs::rename(t.src.join("d"), t.src.join("d.moved")).unwrap();
        std::os::unix::fs::symlink(&outside, t.src.join("d")).unwrap();
        let r = s.execute(plan, &|_| {});
        assert!(skipped_why(&r, "d/f").contains("symlink"), "{r:?}");
        assert!(fs::symlink_metadata(t.dst.join("d/f")).is_err());
    }

    #[test]
    fn fifo_swapped_in_after_planning_is_skipped_without_blocking() {
        let t = tree();
        let s = syncer();
        let plan = s.plan(&t.src, &t.dst).unwrap();
        fs::remove_file(t.src.join("g")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            t.src.join("g"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let r = s.execute(plan, &|_| {});
        assert!(
            skipped_why(&r, "g").contains("no longer a regular file"),
            "{r:?}"
        );
    }

    #[test]
    fn file_replaced_by_a_new_version_after_planning_is_copied() {
        let t = tree();
        let s = syncer();
        let plan = s.plan(&t.src, &t.dst).unwrap();
        // Write-and-rename, as checkpoint savers do: same owner, new inode.
        fs::write(t.src.join("g.new"), "new version of g").unwrap();
        age(&t.src.join("g.new"));
        fs::rename(t.src.join("g.new"), t.src.join("g")).unwrap();
        let r = s.execute(plan, &|_| {});
        assert!(r.ok() && r.skipped.is_empty(), "{r:?}");
        assert_eq!(
            fs::read_to_string(t.dst.join("g")).unwrap(),
            "new version of g"
        );
    }

    #[test]
    fn file_replaced_by_another_owners_file_after_planning_is_not_copied() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root to give a file another owner");
            return;
        }
        let t = tree();
        let s = syncer();
        let plan = s.plan(&t.src, &t.dst).unwrap();
        let planted = t.src.join("g.planted");
        fs::write(&planted, "another user's file").unwrap();
        age(&planted);
        std::os::unix::fs::chown(&planted, Some(4242), Some(4242)).unwrap();
        fs::rename(&planted, t.src.join("g")).unwrap();
        assert_eq!(fs::metadata(t.src.join("g")).unwrap().uid(), 4242);
        let r = s.execute(plan, &|_| {});
        assert!(skipped_why(&r, "g").contains("another owner"), "{r:?}");
        assert!(fs::symlink_metadata(t.dst.join("g")).is_err());
    }

    /// Everything under `dir` (names, modes, contents), to compare before and after.
    fn contents(dir: &Path) -> Vec<(PathBuf, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            let m = fs::symlink_metadata(&d).unwrap();
            out.push((d.clone(), m.mode(), Vec::new()));
            for e in fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let m = fs::symlink_metadata(&p).unwrap();
                if m.is_dir() {
                    stack.push(p);
                } else {
                    out.push((p.clone(), m.mode(), fs::read(&p).unwrap()));
                }
            }
        }
        out.sort();
        out
    }

    /// Hardening issue, item 3, without a race: DST/d is swapped for a symlink to a directory
    /// outside DST between planning and executing. Nothing is created, written, re-moded or
    /// deleted there; the paths fail, named; the next pass replaces the link by a directory.
    #[test]
    fn destination_directory_swapped_for_symlink_after_planning_is_not_written_through() {
        crate::beneath::both_ways(|| {
            let t = tree();
            let s = Syncer::new(SyncOptions {
                jobs: 2,
                delete: true,
                ..SyncOptions::default()
            })
            .unwrap();
            let r = s.sync(&t.src, &t.dst, &|_| {}).unwrap();
            assert!(r.ok(), "{r:?}");
            // Work for the next pass under d: a new version, a new directory, an extra to delete.
            fs::write(t.src.join("d/f"), "new f").unwrap();
            age(&t.src.join("d/f"));
            fs::create_dir(t.src.join("d/e")).unwrap();
            fs::write(t.src.join("d/e/h"), "h").unwrap();
            age(&t.src.join("d/e/h"));
            std::os::unix::fs::symlink("g", t.src.join("d/l")).unwrap();
            fs::write(t.dst.join("d/extra"), "extra").unwrap();
            let outside = t.secret.parent().unwrap().join("outside");
            fs::create_dir_all(&outside).unwrap();
            fs::set_permissions(&outside, fs::Permissions::from_mode(0o700)).unwrap();
            for name in ["f", "extra"] {
                fs::write(outside.join(name), "SECRET outside DST").unwrap();
            }
            let before = contents(&outside);

            let plan = s.plan(&t.src, &t.dst).unwrap();
            fs::rename(t.dst.join("d"), t.dst.join("d.moved")).unwrap();
            std::os::unix::fs::symlink(&outside, t.dst.join("d")).unwrap();
            let r = s.execute(plan, &|_| {});
            assert_eq!(contents(&outside), before);
            let failed: Vec<&Path> = r.failed.iter().map(|(p, _)| p.as_path()).collect();
            for rel in ["d/e", "d/f", "d/l", "d/extra"] {
                assert!(failed.contains(&Path::new(rel)), "{rel}: {r:?}");
            }
            assert!(
                r.failed.iter().all(|(_, why)| why.contains("not followed")),
                "{r:?}"
            );

            let r = s.sync(&t.src, &t.dst, &|_| {}).unwrap();
            assert!(r.ok(), "{r:?}");
            assert_eq!(contents(&outside), before);
            assert!(fs::symlink_metadata(t.dst.join("d")).unwrap().is_dir());
            assert_eq!(fs::read_to_string(t.dst.join("d/f")).unwrap(), "new f");
            assert_eq!(fs::read_to_string(t.dst.join("d/e/h")).unwrap(), "h");
            assert!(!t.dst.join("d.moved").exists());
        });
    }
}
