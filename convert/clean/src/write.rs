//! Output: one Parquet file per input file (`part.N.parquet`, N = the input's index in the
//! sorted input list, so names are stable across shards), each work unit one row group.
//!
//! Units are encoded and compressed in parallel (Parquet's `ArrowColumnWriter` API: each
//! thread turns its batches into finished column chunks); a per-file sink then appends the
//! chunks in unit order, holding back units that finish early. Files are written under a
//! hidden temporary name and renamed when complete, so an interrupted job never leaves a
//! truncated `part.N.parquet` that the next job would read.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, SchemaRef};
use parquet::arrow::arrow_writer::{
    compute_leaves, ArrowColumnChunk, ArrowRowGroupWriterFactory, ArrowWriterOptions,
};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::ColumnPath;

use super::CleanError;

/// Output compression codec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// zstd at level 1: near-snappy speed, clearly smaller files.
    Zstd,
    /// snappy.
    Snappy,
    /// No compression.
    None,
}

impl std::str::FromStr for Codec {
    type Err = CleanError;
    fn from_str(s: &str) -> Result<Self, CleanError> {
        match s.to_ascii_lowercase().as_str() {
            "zstd" => Ok(Codec::Zstd),
            "snappy" => Ok(Codec::Snappy),
            "none" | "uncompressed" => Ok(Codec::None),
            other => Err(CleanError::Usage(format!(
                "--compression {other}: use zstd, snappy or none"
            ))),
        }
    }
}

/// Writer properties: the codec, and dictionary encoding only for text columns (dictionaries
/// of random floats grow to the page limit and are then thrown away, costing time for nothing).
pub fn properties(schema: &SchemaRef, codec: Codec) -> WriterProperties {
    let compression = match codec {
        Codec::Zstd => Compression::ZSTD(ZstdLevel::default()),
        Codec::Snappy => Compression::SNAPPY,
        Codec::None => Compression::UNCOMPRESSED,
    };
    let mut b = WriterProperties::builder()
        .set_compression(compression)
        .set_dictionary_enabled(false)
        .set_created_by(format!("stagefs {}", env!("CARGO_PKG_VERSION")));
    for f in schema.fields() {
        if matches!(
            f.data_type(),
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
        ) {
            b = b.set_column_dictionary_enabled(ColumnPath::from(f.name().as_str()), true);
        }
    }
    b.build()
}

/// File name of input `index`'s output.
pub fn part_name(index: usize) -> String {
    format!("part.{index}.parquet")
}

struct SinkState {
    writer: Option<SerializedFileWriter<BufWriter<File>>>,
    factory: Option<Arc<ArrowRowGroupWriterFactory>>,
    next: usize,
    pending: BTreeMap<usize, Vec<ArrowColumnChunk>>,
    total: Option<usize>,
    done: bool,
    rows: u64,
}

/// The output of one input file.
struct Sink {
    index: usize,
    state: Mutex<SinkState>,
}

/// All output files of a run.
pub struct Output {
    dir: PathBuf,
    schema: SchemaRef,
    props: WriterProperties,
    sinks: Vec<Sink>,
}

fn tmp_path(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!(".{}.tmp", part_name(index)))
}

impl Output {
    /// Outputs for the given global input indices (in order), written to `dir`.
    pub fn new(dir: &Path, schema: SchemaRef, codec: Codec, indices: &[usize]) -> Self {
        let props = properties(&schema, codec);
        let sinks = indices
            .iter()
            .map(|&index| Sink {
                index,
                state: Mutex::new(SinkState {
                    writer: None,
                    factory: None,
                    next: 0,
                    pending: BTreeMap::new(),
                    total: None,
                    done: false,
                    rows: 0,
                }),
            })
            .collect();
        Self {
            dir: dir.to_path_buf(),
            schema,
            props,
            sinks,
        }
    }

    fn lock(&self, local: usize) -> Result<std::sync::MutexGuard<'_, SinkState>, CleanError> {
        self.sinks[local]
            .state
            .lock()
            .map_err(|_| CleanError::Data("a writer thread panicked".into()))
    }

    fn open(&self, local: usize, st: &mut SinkState) -> Result<(), CleanError> {
        if st.writer.is_some() {
            return Ok(());
        }
        let path = tmp_path(&self.dir, self.sinks[local].index);
        let file = File::create(&path).map_err(|e| CleanError::io(path.clone(), e))?;
        let options = ArrowWriterOptions::new().with_properties(self.props.clone());
        let (writer, factory) = ArrowWriter::try_new_with_options(
            BufWriter::with_capacity(1 << 20, file),
            self.schema.clone(),
            options,
        )?
        .into_serialized_writer()?;
        st.writer = Some(writer);
        st.factory = Some(Arc::new(factory));
        Ok(())
    }

    /// Encodes `batches` into finished column chunks (one row group), on the calling thread.
    pub fn encode(
        &self,
        local: usize,
        seq: usize,
        batches: &[RecordBatch],
    ) -> Result<Vec<ArrowColumnChunk>, CleanError> {
        if batches.iter().all(|b| b.num_rows() == 0) {
            return Ok(Vec::new());
        }
        let factory = {
            let mut st = self.lock(local)?;
            self.open(local, &mut st)?;
            st.factory.clone()
        };
        let Some(factory) = factory else {
            return Err(CleanError::Data("output writer not open".into()));
        };
        let mut writers = factory.create_column_writers(seq)?;
        for batch in batches {
            let mut w = writers.iter_mut();
            for (field, col) in self.schema.fields().iter().zip(batch.columns()) {
                for leaf in compute_leaves(field, col)? {
                    match w.next() {
                        Some(writer) => writer.write(&leaf)?,
                        None => return Err(CleanError::Data("schema/writer mismatch".into())),
                    }
                }
            }
        }
        Ok(writers
            .into_iter()
            .map(|w| w.close())
            .collect::<Result<Vec<_>, _>>()?)
    }

    /// Hands over unit `seq`'s row group (possibly empty); appends every unit that is now next
    /// in order, and finishes the file once all its units are in.
    pub fn submit(
        &self,
        local: usize,
        seq: usize,
        chunks: Vec<ArrowColumnChunk>,
    ) -> Result<(), CleanError> {
        let mut st = self.lock(local)?;
        st.pending.insert(seq, chunks);
        self.drain(local, &mut st)
    }

    /// Declares that the file has `total` units.
    pub fn end(&self, local: usize, total: usize) -> Result<(), CleanError> {
        let mut st = self.lock(local)?;
        st.total = Some(total);
        self.drain(local, &mut st)
    }

    fn drain(&self, local: usize, st: &mut SinkState) -> Result<(), CleanError> {
        while let Some(chunks) = st.pending.remove(&st.next) {
            st.next += 1;
            if chunks.is_empty() {
                continue;
            }
            self.open(local, st)?;
            let Some(writer) = st.writer.as_mut() else {
                return Err(CleanError::Data("output writer not open".into()));
            };
            let mut rg = writer.next_row_group()?;
            for chunk in chunks {
                chunk.append_to_row_group(&mut rg)?;
            }
            let meta = rg.close()?;
            st.rows += meta.num_rows().max(0) as u64;
        }
        if st.total == Some(st.next) && !st.done {
            self.finish(local, st)?;
        }
        Ok(())
    }

    fn finish(&self, local: usize, st: &mut SinkState) -> Result<(), CleanError> {
        self.open(local, st)?;
        if let Some(writer) = st.writer.take() {
            let buf = writer.into_inner()?;
            let file = buf
                .into_inner()
                .map_err(|e| CleanError::io(self.dir.clone(), e.into()))?;
            drop(file);
        }
        st.factory = None;
        st.done = true;
        let index = self.sinks[local].index;
        let to = self.dir.join(part_name(index));
        let from = tmp_path(&self.dir, index);
        std::fs::rename(&from, &to).map_err(|e| CleanError::io(to, e))?;
        Ok(())
    }

    /// Rows written so far to all files.
    pub fn rows(&self) -> u64 {
        self.sinks
            .iter()
            .map(|s| s.state.lock().map(|st| st.rows).unwrap_or(0))
            .sum()
    }

    /// Checks that every file was completed.
    pub fn check_done(&self) -> Result<(), CleanError> {
        for local in 0..self.sinks.len() {
            let st = self.lock(local)?;
            if !st.done {
                return Err(CleanError::Data(format!(
                    "internal: output {} incomplete",
                    part_name(self.sinks[local].index)
                )));
            }
        }
        Ok(())
    }

    /// Removes temporary files after a failure (best effort).
    pub fn cleanup(&self) {
        for s in &self.sinks {
            let _ = std::fs::remove_file(tmp_path(&self.dir, s.index));
        }
    }
}
