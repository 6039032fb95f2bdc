//! `stagefs convert SRC... OUT --to npy`: writes the mount's `.npy/` views as real files.
//!
//! With one SRC, `OUT/<p>` is byte-identical to `MOUNTPOINT/.npy/<p>` of a mount of SRC with
//! the same image options (both come from `stagefs_views::ViewSet`); with several, each goes to
//! `OUT/<name of SRC>/`. Written: the image view of each SRC (the ImageFolder root it is given)
//! and the views of tables anywhere below; `--all-levels` adds the image views of every
//! subdirectory, as the mount shows them. Files are rendered in parallel (`-j`), each written
//! to a temporary name and renamed into place. Bad inputs are listed (a corrupt image is a zero
//! slot, a corrupt table and an unreadable directory are skipped) and make the exit status 1,
//! unless `--allow-bad`. SIGTERM, SIGINT and SIGHUP remove the temporaries being written
//! before the process exits.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use stagefs_views::image::{DecodeBudget, DecodeSettings};
use stagefs_views::write::{plan, write_file, Levels};
use stagefs_views::{DirSource, ViewError, ViewOptions, ViewSet};

/// (source path, reason) of bad inputs, shared with the views' hook.
type BadList = Arc<Mutex<Vec<(PathBuf, String)>>>;

/// On SIGTERM, SIGINT or SIGHUP: removes the temporaries being written and exits with
/// 128 + the signal, as the default action would, but leaving no hidden partial file in OUT.
fn remove_temporaries_on_signal() -> anyhow::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .context("cannot install signal handlers")?;
    std::thread::Builder::new()
        .name("stagefs-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                stagefs_views::write::remove_temporaries_and_freeze();
                eprintln!("stagefs: stopped by signal {sig}; partial files removed");
                std::process::exit(128 + sig);
            }
        })
        .context("cannot start the signal thread")?;
    Ok(())
}

/// Runs the conversion; returns the process exit code.
pub fn run(args: &super::convert::Args) -> anyhow::Result<i32> {
    let (inputs, out) = args.inputs_and_out();
    remove_temporaries_on_signal()?;
    let mut jobs = Vec::new();
    let mut names = HashSet::new();
    for input in inputs {
        let source = PathBuf::from(input);
        match std::fs::metadata(&source) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("{} does not exist", source.display())
            }
            Err(e) => bail!("cannot read {}: {e}", source.display()),
            Ok(m) if !m.is_dir() => bail!(
                "{} is not a directory: --to npy converts dataset directories",
                source.display()
            ),
            Ok(_) => {}
        }
        let dest = if inputs.len() == 1 {
            out.clone()
        } else {
            let canon = std::fs::canonicalize(&source)
                .with_context(|| format!("cannot resolve {}", source.display()))?;
            let name = canon
                .file_name()
                .map(|n| n.to_os_string())
                .unwrap_or_default();
            if name.is_empty() || !names.insert(name.clone()) {
                bail!(
                    "with several SRC directories each goes to OUT/<its name>; {} has no name \
                     or the same name as another",
                    source.display()
                );
            }
            out.join(name)
        };
        jobs.push((source, dest));
    }
    // Without -j, one worker per core the job has (its affinity mask and cgroup quota).
    let threads = args
        .jobs
        .map_or_else(stagefs_views::job_cores, |j| j.max(1));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("cannot start worker threads")?;
    tracing::debug!(threads, "convert workers");
    // One budget for the whole process, whatever -j is and however many sources.
    let budget = DecodeBudget::new(args.image.decode_budget);
    let bad: BadList = Arc::default();
    let mut written = (0usize, 0u64);
    for (source, dest) in &jobs {
        let (files, bytes) =
            pool.install(|| convert(source, dest, args, budget.clone(), bad.clone()))?;
        written.0 += files;
        written.1 += bytes;
    }
    let mut bad: Vec<(PathBuf, String)> = bad.lock().map(|v| v.clone()).unwrap_or_default();
    bad.sort();
    bad.dedup_by(|a, b| a.0 == b.0);
    if !args.quiet {
        eprintln!(
            "wrote {} files ({} bytes) to {}",
            written.0,
            written.1,
            out.display()
        );
    }
    if bad.is_empty() {
        return Ok(0);
    }
    eprintln!(
        "{} bad input(s) (corrupt images are zeros in images.npy; corrupt tables and unreadable \
         directories were skipped):",
        bad.len()
    );
    for (path, reason) in &bad {
        eprintln!("  {}: {reason}", path.display());
    }
    if args.allow_bad {
        Ok(0)
    } else {
        eprintln!("exiting with status 1; pass --allow-bad to accept these inputs");
        Ok(1)
    }
}

/// Converts one source into `out`; returns (files, bytes) written. Bad inputs go to `bad`,
/// with paths including `source`.
fn convert(
    source: &Path,
    out: &Path,
    args: &super::convert::Args,
    budget: Arc<DecodeBudget>,
    bad: BadList,
) -> anyhow::Result<(usize, u64)> {
    let sink = bad.clone();
    let root = source.to_path_buf();
    let record = move |path: &Path, reason: &str| {
        let full = root.join(path);
        if let Ok(mut v) = sink.lock() {
            if !v.iter().any(|(p, _)| p == &full) {
                tracing::warn!("bad input {}: {reason}", full.display());
                v.push((full, reason.to_string()));
            }
        }
    };
    let record = Arc::new(record);
    let hook = record.clone();
    let opts = ViewOptions {
        image_size: args.image.image_size,
        strict: false,
        on_bad: Some(Arc::new(move |path: &Path, reason: &str| {
            hook(path, reason)
        })),
        decode: DecodeSettings {
            fast: args.image.fast_decode,
            max_pixels: args.image.max_image_pixels,
            budget,
        },
        ..ViewOptions::default()
    };
    let src = Arc::new(DirSource::new(source));
    let set =
        ViewSet::new(src, opts).with_context(|| format!("cannot scan {}", source.display()))?;
    let levels = if args.all_levels {
        Levels::All
    } else {
        Levels::Root
    };
    let plan = plan(&set, levels).context("cannot list the views")?;
    for (path, reason) in &plan.bad {
        record(path, reason);
    }
    if plan.files.is_empty() {
        eprintln!(
            "nothing to convert: no .parquet/.csv tables or .jpg/.jpeg/.png images under {}",
            source.display()
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    // An output directory that cannot be made (a path too long, say) loses its own files only.
    let mut unwritable: Vec<PathBuf> = Vec::new();
    for dir in &plan.dirs {
        if let Err(e) = std::fs::create_dir_all(out.join(dir)) {
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOSPC | libc::EDQUOT | libc::EROFS)
            ) {
                return Err(e)
                    .with_context(|| format!("cannot create {}", out.join(dir).display()));
            }
            record(
                dir,
                &format!("cannot create {}: {e}", out.join(dir).display()),
            );
            unwritable.push(dir.clone());
        }
    }

    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(plan.total_bytes())
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {bytes}/{total_bytes} {bar:40} {bytes_per_sec} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let progress = |n: u64| bar.inc(n);
    let mut files = 0usize;
    for file in &plan.files {
        if unwritable.iter().any(|d| file.rel.starts_with(d)) {
            bar.inc(file.len);
            continue;
        }
        bar.set_message(file.rel.display().to_string());
        match write_file(&set, out, file, &progress) {
            Ok(()) => files += 1,
            Err(ViewError::Corrupt { path, reason })
            | Err(ViewError::Unsupported { path, reason }) => {
                bar.inc(file.len);
                record(&path, &reason);
            }
            Err(e) => {
                bar.abandon();
                return Err(anyhow::Error::new(e))
                    .with_context(|| format!("cannot write {}", out.join(&file.rel).display()));
            }
        }
    }
    bar.finish_and_clear();
    Ok((files, plan.total_bytes()))
}
