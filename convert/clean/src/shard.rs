//! Sharding over a SLURM job array, and the statistics files the array tasks exchange.
//!
//! `--shard I/N` takes input files whose index (in the sorted input list) is ≡ I mod N:
//! round-robin rather than contiguous ranges, so that inputs sorted by date or size spread
//! evenly over the tasks. Output names keep the global index, so N tasks write disjoint files.
//!
//! Statistics: each `--stats-only` task writes `OUT/_stats.shard-I.json` holding one
//! accumulator per input file and column; `--merge-stats` folds all of them in file order into
//! `OUT/_stats.json` — the same fold an unsharded run does, so the statistics are bit-identical.
//! Each file records the plan and the input list, and a mismatch is refused rather than
//! silently giving a different result.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::stats::{Accumulator, AccumulatorJson, ExactF64};
use super::CleanError;

/// Shard I of N.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// This task's index, 0-based.
    pub index: usize,
    /// Number of tasks.
    pub count: usize,
}

impl std::str::FromStr for Shard {
    type Err = CleanError;
    fn from_str(s: &str) -> Result<Self, CleanError> {
        let usage = || {
            CleanError::Usage(format!(
                "--shard {s}: expected I/N with 0 <= I < N, e.g. --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT"
            ))
        };
        let (i, n) = s.split_once('/').ok_or_else(usage)?;
        let index: usize = i.trim().parse().map_err(|_| usage())?;
        let count: usize = n.trim().parse().map_err(|_| usage())?;
        if count == 0 || index >= count {
            return Err(usage());
        }
        Ok(Shard { index, count })
    }
}

impl Shard {
    /// Whether input `i` belongs to this shard.
    pub fn owns(&self, i: usize) -> bool {
        i % self.count == self.index
    }
}

/// Statistics of one column as recorded in a stats file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ColumnStats {
    /// Column name.
    pub name: String,
    /// Values counted (non-null, non-NaN, in rows surviving the earlier steps).
    pub count: u64,
    /// Mean used.
    pub mean: ExactF64,
    /// Standard deviation used (ddof = 1).
    pub std: ExactF64,
}

/// One input file's accumulators (one per standardized column).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct FileStats {
    /// Index in the sorted input list.
    pub index: usize,
    /// Accumulators, in the order of `StatsFile::columns`.
    pub acc: Vec<AccumulatorJson>,
}

/// `_stats.json` and `_stats.shard-I.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StatsFile {
    /// Format version.
    pub version: u32,
    /// The plan these statistics belong to (columns and steps).
    pub plan: String,
    /// Every input file of the job, in index order.
    pub inputs: Vec<String>,
    /// Which shard wrote this file (`None`: the whole input).
    pub shard: Option<Shard>,
    /// The statistics used for each standardized column.
    pub columns: Vec<ColumnStats>,
    /// Per-file accumulators, in file order.
    pub files: Vec<FileStats>,
}

/// Folds per-file accumulators (sorted by file index) into per-column totals.
pub fn fold(files: &[FileStats], ncols: usize) -> Result<Vec<Accumulator>, CleanError> {
    let mut total = vec![Accumulator::default(); ncols];
    for f in files {
        if f.acc.len() != ncols {
            return Err(CleanError::Stats(format!(
                "input {} has {} accumulators, expected {ncols}",
                f.index,
                f.acc.len()
            )));
        }
        for (t, a) in total.iter_mut().zip(&f.acc) {
            let a = a
                .get()
                .ok_or_else(|| CleanError::Stats(format!("input {}: malformed number", f.index)))?;
            *t = t.merge(&a);
        }
    }
    Ok(total)
}

/// Builds the stats file for the given columns from per-file accumulators.
pub fn build(
    plan: &str,
    inputs: &[String],
    shard: Option<Shard>,
    names: &[String],
    mut files: Vec<FileStats>,
) -> Result<StatsFile, CleanError> {
    files.sort_by_key(|f| f.index);
    let total = fold(&files, names.len())?;
    let columns = names
        .iter()
        .zip(&total)
        .map(|(name, a)| ColumnStats {
            name: name.clone(),
            count: a.count,
            mean: a.pandas_mean().into(),
            std: a.pandas_std().into(),
        })
        .collect();
    Ok(StatsFile {
        version: 1,
        plan: plan.to_string(),
        inputs: inputs.to_vec(),
        shard,
        columns,
        files,
    })
}

/// Reads a stats file.
pub fn read(path: &Path) -> Result<StatsFile, CleanError> {
    let text = std::fs::read_to_string(path).map_err(|e| CleanError::io(path.to_path_buf(), e))?;
    serde_json::from_str(&text).map_err(|e| {
        CleanError::Stats(format!("{}: not a stagefs stats file: {e}", path.display()))
    })
}

/// Writes a stats file atomically (a unique temporary name, then rename).
pub fn write(path: &Path, stats: &StatsFile) -> Result<(), CleanError> {
    let text = serde_json::to_string_pretty(stats)
        .map_err(|e| CleanError::Stats(format!("cannot encode statistics: {e}")))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut tmp = super::write::temp_beside(dir, &name)?;
    std::io::Write::write_all(&mut tmp, (text + "\n").as_bytes())
        .map_err(|e| CleanError::io(tmp.path().to_path_buf(), e))?;
    tmp.persist(path)
        .map_err(|e| CleanError::io(path.to_path_buf(), e.error))?;
    Ok(())
}

/// Checks that a stats file belongs to this job (same plan, same inputs).
pub fn check_matches(
    stats: &StatsFile,
    path: &Path,
    plan: &str,
    inputs: &[String],
) -> Result<(), CleanError> {
    if stats.plan != plan {
        return Err(CleanError::Stats(format!(
            "{} was computed for the plan '{}' but this run's plan is '{plan}'; rerun the \
             --stats-only tasks and --merge-stats with the same steps",
            path.display(),
            stats.plan
        )));
    }
    if stats.inputs != inputs {
        return Err(CleanError::Stats(format!(
            "{} was computed over {} input files, this run sees {} (or different names); \
             rerun the --stats-only tasks and --merge-stats",
            path.display(),
            stats.inputs.len(),
            inputs.len()
        )));
    }
    Ok(())
}

/// Merges all `_stats.shard-*.json` in `dir` into one stats file covering every input.
pub fn merge(dir: &Path, plan: &str, inputs: &[String]) -> Result<StatsFile, CleanError> {
    let mut shards: Vec<(Shard, StatsFile)> = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| CleanError::io(dir.to_path_buf(), e))?;
    for entry in entries {
        let entry = entry.map_err(|e| CleanError::io(dir.to_path_buf(), e))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if name.starts_with("_stats.shard-") && name.ends_with(".json") {
            let path = entry.path();
            let s = read(&path)?;
            check_matches(&s, &path, plan, inputs)?;
            let shard = s.shard.ok_or_else(|| {
                CleanError::Stats(format!("{} does not name its shard", path.display()))
            })?;
            shards.push((shard, s));
        }
    }
    let Some((first, _)) = shards.first() else {
        return Err(CleanError::Stats(format!(
            "no _stats.shard-*.json in {}; run the --stats-only --shard I/N tasks first",
            dir.display()
        )));
    };
    let count = first.count;
    let mut seen = vec![false; count];
    for (s, _) in &shards {
        if s.count != count || s.index >= count {
            return Err(CleanError::Stats(format!(
                "shard files disagree on N ({} and {}); remove stale _stats.shard-*.json files",
                count, s.count
            )));
        }
        seen[s.index] = true;
    }
    if let Some(missing) = seen.iter().position(|s| !s) {
        return Err(CleanError::Stats(format!(
            "_stats.shard-{missing}.json is missing in {} (shard {missing}/{count} has not run or failed)",
            dir.display()
        )));
    }
    let names: Vec<String> = shards[0].1.columns.iter().map(|c| c.name.clone()).collect();
    let mut files = Vec::new();
    for (_, s) in shards {
        let these: Vec<String> = s.columns.iter().map(|c| c.name.clone()).collect();
        if these != names {
            return Err(CleanError::Stats(
                "shard files disagree on the columns".into(),
            ));
        }
        files.extend(s.files);
    }
    build(plan, inputs, None, &names, files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_parses_and_selects() {
        let s: Shard = "1/3".parse().expect("test");
        assert_eq!(s, Shard { index: 1, count: 3 });
        assert!(s.owns(4) && !s.owns(3));
        assert!("3/3".parse::<Shard>().is_err());
        assert!("1".parse::<Shard>().is_err());
        assert!("0/0".parse::<Shard>().is_err());
    }
}
