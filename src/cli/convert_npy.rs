//! `stagefs convert SOURCE OUT --to npy`: writes the mount's `.npy/` tree as real files.
//!
//! `OUT/<p>` is byte-identical to `MOUNTPOINT/.npy/<p>`: both come from the same views
//! (`stagefs_views::ViewSet`). Files are rendered in parallel (`-j`), each written to a
//! temporary name and renamed into place. Corrupt images are written as zero slots and listed;
//! corrupt tables are skipped and listed; the exit code is 1 when anything was listed, unless
//! `--allow-bad`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use stagefs_views::write::{create_dirs, plan, write_file};
use stagefs_views::{DirSource, ViewError, ViewOptions, ViewSet};

/// Runs the conversion; returns the process exit code.
pub fn run(args: &super::convert::Args) -> anyhow::Result<i32> {
    let (inputs, out) = args.inputs_and_out();
    let [source] = inputs else {
        bail!(
            "--to npy takes one SOURCE directory and the OUT directory (got {} inputs)",
            inputs.len()
        );
    };
    let source = PathBuf::from(source);
    if !source.is_dir() {
        bail!(
            "{} is not a directory: --to npy converts a whole dataset directory",
            source.display()
        );
    }
    if !(1..=8192).contains(&args.image_size) {
        bail!(
            "--image-size {} is out of range (1..=8192)",
            args.image_size
        );
    }
    let mut pool = rayon::ThreadPoolBuilder::new();
    if let Some(j) = args.jobs {
        pool = pool.num_threads(j.max(1));
    }
    let pool = pool.build().context("cannot start worker threads")?;
    pool.install(|| convert(&source, &out, args))
}

fn convert(source: &Path, out: &Path, args: &super::convert::Args) -> anyhow::Result<i32> {
    let bad: Arc<Mutex<Vec<(PathBuf, String)>>> = Arc::default();
    let sink = bad.clone();
    let opts = ViewOptions {
        image_size: args.image_size,
        strict: false,
        on_bad: Some(Arc::new(move |path: &Path, reason: &str| {
            if let Ok(mut v) = sink.lock() {
                if !v.iter().any(|(p, _)| p == path) {
                    tracing::warn!("bad input {}: {reason}", path.display());
                    v.push((path.to_path_buf(), reason.to_string()));
                }
            }
        })),
    };
    let src = Arc::new(DirSource::new(source));
    let set =
        ViewSet::new(src, opts).with_context(|| format!("cannot scan {}", source.display()))?;
    let plan = plan(&set).context("cannot list the views")?;
    if plan.files.is_empty() {
        eprintln!(
            "nothing to convert: no .parquet/.csv tables or .jpg/.jpeg/.png images under {}",
            source.display()
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    create_dirs(&plan, out)
        .with_context(|| format!("cannot create directories under {}", out.display()))?;

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
    for file in &plan.files {
        bar.set_message(file.rel.display().to_string());
        match write_file(&set, out, file, &progress) {
            Ok(()) => {}
            Err(ViewError::Corrupt { path, reason })
            | Err(ViewError::Unsupported { path, reason }) => {
                bar.inc(file.len);
                if let Ok(mut v) = bad.lock() {
                    if !v.iter().any(|(p, _)| p == &path) {
                        v.push((path, reason));
                    }
                }
            }
            Err(e) => {
                bar.abandon();
                return Err(anyhow::Error::new(e))
                    .with_context(|| format!("cannot write {}", out.join(&file.rel).display()));
            }
        }
    }
    bar.finish_and_clear();

    let mut bad: Vec<(PathBuf, String)> = bad.lock().map(|v| v.clone()).unwrap_or_default();
    for b in &plan.bad {
        if !bad.iter().any(|(p, _)| p == &b.0) {
            bad.push(b.clone());
        }
    }
    bad.sort();
    bad.dedup_by(|a, b| a.0 == b.0);
    let total = plan.total_bytes();
    if !args.quiet {
        eprintln!(
            "wrote {} files ({} bytes) to {}",
            plan.files.len(),
            total,
            out.display()
        );
    }
    if bad.is_empty() {
        return Ok(0);
    }
    eprintln!(
        "{} bad input(s) (corrupt images are zeros in images.npy; corrupt tables were skipped):",
        bad.len()
    );
    for (path, reason) in &bad {
        eprintln!("  {}: {reason}", source.join(path).display());
    }
    if args.allow_bad {
        Ok(0)
    } else {
        eprintln!("exiting with status 1; pass --allow-bad to accept these inputs");
        Ok(1)
    }
}
