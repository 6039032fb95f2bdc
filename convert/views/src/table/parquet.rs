//! Parquet tables: the footer is read once through the [`ByteSource`] (the
//! [`ArrowReaderMetadata`] is kept), a block is a row group, and a block read decodes only that
//! row group and only the projected columns. Null counts come from the column-chunk statistics;
//! a column without them is scanned once at open (its nulls decide its dtype, hence its size).

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::ArrayRef;
use arrow::compute::concat;
use bytes::Bytes;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;
use parquet::errors::ParquetError;
use parquet::file::reader::{ChunkReader, Length};

use super::{BlockReader, ColumnPlan};
use crate::error::ViewError;
use crate::source::ByteSource;

/// One Parquet file of a [`ByteSource`], as parquet's [`ChunkReader`].
#[derive(Clone)]
struct SourceFile {
    src: Arc<dyn ByteSource>,
    rel: Arc<PathBuf>,
    len: u64,
}

impl Length for SourceFile {
    fn len(&self) -> u64 {
        self.len
    }
}

/// Sequential reads of a [`SourceFile`].
struct SourceRead {
    file: SourceFile,
    pos: u64,
}

impl io::Read for SourceRead {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.src.read_at(&self.file.rel, self.pos, buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl ChunkReader for SourceFile {
    type T = SourceRead;

    fn get_read(&self, start: u64) -> parquet::errors::Result<SourceRead> {
        Ok(SourceRead {
            file: self.clone(),
            pos: start,
        })
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let mut buf = vec![0u8; length];
        let mut done = 0;
        while done < length {
            let n = self
                .src
                .read_at(&self.rel, start + done as u64, &mut buf[done..])
                .map_err(|e| ParquetError::External(Box::new(e)))?;
            if n == 0 {
                return Err(ParquetError::EOF(format!(
                    "file ends at {} bytes, wanted {length} bytes at {start}",
                    start + done as u64
                )));
            }
            done += n;
        }
        Ok(Bytes::from(buf))
    }
}

/// Decodes row groups of one Parquet file.
struct ParquetBlocks {
    file: SourceFile,
    meta: ArrowReaderMetadata,
}

impl ParquetBlocks {
    fn read(&self, b: usize, cols: &[usize]) -> Result<Vec<ArrayRef>, String> {
        let mask = ProjectionMask::roots(self.meta.parquet_schema(), cols.iter().copied());
        let rows = self.meta.metadata().row_group(b).num_rows().max(1) as usize;
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(
            self.file.clone(),
            self.meta.clone(),
        )
        .with_projection(mask)
        .with_row_groups(vec![b])
        .with_batch_size(rows)
        .build()
        .map_err(|e| e.to_string())?;
        let mut parts: Vec<Vec<ArrayRef>> = vec![Vec::new(); cols.len()];
        for batch in reader {
            let batch = batch.map_err(|e| e.to_string())?;
            if batch.num_columns() != cols.len() {
                return Err(format!(
                    "decoded {} columns, wanted {}",
                    batch.num_columns(),
                    cols.len()
                ));
            }
            for (j, col) in batch.columns().iter().enumerate() {
                parts[j].push(col.clone());
            }
        }
        parts
            .into_iter()
            .map(|p| match p.len() {
                1 => Ok(p[0].clone()),
                _ => {
                    let refs: Vec<&dyn arrow::array::Array> =
                        p.iter().map(|a| a.as_ref()).collect();
                    if refs.is_empty() {
                        return Err("row group decoded to nothing".into());
                    }
                    concat(&refs).map_err(|e| e.to_string())
                }
            })
            .collect()
    }
}

impl BlockReader for ParquetBlocks {
    fn read_block(&self, b: usize, cols: &[usize]) -> Result<Vec<ArrayRef>, String> {
        match catch_unwind(AssertUnwindSafe(|| self.read(b, cols))) {
            Ok(r) => r,
            Err(_) => Err(format!("Parquet decoder panicked on row group {b}")),
        }
    }
}

type Opened = (Vec<ColumnPlan>, Vec<u64>, Box<dyn BlockReader>);

/// Opens the Parquet file at `rel`: footer, column plans, row-group boundaries.
pub(crate) fn open(src: Arc<dyn ByteSource>, rel: &Path) -> Result<Opened, ViewError> {
    let len = src.len(rel)?;
    let file = SourceFile {
        src,
        rel: Arc::new(rel.to_path_buf()),
        len,
    };
    match catch_unwind(AssertUnwindSafe(|| open_inner(file))) {
        Ok(r) => r.map_err(|e| ViewError::corrupt(rel, e)),
        Err(_) => Err(ViewError::corrupt(
            rel,
            "Parquet reader panicked on this file",
        )),
    }
}

fn open_inner(file: SourceFile) -> Result<Opened, String> {
    let meta = ArrowReaderMetadata::load(&file, ArrowReaderOptions::new())
        .map_err(|e| format!("cannot read the Parquet footer: {e}"))?;
    let md = meta.metadata().clone();
    let mut starts = vec![0u64];
    for rg in md.row_groups() {
        let n = u64::try_from(rg.num_rows()).map_err(|_| "negative row count in a row group")?;
        starts.push(starts[starts.len() - 1] + n);
    }
    let schema = meta.schema().clone();
    let descr = meta.parquet_schema();
    let blocks = ParquetBlocks {
        file,
        meta: meta.clone(),
    };
    let mut columns = Vec::with_capacity(schema.fields().len());
    for (i, field) in schema.fields().iter().enumerate() {
        let mut plan = ColumnPlan::new(field.name().clone(), field.data_type().clone(), 0);
        if plan.dtype.is_some() {
            let leaves: Vec<usize> = (0..descr.num_columns())
                .filter(|&l| descr.get_column_root_idx(l) == i)
                .collect();
            let nulls = match leaves.as_slice() {
                [leaf] if descr.column(*leaf).max_def_level() == 0 => Some(0),
                [leaf] => md
                    .row_groups()
                    .iter()
                    .map(|rg| {
                        rg.column(*leaf)
                            .statistics()
                            .and_then(|s| s.null_count_opt())
                    })
                    .sum::<Option<u64>>(),
                _ => None,
            };
            let nulls = match nulls {
                Some(n) => n,
                None => {
                    let mut n = 0u64;
                    for b in 0..md.num_row_groups() {
                        let arrays = blocks.read(b, &[i])?;
                        n += arrays.first().map(|a| a.null_count() as u64).unwrap_or(0);
                    }
                    n
                }
            };
            plan = ColumnPlan::new(field.name().clone(), field.data_type().clone(), nulls);
        }
        columns.push(plan);
    }
    Ok((columns, starts, Box::new(blocks)))
}
