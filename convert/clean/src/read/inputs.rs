//! Expanding SRC arguments into the list of input files.
//!
//! A glob is expanded here (quoted, the shell left it alone); a directory is walked
//! recursively for `*.csv`, `*.parquet` and `*.pq`, skipping names that start with `.` or `_`
//! (Spark's and Dask's `_SUCCESS` and friends). The result is sorted and de-duplicated, so a
//! file named twice is read once and the output order does not depend on the directory order.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::io_err;
use crate::CleanError;

fn wanted_in_dir(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.starts_with('.') || name.starts_with('_') {
        return false;
    }
    let lower = name.to_ascii_lowercase();
    lower.ends_with(".csv") || lower.ends_with(".parquet") || lower.ends_with(".pq")
}

fn walk(dir: &Path, out: &mut BTreeSet<PathBuf>) -> Result<(), CleanError> {
    let entries = std::fs::read_dir(dir).map_err(|e| io_err(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_err(dir, e))?;
        let path = entry.path();
        let ft = entry.file_type().map_err(|e| io_err(&path, e))?;
        if ft.is_dir() {
            let name = entry.file_name();
            if !name.to_string_lossy().starts_with(['.', '_']) {
                walk(&path, out)?;
            }
        } else if wanted_in_dir(&path) {
            out.insert(path);
        }
    }
    Ok(())
}

/// Expands SRC arguments into a sorted, de-duplicated file list. Directories are walked
/// recursively for `*.csv`, `*.parquet` and `*.pq` (names starting with `.` or `_` skipped, as
/// Spark/Dask do for `_SUCCESS` and friends); quoted globs are expanded here.
pub fn expand_inputs(args: &[String]) -> Result<Vec<PathBuf>, CleanError> {
    let mut files = BTreeSet::new();
    for arg in args {
        if arg.contains(['*', '?', '[']) {
            let paths =
                glob::glob(arg).map_err(|e| CleanError::Usage(format!("bad glob '{arg}': {e}")))?;
            let mut any = false;
            for p in paths {
                let p = p.map_err(|e| CleanError::io(e.path().to_path_buf(), e.into()))?;
                if p.is_dir() {
                    walk(&p, &mut files)?;
                } else {
                    files.insert(p);
                }
                any = true;
            }
            if !any {
                return Err(CleanError::Usage(format!("'{arg}' matches no file")));
            }
        } else {
            let p = PathBuf::from(arg);
            let meta = std::fs::metadata(&p).map_err(|e| io_err(&p, e))?;
            if meta.is_dir() {
                let before = files.len();
                walk(&p, &mut files)?;
                if files.len() == before {
                    return Err(CleanError::Usage(format!(
                        "directory '{arg}' holds no .csv, .parquet or .pq file"
                    )));
                }
            } else {
                files.insert(p);
            }
        }
    }
    if files.is_empty() {
        return Err(CleanError::Usage("no input files".into()));
    }
    Ok(files.into_iter().collect())
}
