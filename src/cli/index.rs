//! `stagefs index`: list a dataset once and write its metadata snapshot to a file, so that mounts
//! given `--index FILE` list nothing; `--check FILE` validates an index and says what it holds.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use stagefs_fs::snapshot::{ScanOptions, ScanStats, Snapshot};
use stagefs_prefetch::LocalSource;

/// Exit status when entries were skipped (the index is written without them), as `find` does.
pub const EXIT_SKIPPED: i32 = 1;
/// Suffix of the default index file name.
pub const SUFFIX: &str = ".stagefs-index";
/// Skipped entries printed at the end (all are in the file: `--check` prints up to 1000).
const SHOW_ERRORS: usize = 20;
/// Progress lines in a log (no terminal), e.g. a SLURM job's output.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// The long `--help` text.
const INDEX_HELP: &str = concat!(
    "What it is for: the last step of the job that prepares a dataset. It lists SOURCE once\n",
    "(with many requests in flight, which parallel filesystems answer far faster than one at a\n",
    "time) and writes every name, type, size, mtime, mode, owner and symlink target to FILE.\n",
    "Training jobs then mount with it, and list nothing on the shared filesystem — N nodes,\n",
    "zero listings of SOURCE, and each mount is complete the moment it starts:\n",
    "\n",
    "  stagefs index /bigdata/imagenet        # writes /bigdata/imagenet.stagefs-index\n",
    "  # then, in each training job:\n",
    "  stagefs mount /bigdata/imagenet $SLURM_TMPDIR/data --cache $SLURM_TMPDIR/cache \\\n",
    "      --index /bigdata/imagenet.stagefs-index\n",
    "\n",
    "The mount presents the dataset as it was indexed (snapshot semantics): a file changed since\n",
    "fails its reads with ESTALE, never serves other bytes. Run `stagefs index` again after\n",
    "changing the dataset.\n",
    "\n",
    "FILE defaults to SOURCE.stagefs-index beside SOURCE (in SOURCE's parent directory, not\n",
    "inside the dataset). It is written atomically (a temporary in the same directory, renamed\n",
    "over FILE: a job reading the previous index never sees a torn one) with mode 0600, as it\n",
    "names every path of the dataset; `chmod 644 FILE` to share it with users who can read\n",
    "SOURCE. Entries that cannot be read (e.g. permission denied) are skipped and named at the\n",
    "end; the index is still written, and the exit status is then 1.\n",
);

/// Write SOURCE's metadata snapshot to a file, so that `stagefs mount --index FILE` lists nothing.
#[derive(clap::Args, Debug)]
#[command(after_long_help = INDEX_HELP)]
pub struct Args {
    /// The dataset directory to index.
    #[arg(required_unless_present = "check")]
    pub source: Option<PathBuf>,
    /// Where to write the index [default: SOURCE.stagefs-index, beside SOURCE].
    #[arg(long, short = 'o', value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Source requests in flight while listing.
    #[arg(long, value_name = "N", default_value_t = ScanOptions::default().threads)]
    pub threads: usize,
    /// Instead of indexing: load the index FILE, validate it, and say what it holds.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["source", "output"])]
    pub check: Option<PathBuf>,
    /// No progress line and no summary, only skipped entries and errors.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

/// Runs `stagefs index`; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    super::logging::init("warn");
    if let Some(file) = &args.check {
        return check(file, args.quiet);
    }
    let Some(source) = &args.source else {
        bail!("give SOURCE, the dataset directory to index");
    };
    anyhow::ensure!(args.threads > 0, "--threads must be at least 1");
    let root =
        std::fs::canonicalize(source).with_context(|| format!("source {}", source.display()))?;
    if !root.is_dir() {
        bail!(
            "{} is not a directory: give the dataset's top directory",
            root.display()
        );
    }
    let output = match &args.output {
        Some(o) => o.clone(),
        None => default_output(&root)?,
    };
    if let Ok(out_dir) = output
        .parent()
        .map_or(Ok(PathBuf::from(".")), std::fs::canonicalize)
    {
        if out_dir.starts_with(&root) {
            eprintln!(
                "stagefs index: note: {} is inside SOURCE, so the next index will list it",
                output.display()
            );
        }
    }
    let local = LocalSource::new(&root).with_context(|| format!("source {}", root.display()))?;
    let opts = ScanOptions {
        threads: args.threads,
        ..ScanOptions::default()
    };
    let snap = Snapshot::scan(Arc::new(local), &root, opts)?;
    follow(&snap, args.quiet);
    snap.save(&output)
        .with_context(|| format!("writing the index {}", output.display()))?;
    let stats = snap.scan_stats();
    let errors = snap.errors();
    if !args.quiet {
        let size = std::fs::metadata(&output).map(|m| m.len()).unwrap_or(0);
        eprintln!(
            "indexed {}: {} entries in {} directories in {:.1} s ({:.0} entries/s, {} source \
             requests); wrote {} ({:.1} MB; in memory {} B/entry, process RSS {:.0} MB); {} \
             skipped",
            root.display(),
            stats.entries,
            stats.dirs,
            stats.elapsed.as_secs_f64(),
            rate(&stats),
            stats.requests,
            output.display(),
            size as f64 / 1e6,
            snap.memory_bytes() / snap.len().max(1),
            rss_bytes() as f64 / 1e6,
            stats.errors,
        );
    }
    print_errors(&errors, stats.errors, &output);
    Ok(if stats.errors > 0 { EXIT_SKIPPED } else { 0 })
}

/// `SOURCE.stagefs-index` in SOURCE's parent directory.
pub fn default_output(root: &Path) -> anyhow::Result<PathBuf> {
    let (Some(parent), Some(name)) = (root.parent(), root.file_name()) else {
        bail!(
            "{} has no parent directory to write the index beside: give -o FILE",
            root.display()
        );
    };
    let mut file = name.to_os_string();
    file.push(SUFFIX);
    Ok(parent.join(file))
}

/// Entries per second so far.
fn rate(s: &ScanStats) -> f64 {
    s.entries as f64 / s.elapsed.as_secs_f64().max(1e-3)
}

/// One progress line.
fn progress_line(s: &ScanStats) -> String {
    format!(
        "{} entries, {:.0} entries/s, {} dirs pending, {:.0} s",
        s.entries,
        rate(s),
        s.pending_dirs,
        s.elapsed.as_secs_f64()
    )
}

/// Shows progress until the listing is complete: a live line on a terminal, a line every
/// [`LOG_EVERY`] in a log.
fn follow(snap: &Snapshot, quiet: bool) {
    let terminal = !quiet && std::io::stderr().is_terminal();
    let pb = if terminal {
        let pb = ProgressBar::new_spinner();
        pb.set_style(
            ProgressStyle::with_template("{spinner} listing: {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        pb
    } else {
        ProgressBar::hidden()
    };
    let mut last_log = Instant::now();
    // Short sleeps first: a small tree is listed in milliseconds.
    let mut nap = Duration::from_millis(5);
    while !snap.is_complete() {
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(200));
        let s = snap.scan_stats();
        pb.set_message(progress_line(&s));
        pb.tick();
        if !quiet && !terminal && last_log.elapsed() >= LOG_EVERY {
            eprintln!("stagefs index: {}", progress_line(&s));
            last_log = Instant::now();
        }
    }
    pb.finish_and_clear();
}

/// Names the skipped entries (the first [`SHOW_ERRORS`]).
fn print_errors(errors: &[String], total: u64, file: &Path) {
    for e in errors.iter().take(SHOW_ERRORS) {
        eprintln!("stagefs index: skipped: {e}");
    }
    if total as usize > SHOW_ERRORS {
        eprintln!(
            "stagefs index: {} more skipped (`stagefs index --check {}` lists up to 1000)",
            total as usize - SHOW_ERRORS,
            file.display()
        );
    }
}

/// `--check FILE`.
fn check(file: &Path, quiet: bool) -> anyhow::Result<i32> {
    let started = Instant::now();
    let snap = Snapshot::load(file)?;
    let took = started.elapsed();
    let stats = snap.scan_stats();
    let age = SystemTime::now()
        .duration_since(snap.created())
        .unwrap_or_default();
    println!(
        "{}: a valid stagefs index of {}, taken {} ago; {} entries in {} directories, {} \
         skipped; loaded in {:.0} ms ({:.1} MB in memory, {} B/entry; process RSS {:.0} MB)",
        file.display(),
        snap.source_root().display(),
        humantime::format_duration(Duration::from_secs(age.as_secs())),
        stats.entries,
        stats.dirs,
        stats.errors,
        took.as_secs_f64() * 1e3,
        snap.memory_bytes() as f64 / 1e6,
        snap.memory_bytes() / snap.len().max(1),
        rss_bytes() as f64 / 1e6,
    );
    if !quiet {
        for e in snap.errors() {
            println!("skipped: {e}");
        }
    }
    Ok(0)
}

/// This process's resident memory (0 where `/proc` is unavailable): for sizing the daemon.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
