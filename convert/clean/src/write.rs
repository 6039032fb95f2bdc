//! Output: one Parquet file per input file (`part.N.parquet`, N = the input's index in the
//! sorted input list, so names are stable across shards).
//!
//! Row groups are sized for readers, not for our work units: the transformed batches of
//! consecutive units are gathered, in unit order, until a group holds [`GROUP_MAX_ROWS`] rows,
//! or at least [`GROUP_MIN_ROWS`] rows and `group_bytes` of Arrow memory (so a very wide table
//! still fits the memory budget); the last group of a file takes what is left. A group is cut
//! by whichever worker thread completes it, and encoded and compressed by that thread, its
//! columns in parallel on the rayon pool (Parquet's `ArrowColumnWriter` API turns each column
//! into a finished chunk); a per-file sink appends finished groups in order.
//!
//! Files are written under a hidden temporary name, unique and unpredictable and created with
//! O_EXCL (`tempfile`), and renamed onto `part.N.parquet` only when complete: an interrupted
//! job never leaves a truncated part, and two runs into the same OUT never write into each
//! other's files (the last rename wins, each file whole). A failed run removes only its own
//! temporaries (they are deleted when dropped).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, SchemaRef};
use parquet::arrow::arrow_writer::{
    compute_leaves, ArrowColumnChunk, ArrowColumnWriter, ArrowRowGroupWriterFactory,
    ArrowWriterOptions,
};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::ColumnPath;
use rayon::prelude::*;

use super::CleanError;

/// Most rows in an output row group: 1 Mi rows is the top of the range readers are tuned for
/// (pyarrow, polars and DuckDB read a row group per thread; bigger ones only cost memory).
pub const GROUP_MAX_ROWS: usize = 1 << 20;

/// Fewest rows in an output row group (except a file's last): below ~100 k rows per-group
/// overhead (footer entries, page headers, reader start-up per group) starts to show.
pub const GROUP_MIN_ROWS: usize = 128 * 1024;

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

/// Creates a hidden, unique, unpredictable temporary file next to `dest` (O_EXCL; mode 0666
/// less the umask, like the plain file it becomes). Deleted when the handle is dropped.
pub fn temp_beside(dir: &Path, dest_name: &str) -> Result<tempfile::NamedTempFile, CleanError> {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix(&format!(".{dest_name}."))
        .suffix(".tmp")
        .rand_bytes(12)
        .permissions(std::fs::Permissions::from_mode(0o666))
        .tempfile_in(dir)
        .map_err(|e| CleanError::io(dir.join(format!(".{dest_name}.*.tmp")), e))
}

/// Batches gathered for the next row group.
#[derive(Default)]
struct Gather {
    batches: Vec<RecordBatch>,
    rows: usize,
    bytes: usize,
}

struct SinkState {
    writer: Option<SerializedFileWriter<BufWriter<File>>>,
    /// The temporary file being written (removed on drop unless renamed into place).
    tmp: Option<tempfile::TempPath>,
    factory: Option<Arc<ArrowRowGroupWriterFactory>>,
    /// Next unit to gather, and units that finished early.
    next_unit: usize,
    pending: BTreeMap<usize, Vec<RecordBatch>>,
    gather: Gather,
    /// Groups handed out for encoding, the next to append, and those encoded early.
    groups: usize,
    next_group: usize,
    encoded: BTreeMap<usize, Vec<ArrowColumnChunk>>,
    total: Option<usize>,
    done: bool,
    rows: u64,
}

impl SinkState {
    fn new() -> Self {
        SinkState {
            writer: None,
            tmp: None,
            factory: None,
            next_unit: 0,
            pending: BTreeMap::new(),
            gather: Gather::default(),
            groups: 0,
            next_group: 0,
            encoded: BTreeMap::new(),
            total: None,
            done: false,
            rows: 0,
        }
    }

    fn all_gathered(&self) -> bool {
        self.total == Some(self.next_unit)
    }
}

/// The output of one input file.
struct Sink {
    index: usize,
    state: Mutex<SinkState>,
}

/// A row group to encode: its index in the file and its batches.
type Group = (usize, Vec<RecordBatch>);

/// All output files of a run.
pub struct Output {
    dir: PathBuf,
    schema: SchemaRef,
    props: WriterProperties,
    sinks: Vec<Sink>,
    group_bytes: usize,
}

impl Output {
    /// Outputs for the given global input indices (in order), written to `dir`; a row group
    /// holds at most about `group_bytes` of Arrow memory once past [`GROUP_MIN_ROWS`].
    pub fn new(
        dir: &Path,
        schema: SchemaRef,
        codec: Codec,
        indices: &[usize],
        group_bytes: usize,
    ) -> Self {
        let props = properties(&schema, codec);
        let sinks = indices
            .iter()
            .map(|&index| Sink {
                index,
                state: Mutex::new(SinkState::new()),
            })
            .collect();
        Self {
            dir: dir.to_path_buf(),
            schema,
            props,
            sinks,
            group_bytes,
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
        let tmp = temp_beside(&self.dir, &part_name(self.sinks[local].index))?;
        let (file, path) = tmp.into_parts();
        st.tmp = Some(path);
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

    /// Hands over unit `seq`'s transformed batches (possibly none). Gathers units in order
    /// into row groups, encodes any group this completes on the calling thread, appends
    /// finished groups in order, and finishes the file once everything is in.
    pub fn submit(
        &self,
        local: usize,
        seq: usize,
        batches: Vec<RecordBatch>,
    ) -> Result<(), CleanError> {
        let (groups, factory) = {
            let mut st = self.lock(local)?;
            st.pending.insert(seq, batches);
            self.cut(local, &mut st)?
        };
        self.encode_and_append(local, groups, factory)
    }

    /// Declares that the file has `total` units.
    pub fn end(&self, local: usize, total: usize) -> Result<(), CleanError> {
        let (groups, factory) = {
            let mut st = self.lock(local)?;
            st.total = Some(total);
            self.cut(local, &mut st)?
        };
        self.encode_and_append(local, groups, factory)
    }

    /// Moves units that are next in order into the gather, and cuts the groups that are full
    /// (or, once every unit is in, the rest).
    #[allow(clippy::type_complexity)]
    fn cut(
        &self,
        local: usize,
        st: &mut SinkState,
    ) -> Result<(Vec<Group>, Option<Arc<ArrowRowGroupWriterFactory>>), CleanError> {
        let mut groups = Vec::new();
        while let Some(batches) = st.pending.remove(&st.next_unit) {
            st.next_unit += 1;
            for b in batches {
                if b.num_rows() == 0 {
                    continue;
                }
                // A batch that would overflow the group is split at the group's edge.
                let mut b = b;
                loop {
                    let room = GROUP_MAX_ROWS - st.gather.rows;
                    let (head, tail) = if b.num_rows() > room {
                        (b.slice(0, room), Some(b.slice(room, b.num_rows() - room)))
                    } else {
                        (b, None)
                    };
                    st.gather.rows += head.num_rows();
                    st.gather.bytes += head.get_array_memory_size();
                    st.gather.batches.push(head);
                    let full = st.gather.rows >= GROUP_MAX_ROWS
                        || (st.gather.rows >= GROUP_MIN_ROWS
                            && st.gather.bytes >= self.group_bytes);
                    if full {
                        let g = std::mem::take(&mut st.gather);
                        groups.push((st.groups, g.batches));
                        st.groups += 1;
                    }
                    match tail {
                        Some(t) => b = t,
                        None => break,
                    }
                }
            }
        }
        if st.all_gathered() && st.gather.rows > 0 {
            let g = std::mem::take(&mut st.gather);
            groups.push((st.groups, g.batches));
            st.groups += 1;
        }
        if !groups.is_empty() {
            self.open(local, st)?;
        }
        if groups.is_empty() {
            // Nothing to encode; the file may still be complete now (e.g. all rows dropped).
            self.append(local, st)?;
        }
        Ok((groups, st.factory.clone()))
    }

    fn encode_and_append(
        &self,
        local: usize,
        groups: Vec<Group>,
        factory: Option<Arc<ArrowRowGroupWriterFactory>>,
    ) -> Result<(), CleanError> {
        if groups.is_empty() {
            return Ok(());
        }
        let factory =
            factory.ok_or_else(|| CleanError::Data("internal: output writer not open".into()))?;
        for (g, batches) in groups {
            let chunks = self.encode(&factory, g, &batches)?;
            drop(batches);
            let mut st = self.lock(local)?;
            st.encoded.insert(g, chunks);
            self.append(local, &mut st)?;
        }
        Ok(())
    }

    /// Encodes `batches` into finished column chunks (one row group), the columns in
    /// parallel on the rayon pool.
    fn encode(
        &self,
        factory: &ArrowRowGroupWriterFactory,
        g: usize,
        batches: &[RecordBatch],
    ) -> Result<Vec<ArrowColumnChunk>, CleanError> {
        let mut writers = factory.create_column_writers(g)?.into_iter();
        // Leaves per field (a nested field has several), from the first batch.
        let first = batches
            .first()
            .ok_or_else(|| CleanError::Data("internal: empty row group".into()))?;
        let mut per_field: Vec<Vec<ArrowColumnWriter>> = Vec::new();
        for (field, col) in self.schema.fields().iter().zip(first.columns()) {
            let n = compute_leaves(field, col)?.len();
            let ws: Vec<ArrowColumnWriter> = writers.by_ref().take(n).collect();
            if ws.len() != n {
                return Err(CleanError::Data("internal: schema/writer mismatch".into()));
            }
            per_field.push(ws);
        }
        let chunks: Vec<Vec<ArrowColumnChunk>> = per_field
            .into_par_iter()
            .enumerate()
            .map(|(i, mut ws)| -> Result<Vec<ArrowColumnChunk>, CleanError> {
                let field = self.schema.field(i);
                for b in batches {
                    for (w, leaf) in ws.iter_mut().zip(compute_leaves(field, b.column(i))?) {
                        w.write(&leaf)?;
                    }
                }
                Ok(ws
                    .into_iter()
                    .map(|w| w.close())
                    .collect::<Result<Vec<_>, _>>()?)
            })
            .collect::<Result<_, _>>()?;
        Ok(chunks.into_iter().flatten().collect())
    }

    /// Appends every encoded group that is next in order; finishes the file when complete.
    fn append(&self, local: usize, st: &mut SinkState) -> Result<(), CleanError> {
        while let Some(chunks) = st.encoded.remove(&st.next_group) {
            st.next_group += 1;
            let Some(writer) = st.writer.as_mut() else {
                return Err(CleanError::Data("internal: output writer not open".into()));
            };
            let mut rg = writer.next_row_group()?;
            for chunk in chunks {
                chunk.append_to_row_group(&mut rg)?;
            }
            let meta = rg.close()?;
            st.rows += u64::try_from(meta.num_rows()).unwrap_or(0);
        }
        let complete = st.all_gathered() && st.gather.rows == 0 && st.next_group == st.groups;
        if complete && !st.done {
            self.finish(local, st)?;
        }
        Ok(())
    }

    fn finish(&self, local: usize, st: &mut SinkState) -> Result<(), CleanError> {
        // A file whose rows were all dropped is still written: an empty Parquet file with the
        // schema, as pandas/Dask write one.
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
        let to = self.dir.join(part_name(self.sinks[local].index));
        if let Some(tmp) = st.tmp.take() {
            tmp.persist(&to)
                .map_err(|e| CleanError::io(to.clone(), e.error))?;
        }
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
}
