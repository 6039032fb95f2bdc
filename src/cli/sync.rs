//! `stagefs sync`: one pass (or a pass every DURATION until signalled) from scratch to
//! persistent storage, with a progress bar and a summary that names every failure.

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use stagefs_sync::signals::{self, StopSignals};
use stagefs_sync::{Report, SyncOptions, Syncer};
use std::path::{Path, PathBuf};

/// Exit code when some paths failed (the others were copied).
pub const EXIT_FAILED: i32 = 1;

/// The long `--help` text.
const SYNC_HELP: &str = concat!(
    "A file is copied when DST lacks it or its size or mtime differ (with --verify, also when the\n",
    "contents differ). Each copy is written to `.stagefs-tmp.*` next to its final name, fsynced and\n",
    "renamed into place, and the directory is fsynced: after a crash or `kill -9`, every file in DST\n",
    "is its complete old or complete new version, and running the same command again finishes the\n",
    "job and removes the temporaries. A file that changes while it is being copied (a checkpoint\n",
    "still being written) is retried rather than copied torn. Symlinks are copied as symlinks;\n",
    "mode (without setuid/setgid) and mtime are kept (owner is not).\n",
    "\n",
    "Nothing outside SRC is copied: SRC is read without following any symlink in it, and a\n",
    "symlink, FIFO or another owner's file swapped in after planning is skipped and named.\n",
    "Nothing outside DST is written, renamed or deleted, even where others can write to DST (a\n",
    "group-writable lab directory): DST is reached only through directory descriptors beneath\n",
    "the DST opened at planning, so a symlink swapped into it fails that path, named, and is\n",
    "never followed.\n",
    "Without --delete nothing in DST is removed but stagefs's own stale temporaries (exact name\n",
    "pattern; another node's only after an hour without change). SRC inside DST is refused\n",
    "with --delete, DST inside SRC always.\n",
    "\n",
    "Example, in a job: `stagefs sync $SCRATCH/out /bigdata/runs/$SLURM_JOB_ID --every 10m &`\n",
    "(or let `stagefs run --sync` do it).\n",
);

/// Copy new and changed files from SRC to DST so that DST is never left with a partial file.
#[derive(clap::Args, Debug)]
#[command(after_long_help = SYNC_HELP)]
pub struct Args {
    /// Directory whose contents to copy (typically on node-local scratch).
    pub src: PathBuf,
    /// Directory to copy into (typically on persistent storage); created if missing.
    pub dst: PathBuf,
    /// Repeat a pass every DURATION (e.g. 30s, 10m, 1h) until SIGTERM, SIGINT or SIGUSR1,
    /// then run one last pass and exit.
    #[arg(long, value_name = "DURATION", value_parser = super::units::parse_positive_duration)]
    pub every: Option<std::time::Duration>,
    /// Also compare the contents of files whose size and mtime match (reads both copies).
    #[arg(long)]
    pub verify: bool,
    /// Delete files and directories in DST that SRC does not have (refused when SRC lies
    /// inside DST).
    #[arg(long)]
    pub delete: bool,
    /// Files copied in parallel (I/O-bound: more than the cores helps) [default: 16].
    #[arg(long, short = 'j', value_name = "N")]
    pub jobs: Option<usize>,
    /// No progress bar and no per-pass summary, only failures.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// Runs `stagefs sync`; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let opts = SyncOptions {
        verify: args.verify,
        delete: args.delete,
        jobs: args.jobs.unwrap_or_else(stagefs_sync::pass::default_jobs),
    };
    anyhow::ensure!(opts.jobs > 0, "--jobs must be at least 1");
    let syncer = Syncer::new(opts)?;
    let Some(every) = args.every else {
        let report = pass(&syncer, &args.src, &args.dst, !args.quiet)?;
        return Ok(finish(&args.src, &args.dst, &report, args.quiet));
    };
    let stop = StopSignals::install(&[libc::SIGTERM, libc::SIGINT, libc::SIGUSR1])
        .context("installing signal handlers")?;
    loop {
        // A pass that cannot run (storage briefly unavailable) is reported and retried at the
        // next period; only the last pass decides the exit code.
        match pass(&syncer, &args.src, &args.dst, !args.quiet) {
            Ok(report) => {
                finish(&args.src, &args.dst, &report, args.quiet);
            }
            Err(e) => eprintln!("stagefs sync: pass failed: {e:#}; retrying in {every:?}"),
        }
        if let Some(sig) = stop.received().or_else(|| stop.sleep(every)) {
            eprintln!("stagefs sync: {}: running a last pass", signals::name(sig));
            let report = pass(&syncer, &args.src, &args.dst, !args.quiet)?;
            return Ok(finish(&args.src, &args.dst, &report, args.quiet));
        }
    }
}

/// Plans and runs one pass with a progress bar on a terminal.
pub fn pass(syncer: &Syncer, src: &Path, dst: &Path, bar: bool) -> anyhow::Result<Report> {
    let plan = syncer.plan(src, dst)?;
    let pb = if bar {
        ProgressBar::new(plan.bytes())
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} {bytes}/{total_bytes} {bar:30} {binary_bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let report = syncer.execute(plan, &|n| pb.inc(n));
    pb.finish_and_clear();
    Ok(report)
}

/// One-line summary of a pass.
pub fn summary(src: &Path, dst: &Path, r: &Report) -> String {
    format!(
        "{} -> {}: {} copied ({:.1} MB, {:.1} MB/s), {} unchanged, {} deleted, {} skipped, \
         {} failed, {} retried while changing, {} leftover temporaries removed, {:.2}s",
        src.display(),
        dst.display(),
        r.copied,
        r.bytes as f64 / 1e6,
        r.mb_per_s(),
        r.unchanged,
        r.deleted,
        r.skipped.len(),
        r.failed.len(),
        r.retries,
        r.temps_removed,
        r.elapsed.as_secs_f64(),
    )
}

/// Prints the summary, every skip and every failure; returns the exit code for this pass.
pub fn finish(src: &Path, dst: &Path, r: &Report, quiet: bool) -> i32 {
    if !quiet {
        eprintln!("stagefs sync: {}", summary(src, dst, r));
        for (path, why) in &r.skipped {
            eprintln!("stagefs sync: skipped {}: {why}", src.join(path).display());
        }
    }
    for (path, why) in &r.failed {
        eprintln!("stagefs sync: FAILED {}: {why}", dst.join(path).display());
    }
    if r.ok() {
        0
    } else {
        eprintln!(
            "stagefs sync: {} path(s) failed; DST keeps their previous versions. \
             Fix the cause and run the same command again.",
            r.failed.len()
        );
        EXIT_FAILED
    }
}
