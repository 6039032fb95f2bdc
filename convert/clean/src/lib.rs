//! The table-cleaning job behind `stagefs convert --to parquet`: CSV/Parquet in, `dropna`,
//! filters and standardization in command-line order, Parquet out — out of core, in parallel,
//! and shardable over a SLURM job array.
//!
//! How a run goes:
//! 1. Expand the inputs, read every schema, resolve the plan: every usage error (missing or
//!    non-numeric column, bad filter) is reported before any data is read.
//! 2. Pass 1 (only with `--standardize`): stream all units, apply the steps before
//!    standardize, accumulate count/mean/M2 per unit; fold in input order. The rows kept by
//!    pass 1 are kept for pass 2 ([`spill::Store`]): in memory up to [`CACHE_SHARE`] of the
//!    budget, beyond that spilled to local scratch as Arrow IPC, so pass 2 never parses the
//!    input again.
//! 3. Pass 2: take the units back in order (or stream them again in a one-pass run), apply
//!    all steps, gather consecutive units into row groups of reader-friendly size and encode
//!    and compress each group, its columns in parallel; append in order per output file.
//!
//! Memory: units are about `chunk` bytes of input and at most `threads + 3` of them are in
//! flight (channel of 2, one being read, one per thread); each costs about four times its
//! size (raw bytes, parsed records, Arrow arrays, encoded pages). The chunk size is chosen so
//! that this working set is half of the budget; the pass-1 store keeps [`CACHE_SHARE`] of it
//! in memory, and a row group being gathered holds at most [`GROUP_SHARE`] of it. A CSV
//! record may be at most 1/8 of the budget ([`RECORD_SHARE`]): a longer one (usually a stray
//! quote) fails the run, naming file and line, instead of growing a buffer without limit.

pub mod csv_decode;
pub mod plan;
pub mod read;
pub mod shard;
pub mod spill;
pub mod stats;
pub mod transform;
pub mod write;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{mpsc, Mutex};

use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use rayon::iter::{ParallelBridge, ParallelIterator};
use rayon::prelude::*;

pub use plan::{parse_filter, parse_selector, Selector, Step};
pub use read::BadRows;
pub use shard::Shard;
pub use write::Codec;

use read::{Input, Kind, Span};
use stats::Accumulator;

/// Share of the memory budget for pass-1 rows kept in memory (the rest spill to scratch).
/// The working set is sized for half the budget; spilling is cheap (IPC at copy speed), so
/// memory beyond a third only saves a little I/O and would risk the budget.
pub const CACHE_SHARE: f64 = 0.3;

/// Share of the memory budget one output row group may gather before it is cut (once it has
/// [`write::GROUP_MIN_ROWS`] rows).
pub const GROUP_SHARE: u64 = 16;

/// A CSV record may be at most 1/`RECORD_SHARE` of the memory budget: decoding a unit costs
/// about four times its size, and a unit holds at least one record.
pub const RECORD_SHARE: u64 = 8;

impl CleanError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CleanError::Io {
            path: path.into(),
            source,
        }
    }
}

/// Errors of the cleaning job.
#[derive(Debug, thiserror::Error)]
pub enum CleanError {
    /// The command line asks for something impossible (checked before any work).
    #[error("{0}")]
    Usage(String),
    /// An input is malformed.
    #[error("{0}")]
    Data(String),
    /// Statistics files are missing or do not match this job.
    #[error("{0}")]
    Stats(String),
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// Arrow failed.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// Parquet failed.
    #[error("parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),
}

/// What to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Compute statistics (or read them) and write the cleaned Parquet files.
    Convert,
    /// Only compute this shard's statistics into `OUT/_stats.shard-I.json`.
    StatsOnly,
    /// Merge `OUT/_stats.shard-*.json` into `OUT/_stats.json`.
    MergeStats,
}

/// Options of a cleaning run.
#[derive(Clone, Debug)]
pub struct CleanOptions {
    /// SRC arguments: directories, files or globs.
    pub inputs: Vec<String>,
    /// Output directory.
    pub out: PathBuf,
    /// Steps in command-line order.
    pub steps: Vec<Step>,
    /// Columns to keep (all when empty), in this order.
    pub columns: Vec<String>,
    /// Output codec.
    pub codec: Codec,
    /// This task's shard.
    pub shard: Option<Shard>,
    /// What to run.
    pub mode: Mode,
    /// Malformed CSV rows: fail or skip.
    pub bad_rows: BadRows,
    /// Memory budget in bytes.
    pub memory_budget: u64,
    /// Worker threads (0: all cores).
    pub threads: usize,
    /// Where pass 1 spills the rows it keeps (`None`: [`spill::default_scratch`]).
    pub scratch: Option<PathBuf>,
}

/// Live counters for a progress display.
#[derive(Debug, Default)]
pub struct Progress {
    /// 0: reading schemas, 1: statistics pass, 2: writing pass, 3: done.
    pub phase: AtomicU8,
    /// Input bytes to process in the current phase.
    pub total_bytes: AtomicU64,
    /// Input bytes processed in the current phase.
    pub bytes: AtomicU64,
    /// Rows read in the current phase.
    pub rows: AtomicU64,
}

impl Progress {
    fn start(&self, phase: u8, total: u64) {
        self.bytes.store(0, Ordering::Relaxed);
        self.rows.store(0, Ordering::Relaxed);
        self.total_bytes.store(total, Ordering::Relaxed);
        self.phase.store(phase, Ordering::Relaxed);
    }
}

/// What a run did.
#[derive(Debug, Default, Clone)]
pub struct Summary {
    /// Input files processed by this task.
    pub files: usize,
    /// Input bytes of those files.
    pub input_bytes: u64,
    /// Rows read (last pass).
    pub rows_read: u64,
    /// Rows written.
    pub rows_written: u64,
    /// Malformed rows skipped (`--bad-rows skip`).
    pub bad_rows: u64,
    /// The first few skipped rows, described.
    pub bad_row_examples: Vec<String>,
    /// Passes over the input made (0 for a merge).
    pub passes: u32,
    /// Units served from the pass-1 store in pass 2 (memory or scratch).
    pub cached_units: u64,
    /// Bytes and units pass 1 spilled to scratch.
    pub spilled: (u64, u64),
    /// Statistics used, per standardized column: (name, mean, std).
    pub stats: Vec<(String, f64, f64)>,
    /// Files written (Parquet parts and/or statistics).
    pub written: Vec<PathBuf>,
}

/// The job's fixed context shared by all threads.
struct Ctx {
    inputs: Vec<Input>,
    /// Index in the sorted list of all inputs, per selected input.
    global: Vec<usize>,
    /// Unified schema of all columns of the inputs.
    file_schema: SchemaRef,
    /// Column indices kept (`--columns`), `None` for all.
    projection: Option<Vec<usize>>,
    /// Schema after projection.
    schema: SchemaRef,
    plan: plan::Resolved,
    bad_rows: BadRows,
    chunk: u64,
    max_record: u64,
    cache_budget: u64,
    group_bytes: u64,
    buffers: read::BufferPool,
}

enum Payload {
    Bytes(Vec<u8>),
    Parquet,
    Cached(Vec<RecordBatch>),
    Spilled(PathBuf),
}

enum Job {
    Unit {
        local: usize,
        seq: usize,
        span: Span,
        payload: Payload,
    },
    End {
        local: usize,
        total: usize,
    },
}

#[derive(Default)]
struct Bad {
    count: AtomicU64,
    examples: Mutex<Vec<String>>,
}

impl Bad {
    fn add(&self, count: u64, examples: Vec<String>) {
        if count == 0 {
            return;
        }
        self.count.fetch_add(count, Ordering::Relaxed);
        if let Ok(mut ex) = self.examples.lock() {
            for e in examples {
                if ex.len() < 5 {
                    ex.push(e);
                }
            }
        }
    }
}

/// Runs a cleaning job; `progress` is updated as it goes.
pub fn run(opts: &CleanOptions, progress: &Progress) -> Result<Summary, CleanError> {
    let mut pool = rayon::ThreadPoolBuilder::new();
    if opts.threads > 0 {
        pool = pool.num_threads(opts.threads);
    }
    let pool = pool
        .build()
        .map_err(|e| CleanError::Usage(format!("cannot start {} threads: {e}", opts.threads)))?;
    pool.install(|| run_in_pool(opts, progress, pool.current_num_threads()))
}

fn input_names(paths: &[PathBuf]) -> Vec<String> {
    paths.iter().map(|p| p.display().to_string()).collect()
}

fn run_in_pool(
    opts: &CleanOptions,
    progress: &Progress,
    threads: usize,
) -> Result<Summary, CleanError> {
    if opts.mode == Mode::StatsOnly && opts.shard.is_none() {
        return Err(CleanError::Usage(
            "--stats-only needs --shard I/N (without sharding, a plain run computes the \
             statistics itself)"
                .into(),
        ));
    }
    let all = read::expand_inputs(&opts.inputs)?;
    let names = input_names(&all);
    let plan_text = plan::describe(&opts.steps, &opts.columns);
    std::fs::create_dir_all(&opts.out).map_err(|e| CleanError::io(opts.out.clone(), e))?;

    if opts.mode == Mode::MergeStats {
        let merged = shard::merge(&opts.out, &plan_text, &names)?;
        let path = opts.out.join("_stats.json");
        shard::write(&path, &merged)?;
        return Ok(Summary {
            files: all.len(),
            stats: stats_summary(&merged),
            written: vec![path],
            ..Summary::default()
        });
    }

    let global: Vec<usize> = (0..all.len())
        .filter(|&i| opts.shard.is_none_or(|s| s.owns(i)))
        .collect();
    progress.start(0, 0);
    let inputs: Vec<Input> = global
        .par_iter()
        .map(|&i| read::open_input(&all[i], max_record(opts)))
        .collect::<Result<_, _>>()?;
    let ctx = if inputs.is_empty() {
        None
    } else {
        Some(make_ctx(opts, inputs, global, threads)?)
    };
    // A shard with no files still validates nothing and writes empty results.
    let mut summary = Summary::default();
    let Some(ctx) = ctx else {
        if opts.mode == Mode::StatsOnly {
            let s = opts.shard.unwrap_or(Shard { index: 0, count: 1 });
            let path = opts.out.join(format!("_stats.shard-{}.json", s.index));
            let sf = shard::build(&plan_text, &names, opts.shard, &[], Vec::new())?;
            shard::write(&path, &sf)?;
            summary.written.push(path);
        }
        return Ok(summary);
    };
    summary.files = ctx.inputs.len();
    summary.input_bytes = ctx.inputs.iter().map(|i| i.size).sum();
    let std_names: Vec<String> = ctx
        .plan
        .standardized
        .iter()
        .map(|&c| ctx.schema.field(c).name().clone())
        .collect();
    let bad = Bad::default();
    let store = spill::Store::new(
        ctx.schema.clone(),
        ctx.cache_budget,
        opts.scratch.clone().unwrap_or_else(spill::default_scratch),
    );
    let sharded = opts.shard.is_some_and(|s| s.count > 1);

    // Statistics: computed here (pass 1), or read from a merged _stats.json for a shard.
    let mut layout: Option<Vec<Vec<Span>>> = None;
    let mut stats_file: Option<shard::StatsFile> = None;
    if ctx.plan.standardize_at.is_some() || opts.mode == Mode::StatsOnly {
        if opts.mode == Mode::Convert && sharded {
            let path = opts.out.join("_stats.json");
            if !path.exists() {
                return Err(CleanError::Stats(format!(
                    "{} not found: a sharded transform uses the statistics of the whole input; \
                     run `--stats-only --shard I/N` for every I, then `--merge-stats`, first \
                     (see scripts/sbatch-clean-array.sh)",
                    path.display()
                )));
            }
            let sf = shard::read(&path)?;
            shard::check_matches(&sf, &path, &plan_text, &names)?;
            let got: Vec<&String> = sf.columns.iter().map(|c| &c.name).collect();
            if got != std_names.iter().collect::<Vec<_>>() {
                return Err(CleanError::Stats(format!(
                    "{} holds statistics for [{}], this run standardizes [{}]",
                    path.display(),
                    sf.columns
                        .iter()
                        .map(|c| c.name.as_str())
                        .collect::<Vec<_>>()
                        .join(","),
                    std_names.join(",")
                )));
            }
            stats_file = Some(sf);
        } else {
            progress.start(1, summary.input_bytes);
            let use_cache = opts.mode == Mode::Convert;
            let (files, spans, rows) =
                pass_stats(&ctx, progress, &bad, use_cache.then_some(&store))?;
            summary.passes += 1;
            summary.rows_read = rows;
            layout = Some(spans);
            let sf = shard::build(&plan_text, &names, opts.shard, &std_names, files)?;
            if opts.mode == Mode::StatsOnly {
                let s = opts.shard.unwrap_or(Shard { index: 0, count: 1 });
                let path = opts.out.join(format!("_stats.shard-{}.json", s.index));
                shard::write(&path, &sf)?;
                summary.written.push(path);
                summary.stats = stats_summary(&sf);
                summary.bad_rows = bad.count.load(Ordering::Relaxed);
                summary.bad_row_examples =
                    bad.examples.lock().map(|e| e.clone()).unwrap_or_default();
                progress.phase.store(3, Ordering::Relaxed);
                return Ok(summary);
            }
            stats_file = Some(sf);
        }
    }
    let moments: Vec<(f64, f64)> = match &stats_file {
        Some(sf) => sf
            .columns
            .iter()
            .map(|c| {
                Ok((
                    c.mean
                        .get()
                        .ok_or_else(|| CleanError::Stats("malformed mean".into()))?,
                    c.std
                        .get()
                        .ok_or_else(|| CleanError::Stats("malformed std".into()))?,
                ))
            })
            .collect::<Result<_, CleanError>>()?,
        None => Vec::new(),
    };

    // Pass 2: transform and write.
    progress.start(2, summary.input_bytes);
    // Bad rows seen in pass 1 are seen again in pass 2 (unless cached); count one pass only.
    let bad2 = Bad::default();
    let out_schema = transform::output_schema(&ctx.schema, &ctx.plan);
    let output = write::Output::new(
        &opts.out,
        out_schema.clone(),
        opts.codec,
        &ctx.global,
        usize::try_from(ctx.group_bytes).unwrap_or(usize::MAX),
    );
    let result = pass_write(
        &ctx,
        progress,
        &bad2,
        &store,
        layout.as_deref(),
        &output,
        &out_schema,
        &moments,
    );
    // On failure the output's temporaries are deleted as it drops; scratch likewise.
    let (rows, cached) = result?;
    output.check_done()?;
    summary.spilled = store.spilled();
    drop(store);
    summary.passes += 1;
    summary.cached_units = cached;
    summary.rows_read = summary.rows_read.max(rows);
    summary.rows_written = output.rows();
    let b = if summary.passes > 1 { &bad } else { &bad2 };
    summary.bad_rows = b.count.load(Ordering::Relaxed);
    summary.bad_row_examples = b.examples.lock().map(|e| e.clone()).unwrap_or_default();
    summary.written = ctx
        .global
        .iter()
        .map(|&i| opts.out.join(write::part_name(i)))
        .collect();
    if !sharded {
        let sf = match stats_file {
            Some(sf) => sf,
            None => shard::build(&plan_text, &names, None, &[], Vec::new())?,
        };
        summary.stats = stats_summary(&sf);
        let path = opts.out.join("_stats.json");
        shard::write(&path, &sf)?;
        summary.written.push(path);
    } else if let Some(sf) = &stats_file {
        summary.stats = stats_summary(sf);
    }
    progress.phase.store(3, Ordering::Relaxed);
    Ok(summary)
}

/// The longest CSV record accepted: 1/[`RECORD_SHARE`] of the budget (floored like the budget).
fn max_record(opts: &CleanOptions) -> u64 {
    opts.memory_budget.max(64 << 20) / RECORD_SHARE
}

fn stats_summary(sf: &shard::StatsFile) -> Vec<(String, f64, f64)> {
    sf.columns
        .iter()
        .map(|c| {
            (
                c.name.clone(),
                c.mean.get().unwrap_or(f64::NAN),
                c.std.get().unwrap_or(f64::NAN),
            )
        })
        .collect()
}

fn make_ctx(
    opts: &CleanOptions,
    inputs: Vec<Input>,
    global: Vec<usize>,
    threads: usize,
) -> Result<Ctx, CleanError> {
    let file_schema = read::unify_schemas(&inputs)?;
    let (projection, schema) = if opts.columns.is_empty() {
        (None, file_schema.clone())
    } else {
        let mut idx = Vec::with_capacity(opts.columns.len());
        for c in &opts.columns {
            let i = file_schema.index_of(c).map_err(|_| {
                CleanError::Usage(format!(
                    "--columns: no column '{c}' in the input (columns: {})",
                    file_schema
                        .fields()
                        .iter()
                        .map(|f| f.name().as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            if idx.contains(&i) {
                return Err(CleanError::Usage(format!("--columns: '{c}' given twice")));
            }
            idx.push(i);
        }
        let schema: Schema = file_schema.project(&idx)?;
        (Some(idx), SchemaRef::new(schema))
    };
    let plan = plan::resolve(&opts.steps, &schema)?;
    let budget = opts.memory_budget.max(64 << 20);
    let in_flight = threads as u64 + 3;
    let chunk = (budget / 2 / 4 / in_flight).clamp(1 << 20, 32 << 20);
    let cache_budget = (budget as f64 * CACHE_SHARE) as u64;
    let group_bytes = budget / GROUP_SHARE;
    Ok(Ctx {
        inputs,
        global,
        file_schema,
        projection,
        schema,
        plan,
        bad_rows: opts.bad_rows,
        chunk,
        max_record: max_record(opts),
        cache_budget,
        group_bytes,
        buffers: read::BufferPool::default(),
    })
}

/// Streams the selected inputs as jobs through a bounded channel to the rayon pool.
/// `layout`: the spans of pass 1 (re-read by offset), or `None` to cut them now.
fn stream<F>(
    ctx: &Ctx,
    layout: Option<&[Vec<Span>]>,
    store: Option<&spill::Store>,
    work: F,
) -> Result<Vec<Vec<Span>>, CleanError>
where
    F: Fn(Job) -> Result<(), CleanError> + Sync,
{
    let (tx, rx) = mpsc::sync_channel::<Job>(2);
    std::thread::scope(|scope| {
        let producer = scope.spawn(move || -> Result<Vec<Vec<Span>>, CleanError> {
            let mut spans_out = Vec::with_capacity(ctx.inputs.len());
            for (local, input) in ctx.inputs.iter().enumerate() {
                let mut spans = Vec::new();
                let mut seq = 0usize;
                let mut send = |span: Span, payload: Payload| -> Result<bool, CleanError> {
                    spans.push(span.clone());
                    let job = Job::Unit {
                        local,
                        seq,
                        span,
                        payload,
                    };
                    seq += 1;
                    Ok(tx.send(job).is_ok())
                };
                let known = layout.map(|l| l[local].as_slice());
                match (input.kind, known) {
                    (_, Some(known)) => {
                        for (s, span) in known.iter().enumerate() {
                            let payload = match store.and_then(|c| c.take((local, s))) {
                                Some(spill::Kept::Memory(b)) => Payload::Cached(b),
                                Some(spill::Kept::Spilled(p)) => Payload::Spilled(p),
                                None => match span {
                                    Span::Csv { offset, len, .. } => {
                                        Payload::Bytes(read::read_span(&input.path, *offset, *len)?)
                                    }
                                    Span::Parquet { .. } => Payload::Parquet,
                                },
                            };
                            if !send(span.clone(), payload)? {
                                return Ok(spans_out);
                            }
                        }
                    }
                    (Kind::Csv, None) => {
                        let mut stopped = false;
                        let (chunk, max) = (ctx.chunk as usize, ctx.max_record as usize);
                        read::csv_chunks(&input.path, chunk, max, &ctx.buffers, |span, bytes| {
                            if !stopped && !send(span, Payload::Bytes(bytes))? {
                                stopped = true;
                            }
                            Ok(())
                        })?;
                        if stopped {
                            return Ok(spans_out);
                        }
                    }
                    (Kind::Parquet, None) => {
                        for span in read::parquet_spans(input, ctx.chunk) {
                            if !send(span, Payload::Parquet)? {
                                return Ok(spans_out);
                            }
                        }
                    }
                }
                if tx.send(Job::End { local, total: seq }).is_err() {
                    return Ok(spans_out);
                }
                spans_out.push(spans);
            }
            Ok(spans_out)
        });
        // A panic in a worker (zstd panics when it cannot allocate a context) becomes this
        // run's error: left to unwind through rayon it stranded the reader thread and the
        // run hung instead of exiting.
        let consumed = rx
            .into_iter()
            .par_bridge()
            .try_for_each(|job| caught(|| work(job)));
        let produced = producer
            .join()
            .map_err(|_| CleanError::Data("reader thread panicked".into()))?;
        consumed?;
        produced
    })
}

/// Runs `f`, turning a panic into a [`CleanError::Data`] that quotes it.
pub fn caught<T>(f: impl FnOnce() -> Result<T, CleanError>) -> Result<T, CleanError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        Err(CleanError::Data(format!(
            "internal failure: {msg} (out of memory? check `ulimit -v` and --memory-budget)"
        )))
    })
}

/// Decodes one unit into batches of the projected schema.
fn load(
    ctx: &Ctx,
    local: usize,
    span: &Span,
    payload: Payload,
    bad: &Bad,
) -> Result<Vec<RecordBatch>, CleanError> {
    let input = &ctx.inputs[local];
    match (span, payload) {
        (_, Payload::Cached(b)) => Ok(b),
        (_, Payload::Spilled(path)) => spill::read_spilled(&path),
        (Span::Csv { offset, header, .. }, Payload::Bytes(bytes)) => {
            let d = read::decode_csv(
                &input.path,
                &ctx.file_schema,
                ctx.projection.as_ref(),
                &bytes,
                *offset,
                *header,
                ctx.bad_rows,
            )?;
            bad.add(d.skipped_count, d.skipped);
            ctx.buffers.put(bytes);
            Ok(d.batches)
        }
        (Span::Parquet { rg, skip, take, .. }, _) => {
            let all: Vec<usize>;
            let proj = match &ctx.projection {
                Some(p) => p.as_slice(),
                None => {
                    all = (0..ctx.file_schema.fields().len()).collect();
                    &all
                }
            };
            read::decode_parquet(input, *rg, *skip, *take, proj, &ctx.schema)
        }
        (Span::Csv { .. }, _) => Err(CleanError::Data("internal: CSV unit without bytes".into())),
    }
}

type StatsResult = (Vec<shard::FileStats>, Vec<Vec<Span>>, u64);

/// Pass 1: per-unit accumulators, folded per file in unit order.
fn pass_stats(
    ctx: &Ctx,
    progress: &Progress,
    bad: &Bad,
    store: Option<&spill::Store>,
) -> Result<StatsResult, CleanError> {
    let ncols = ctx.plan.standardized.len();
    let results: Mutex<HashMap<(usize, usize), Vec<Accumulator>>> = Mutex::new(HashMap::new());
    let spans = stream(ctx, None, None, |job| {
        let Job::Unit {
            local,
            seq,
            span,
            payload,
        } = job
        else {
            return Ok(());
        };
        let batches = load(ctx, local, &span, payload, bad)?;
        let mut acc = vec![Accumulator::default(); ncols];
        let mut kept = Vec::with_capacity(batches.len());
        let mut rows = 0u64;
        for b in &batches {
            rows += b.num_rows() as u64;
            let (k, accs) = transform::accumulate(&ctx.plan, b)?;
            for (t, a) in acc.iter_mut().zip(&accs) {
                *t = t.merge(a);
            }
            if store.is_some() {
                kept.push(k);
            }
        }
        drop(batches);
        if let Some(c) = store {
            c.offer((local, seq), kept);
        }
        if let Ok(mut r) = results.lock() {
            r.insert((local, seq), acc);
        }
        progress.rows.fetch_add(rows, Ordering::Relaxed);
        progress.bytes.fetch_add(span.bytes(), Ordering::Relaxed);
        Ok(())
    })?;
    let results = results
        .into_inner()
        .map_err(|_| CleanError::Data("a worker panicked".into()))?;
    let mut files = Vec::with_capacity(ctx.inputs.len());
    for (local, file_spans) in spans.iter().enumerate() {
        let mut acc = vec![Accumulator::default(); ncols];
        for seq in 0..file_spans.len() {
            if let Some(u) = results.get(&(local, seq)) {
                for (t, a) in acc.iter_mut().zip(u) {
                    *t = t.merge(a);
                }
            }
        }
        files.push(shard::FileStats {
            index: ctx.global[local],
            acc: acc.iter().map(Into::into).collect(),
        });
    }
    Ok((files, spans, progress.rows.load(Ordering::Relaxed)))
}

/// Pass 2: transform, gather into row groups, encode, write. Returns (rows read, units
/// served from the pass-1 store).
#[allow(clippy::too_many_arguments)]
fn pass_write(
    ctx: &Ctx,
    progress: &Progress,
    bad: &Bad,
    store: &spill::Store,
    layout: Option<&[Vec<Span>]>,
    output: &write::Output,
    out_schema: &SchemaRef,
    moments: &[(f64, f64)],
) -> Result<(u64, u64), CleanError> {
    let cached_units = AtomicU64::new(0);
    let split = ctx.plan.standardize_at.unwrap_or(ctx.plan.steps.len());
    stream(ctx, layout, Some(store), |job| match job {
        Job::End { local, total } => output.end(local, total),
        Job::Unit {
            local,
            seq,
            span,
            payload,
        } => {
            let from_cache = matches!(payload, Payload::Cached(_) | Payload::Spilled(_));
            let start = if from_cache {
                cached_units.fetch_add(1, Ordering::Relaxed);
                split
            } else {
                0
            };
            let batches = load(ctx, local, &span, payload, bad)?;
            let mut rows = 0u64;
            let mut out = Vec::with_capacity(batches.len());
            for b in &batches {
                rows += b.num_rows() as u64;
                out.push(transform::transform(
                    &ctx.plan, out_schema, b, start, moments,
                )?);
            }
            drop(batches);
            output.submit(local, seq, out)?;
            if !from_cache {
                progress.rows.fetch_add(rows, Ordering::Relaxed);
            }
            progress.bytes.fetch_add(span.bytes(), Ordering::Relaxed);
            Ok(())
        }
    })?;
    Ok((
        progress.rows.load(Ordering::Relaxed),
        cached_units.load(Ordering::Relaxed),
    ))
}

/// Convenience for tests and callers: the output file of input `index` in `out`.
pub fn part_path(out: &Path, index: usize) -> PathBuf {
    out.join(write::part_name(index))
}
