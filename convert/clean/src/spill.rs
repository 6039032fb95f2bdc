//! Pass 1's kept rows, held for pass 2 so that pass 2 never parses the input again.
//!
//! Each work unit's rows that survive the steps before `standardize` are offered to the
//! [`Store`]: they stay in memory while the store's share of the memory budget lasts, and are
//! spilled beyond it to local scratch as one Arrow IPC stream file per unit (IPC is Arrow's
//! own memory layout on disk: written and read back at memory-copy speed, no parsing, no
//! type inference; uncompressed, because scratch is fast and compression would cost more CPU
//! than the saved bytes are worth). Pass 2 takes each unit back in order: from memory, or by
//! reading its file on the worker thread (then deleting it, so scratch use falls as pass 2
//! goes).
//!
//! Scratch is `$SLURM_TMPDIR`, else `$TMPDIR`, else the system temporary directory, inside a
//! private directory (0700, random name) that is removed with the store. If spilling fails
//! (scratch full, unwritable), the store warns once and stops spilling: the units it could not
//! keep are re-read and re-parsed in pass 2, which is slower but gives the same result.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;

use super::CleanError;

/// A unit: (input index in this run, unit index in that input).
pub type UnitKey = (usize, usize);

/// Where a unit kept by pass 1 is.
pub enum Kept {
    /// In memory.
    Memory(Vec<RecordBatch>),
    /// In this IPC stream file on scratch.
    Spilled(PathBuf),
}

/// The scratch directory: `$SLURM_TMPDIR`, `$TMPDIR`, or the system temporary directory.
pub fn default_scratch() -> PathBuf {
    ["SLURM_TMPDIR", "TMPDIR"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .find(|p| p.is_dir())
        .unwrap_or_else(std::env::temp_dir)
}

/// Pass-1 units kept for pass 2, in memory up to a budget, on scratch beyond it.
pub struct Store {
    schema: SchemaRef,
    budget: u64,
    used: AtomicU64,
    scratch: PathBuf,
    dir: Mutex<Option<tempfile::TempDir>>,
    failed: AtomicBool,
    units: Mutex<HashMap<UnitKey, Kept>>,
    spilled_bytes: AtomicU64,
    spilled_units: AtomicU64,
}

impl Store {
    /// A store for batches of `schema`, with `budget` bytes of memory, spilling under `scratch`.
    pub fn new(schema: SchemaRef, budget: u64, scratch: PathBuf) -> Self {
        Store {
            schema,
            budget,
            used: AtomicU64::new(0),
            scratch,
            dir: Mutex::new(None),
            failed: AtomicBool::new(false),
            units: Mutex::new(HashMap::new()),
            spilled_bytes: AtomicU64::new(0),
            spilled_units: AtomicU64::new(0),
        }
    }

    /// Keeps `batches` for unit `key`: in memory if they fit the budget, else on scratch.
    pub fn offer(&self, key: UnitKey, batches: Vec<RecordBatch>) {
        let size: u64 = batches
            .iter()
            .map(|b| b.get_array_memory_size() as u64)
            .sum();
        let prev = self.used.fetch_add(size, Ordering::Relaxed);
        let kept = if prev.saturating_add(size) <= self.budget {
            Kept::Memory(batches)
        } else {
            self.used.fetch_sub(size, Ordering::Relaxed);
            match self.spill(key, &batches) {
                Some(path) => Kept::Spilled(path),
                None => return,
            }
        };
        if let Ok(mut u) = self.units.lock() {
            u.insert(key, kept);
        }
    }

    /// Takes unit `key` back, if it was kept.
    pub fn take(&self, key: UnitKey) -> Option<Kept> {
        let kept = self.units.lock().ok()?.remove(&key)?;
        if let Kept::Memory(b) = &kept {
            let size: u64 = b.iter().map(|b| b.get_array_memory_size() as u64).sum();
            self.used.fetch_sub(size, Ordering::Relaxed);
        }
        Some(kept)
    }

    /// Bytes and units written to scratch so far.
    pub fn spilled(&self) -> (u64, u64) {
        (
            self.spilled_bytes.load(Ordering::Relaxed),
            self.spilled_units.load(Ordering::Relaxed),
        )
    }

    fn spill(&self, key: UnitKey, batches: &[RecordBatch]) -> Option<PathBuf> {
        if self.failed.load(Ordering::Relaxed) {
            return None;
        }
        match self.try_spill(key, batches) {
            Ok(path) => Some(path),
            Err(e) => {
                if !self.failed.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "cannot spill to scratch ({e}); the rest of the input will be parsed \
                         again in pass 2 instead (set $TMPDIR to a larger local directory)"
                    );
                }
                None
            }
        }
    }

    fn try_spill(&self, key: UnitKey, batches: &[RecordBatch]) -> Result<PathBuf, CleanError> {
        let dir = {
            let mut guard = self
                .dir
                .lock()
                .map_err(|_| CleanError::Data("spill lock poisoned".into()))?;
            if guard.is_none() {
                let d = tempfile::Builder::new()
                    .prefix("stagefs-clean-")
                    .tempdir_in(&self.scratch)
                    .map_err(|e| CleanError::io(self.scratch.clone(), e))?;
                *guard = Some(d);
            }
            guard
                .as_ref()
                .map(|d| d.path().to_path_buf())
                .ok_or_else(|| CleanError::Data("no spill directory".into()))?
        };
        // The directory is private and ours; names need only be distinct within it.
        let path = dir.join(format!("{}-{}.arrows", key.0, key.1));
        let result = (|| -> Result<u64, CleanError> {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| CleanError::io(path.clone(), e))?;
            let mut w =
                StreamWriter::try_new(BufWriter::with_capacity(1 << 20, file), &self.schema)?;
            for b in batches {
                w.write(b)?;
            }
            w.finish()?;
            let buf = w.into_inner()?;
            let file = buf
                .into_inner()
                .map_err(|e| CleanError::io(path.clone(), e.into()))?;
            let len = file
                .metadata()
                .map_err(|e| CleanError::io(path.clone(), e))?
                .len();
            Ok(len)
        })();
        match result {
            Ok(len) => {
                self.spilled_bytes.fetch_add(len, Ordering::Relaxed);
                self.spilled_units.fetch_add(1, Ordering::Relaxed);
                Ok(path)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }
}

/// Reads a spilled unit back and deletes its file.
pub fn read_spilled(path: &Path) -> Result<Vec<RecordBatch>, CleanError> {
    let file = File::open(path).map_err(|e| CleanError::io(path.to_path_buf(), e))?;
    let reader = StreamReader::try_new(BufReader::with_capacity(1 << 20, file), None)?;
    let batches = reader.collect::<Result<Vec<_>, _>>()?;
    let _ = std::fs::remove_file(path);
    Ok(batches)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    #[test]
    fn units_past_the_budget_spill_and_come_back_equal() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", DataType::Float64, true),
            Field::new("s", DataType::Utf8, true),
        ]));
        let batch = |i: usize| {
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Float64Array::from(vec![Some(i as f64), None, Some(0.5)])),
                    Arc::new(StringArray::from(vec![Some("a,\"b\""), Some("é"), None])),
                ],
            )
            .expect("test")
        };
        let scratch = tempfile::tempdir().expect("test");
        // Room for one unit in memory: the second spills.
        let one = batch(0).get_array_memory_size() as u64;
        let store = Store::new(schema.clone(), one, scratch.path().to_path_buf());
        store.offer((0, 0), vec![batch(0)]);
        store.offer((0, 1), vec![batch(1), batch(2)]);
        assert_eq!(store.spilled().1, 1);
        assert!(matches!(store.take((0, 0)), Some(Kept::Memory(_))));
        let Some(Kept::Spilled(path)) = store.take((0, 1)) else {
            panic!("unit 1 should have spilled");
        };
        let back = read_spilled(&path).expect("test");
        assert_eq!(back, vec![batch(1), batch(2)]);
        assert!(!path.exists(), "a spill file is deleted once read");
        drop(store);
        assert_eq!(std::fs::read_dir(scratch.path()).expect("test").count(), 0);
    }
}
