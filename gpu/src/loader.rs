//! The training-loop loader: aligned rows of several `.npy` files, batch by batch, epoch by
//! epoch, into a ring of K slots that the consumer holds as long as it uses a batch.
//!
//! A [`Loader`] opens N sources with the same first dimension (e.g. `images.npy` and
//! `labels.npy`) and allocates a ring of K slots once; each slot holds one batch of every source,
//! each part at a [`PART_ALIGN`]-aligned offset. [`Loader::epoch`] starts one pass: the rows of
//! this rank in order ([`epoch_order`]: `DistributedSampler`'s split, shuffled by seed and epoch),
//! a dispatcher handing each batch a free slot in order (so the batch the consumer needs next
//! always gets one and the pipeline cannot deadlock), and reader threads that fill a slot with
//! positioned reads — one per run of consecutive rows, so an unshuffled batch is one large read
//! per source — then enqueue its copy to the device. [`Epoch::next`] hands out batches in order
//! as [`LoadedBatch`]es, which own their slot (through an `Arc` of the ring, so a batch may
//! outlive its epoch and the loader) and give it back when dropped.
//!
//! [`Loader::epoch_from`] starts an epoch part-way, after `start` positions of its permutation
//! ([`epoch_order_from`]): a resumed run, possibly under another world size. With a
//! [`Transform`] in the config the readers turn each row of the first source into its
//! augmented, converted row ([`crate::augment`]); the slot is sized for the output rows.
//!
//! Memory is K slots whatever the dataset size. A consumer that keeps every slot and asks for
//! more gets [`StreamError::RingHeld`] instead of a hang. Dropping an [`Epoch`] early (a
//! `break` out of the training loop) cancels its readers and returns the slots it held.
//!
//! Reads are positioned reads (`pread`) rather than a memory map: a map turns an I/O error or a
//! file truncated under us into SIGBUS, which would kill the training program instead of raising
//! an error that names the file. For rows of images (150 KB) a `pread` per row costs the same CPU
//! as a copy out of a map; for rows of a few bytes it costs a system call each, so small-row
//! sources read in a scattered order are held in memory ([`SMALL_ROW`], [`RESIDENT_BYTES`]).
//! The measurements are in docs/loader.md#reference (`gpu/examples/read_methods.rs`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use stagefs_npy::DType;

use crate::augment::{Geometry, Scratch, Table, Transform};
use crate::bounds::{check_counts, MAX_BATCH_BYTES};
use crate::device::{Device, StreamKind};
use crate::error::StreamError;
use crate::hints::Hinter;
pub use crate::order::{epoch_order, epoch_order_from};
use crate::partition::{node_epoch_order, NodeLayout, Segment};
use crate::ring::{Fill, Ring, Run, Watch};
use crate::source::Source;
use crate::stats::{add_since, Stats};

/// Each source's part of a slot starts at a multiple of this many bytes: DLPack asks for
/// 256-byte aligned tensors, and it covers every element type.
pub const PART_ALIGN: u64 = 256;

/// Rows smaller than this are not read one `pread` each when the order scatters them (shuffled,
/// or strided across ranks): a system call per 8-byte label costs 34× the CPU of a copy from
/// memory (1 M shuffled int64 rows: 0.65 s vs 0.02 s, `gpu/examples/read_methods.rs`). Such
/// sources are read whole, once, into memory instead (up to [`RESIDENT_BYTES`] in all).
pub const SMALL_ROW: u64 = 4096;

/// At most this many bytes of small-row sources are kept in memory (labels, table columns and
/// feature matrices of up to millions of rows); beyond it they are read row by row.
pub const RESIDENT_BYTES: u64 = 256 << 20;

/// Reads whole, once, the small-row sources that a scattered order would read row by row.
fn read_resident(sources: &[Source], scattered: bool) -> Result<Vec<Option<Vec<u8>>>, StreamError> {
    let mut budget = RESIDENT_BYTES;
    sources
        .iter()
        .map(|s| {
            let bytes = s.data_bytes();
            if !scattered || s.row_bytes >= SMALL_ROW || bytes > budget {
                return Ok(None);
            }
            budget -= bytes;
            // Fits in usize: at most RESIDENT_BYTES.
            let mut data = Vec::new();
            data.try_reserve_exact(bytes as usize).map_err(|e| {
                StreamError::Config(format!(
                    "{}: cannot hold {bytes} bytes: {e}",
                    s.path.display()
                ))
            })?;
            data.resize(bytes as usize, 0);
            s.read_rows(&mut data, 0)?;
            Ok(Some(data))
        })
        .collect()
}

/// How a [`Loader`] cuts and orders the rows.
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    /// Rows per batch (the last batch of an epoch may have fewer unless `drop_last`).
    pub batch_size: u64,
    /// Shuffle the rows of every epoch (seeded by `seed` and the epoch).
    pub shuffle: bool,
    /// The shuffle's seed.
    pub seed: u64,
    /// Drop the last batch of an epoch when it is short.
    pub drop_last: bool,
    /// This process's rank among `world_size` data-parallel ranks.
    pub rank: u64,
    /// Number of data-parallel ranks (each gets 1/world_size of the rows).
    pub world_size: u64,
    /// Ring slots K: batches read ahead or held by the consumer at once.
    pub ring: usize,
    /// Reader threads (clamped to `ring`).
    pub readers: usize,
    /// Augmentation of the first source's image rows, done by the readers.
    pub transform: Option<Transform>,
    /// Tell a stagefs mount holding the files which rows are read next ([`crate::hints`]).
    pub hints: bool,
    /// Read files on a stagefs mount through direct descriptors of their verified copies
    /// where the daemon grants them ([`crate::direct`]); the others through the mount.
    pub direct: bool,
    /// Keep each node on its own part of the rows ([`crate::partition`]); `None`: split one
    /// global permutation as `DistributedSampler` does.
    pub partition: Option<NodeLayout>,
}

impl Default for LoaderConfig {
    /// 256 rows, file order, one rank; 4 slots (the consumer holds one, three are read ahead)
    /// and 2 readers, as [`crate::StreamConfig`].
    fn default() -> Self {
        LoaderConfig {
            batch_size: 256,
            shuffle: false,
            seed: 0,
            drop_last: false,
            rank: 0,
            world_size: 1,
            ring: 4,
            readers: 2,
            transform: None,
            hints: true,
            direct: true,
            partition: None,
        }
    }
}

/// One source's part of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// Index of the source in the list given to [`Loader::new`].
    pub source: usize,
    /// Byte offset of the part in the slot's buffer.
    pub offset: usize,
    /// Bytes of the part.
    pub len: usize,
    /// Element type (None for a raw source).
    pub dtype: Option<DType>,
    /// Shape: the batch's rows, then the source's row shape.
    pub shape: Vec<u64>,
}

/// One source's row as it lands in a slot.
struct OutRow {
    bytes: u64,
    dtype: Option<DType>,
    shape: Vec<u64>,
}

/// What the loader, its epochs' threads and the batches in the consumer's hands share.
struct Shared<D: Device> {
    ring: Ring<D>,
    sources: Vec<Source>,
    /// Offset of each source's part in a slot.
    offsets: Vec<usize>,
    /// Each source's part as handed out: bytes, dtype and shape of one row (after the
    /// transform, for the first source).
    out_rows: Vec<OutRow>,
    /// The first source's transform, the geometry of its rows and its conversion table.
    transform: Option<(Transform, Geometry, Table)>,
    /// The whole data of each small-row source read in scattered order (see [`RESIDENT_BYTES`]).
    resident: Vec<Option<Vec<u8>>>,
    /// Direct descriptors of the files' verified copies (the connection holding their pins
    /// lives as long as the sources that read them: batches may outlive the loader), and why
    /// the other files have none.
    direct: crate::direct::DirectReads,
    /// Whether an epoch is running (only one may: two would compete for slots).
    running: AtomicBool,
    /// Nanoseconds spent in finished epochs, and when the running one started.
    busy_ns: AtomicU64,
    epoch_start: Mutex<Option<Instant>>,
}

impl<D: Device> Shared<D> {
    /// Adds the running epoch's time to the busy time, once.
    fn end_epoch(&self) {
        if let Some(start) = self
            .epoch_start
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            self.busy_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }
}

/// Aligned rows of several `.npy` files, batch by batch, through a ring of K slots.
pub struct Loader<D: Device> {
    shared: Arc<Shared<D>>,
    config: LoaderConfig,
    rows: u64,
    readers: usize,
    slot_bytes: usize,
    /// The hint socket of the mount holding the files (`None`: not on a mount, or off).
    hints: Option<Arc<Hinter>>,
}

impl<D: Device> Loader<D> {
    /// Checks the sources and the settings and allocates the ring on `device`.
    pub fn new(
        device: Arc<D>,
        mut sources: Vec<Source>,
        mut config: LoaderConfig,
    ) -> Result<Self, StreamError> {
        let first = sources
            .first()
            .ok_or_else(|| StreamError::Config("no files to load".into()))?;
        let rows = first.rows;
        if let Some(other) = sources.iter().find(|s| s.rows != rows) {
            return Err(StreamError::Config(format!(
                "{} has {} rows but {} has {}: the files must have the same first dimension",
                first.path.display(),
                rows,
                other.path.display(),
                other.rows
            )));
        }
        if config.batch_size == 0 {
            return Err(StreamError::Config("batch_size must be at least 1".into()));
        }
        if config.world_size == 0 || config.rank >= config.world_size {
            return Err(StreamError::Config(format!(
                "rank {} is not in 0..world_size ({})",
                config.rank, config.world_size
            )));
        }
        if let Some(p) = &mut config.partition {
            p.check(config.world_size)?;
            if p.grid.is_none() {
                // Cut on the file with the largest rows: it holds most of the bytes.
                let s = sources.iter().max_by_key(|s| s.row_bytes).unwrap_or(first);
                p.grid = Some(crate::partition::Grid {
                    offset: s.offset,
                    row_bytes: s.row_bytes.max(1),
                    chunk_bytes: crate::partition::CHUNK_BYTES,
                });
            }
        }
        if config.ring == 0 {
            return Err(StreamError::Config(
                "the ring needs at least 1 slot (2 or more to read ahead)".into(),
            ));
        }
        check_counts(rows, config.ring, config.readers)?;
        let mut out_rows: Vec<OutRow> = sources
            .iter()
            .map(|s| OutRow {
                bytes: s.row_bytes,
                dtype: s.dtype,
                shape: s.row_shape.clone(),
            })
            .collect();
        let transform = match &config.transform {
            None => None,
            Some(t) => {
                let geom = t
                    .check(&first.row_shape, first.dtype)
                    .map_err(|e| match e {
                        StreamError::Config(m) => {
                            StreamError::Config(format!("{}: {m}", first.path.display()))
                        }
                        e => e,
                    })?;
                out_rows[0] = OutRow {
                    bytes: t.out_row_bytes(geom),
                    dtype: Some(t.out_dtype()),
                    shape: t.out_shape(geom),
                };
                Some((t.clone(), geom, t.table(geom.channels)))
            }
        };
        // A batch never has more rows than a rank's share (no slot larger than the data).
        let batch_rows = config
            .batch_size
            .min(rows.div_ceil(config.world_size))
            .max(1);
        let mut offsets = Vec::with_capacity(sources.len());
        let mut end = 0u64;
        for s in &out_rows {
            let start = end.checked_next_multiple_of(PART_ALIGN);
            let stop = batch_rows
                .checked_mul(s.bytes)
                .and_then(|b| b.checked_add(start?));
            match (start, stop) {
                (Some(start), Some(stop)) if stop <= MAX_BATCH_BYTES => {
                    offsets.push(start as usize);
                    end = stop;
                }
                _ => {
                    return Err(StreamError::Config(format!(
                        "batches of {} rows take more than {} GiB; use a smaller batch_size",
                        batch_rows,
                        MAX_BATCH_BYTES >> 30
                    )))
                }
            }
        }
        let slot_bytes = usize::try_from(end)
            .map_err(|_| StreamError::Config("batch too large for this platform".into()))?;
        let ring = Ring::new(device, config.ring, slot_bytes, "loader")?;
        let readers = config.readers.clamp(1, config.ring);
        let all: Vec<usize> = (0..sources.len()).collect();
        let direct = if config.direct {
            crate::direct::DirectReads::open(&mut sources, &all)
        } else {
            crate::direct::DirectReads::off()
        };
        let resident = read_resident(&sources, config.shuffle || config.world_size > 1)?;
        // Files read whole into memory are read once, in order: no hints for them; nor for
        // direct files (the daemon's pushes fill the mount's pages; they are advised instead).
        let hinted: Vec<usize> = (0..sources.len())
            .filter(|&i| resident[i].is_none())
            .filter(|&i| direct.files().iter().all(|(d, _)| *d != i))
            .collect();
        let hints = config
            .hints
            .then(|| Hinter::connect(&sources, &hinted))
            .flatten()
            .map(Arc::new);
        Ok(Loader {
            shared: Arc::new(Shared {
                ring,
                sources,
                offsets,
                out_rows,
                transform,
                resident,
                direct,
                running: AtomicBool::new(false),
                busy_ns: AtomicU64::new(0),
                epoch_start: Mutex::new(None),
            }),
            config,
            rows,
            readers,
            slot_bytes,
            hints,
        })
    }

    /// Per file: its path and `None` if it is read through a direct descriptor, else why not
    /// (empty with `direct` off).
    pub fn direct_status(&self) -> &[(std::path::PathBuf, Option<String>)] {
        self.shared.direct.status()
    }

    /// Rows in each source.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Rows this rank visits per epoch (padded as `DistributedSampler` pads).
    pub fn rows_per_rank(&self) -> u64 {
        self.rows.div_ceil(self.config.world_size)
    }

    /// Batches per epoch.
    pub fn batches_per_epoch(&self) -> u64 {
        self.batches_from(0)
    }

    /// Batches of the rest of an epoch after `start` positions of its permutation were
    /// consumed ([`epoch_order_from`]).
    pub fn batches_from(&self, start: u64) -> u64 {
        let rows = match &self.config.partition {
            Some(_) => self.order_from(0, start).len() as u64,
            None => self
                .rows
                .saturating_sub(start)
                .div_ceil(self.config.world_size),
        };
        self.batches_of(rows)
    }

    /// Batches of the rest of an epoch after the runs `before` of it ([`Loader::order_after`]).
    pub fn batches_after(&self, before: &[Segment]) -> u64 {
        self.batches_of(self.order_after(0, before).len() as u64)
    }

    /// Batches of a rank's order of `rows` positions.
    fn batches_of(&self, rows: u64) -> u64 {
        if self.config.drop_last {
            rows / self.config.batch_size
        } else {
            rows.div_ceil(self.config.batch_size)
        }
    }

    /// The settings.
    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// The sources, in the order given.
    pub fn sources(&self) -> &[Source] {
        &self.shared.sources
    }

    /// The device batches land on.
    pub fn device(&self) -> &Arc<D> {
        &self.shared.ring.device
    }

    /// Bytes of one slot (host and device memory are K slots each).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The rows this rank visits in `epoch`, in order ([`epoch_order`]).
    pub fn order(&self, epoch: u64) -> Vec<u64> {
        self.order_from(epoch, 0)
    }

    /// The rows this rank visits in the rest of `epoch` from `start` ([`epoch_order_from`]).
    pub fn order_from(&self, epoch: u64, start: u64) -> Vec<u64> {
        let c = &self.config;
        if let Some(p) = &c.partition {
            let before = (start > 0).then(|| p.segment(c.world_size, start));
            return self.order_after(epoch, before.as_slice());
        }
        epoch_order_from(
            self.rows,
            c.shuffle,
            c.seed,
            epoch,
            start,
            c.rank,
            c.world_size,
        )
    }

    /// The rows this rank visits in the rest of `epoch` after the runs `before` of it
    /// ([`crate::partition::node_epoch_order`]); without a node partition, after the positions
    /// they consumed together.
    pub fn order_after(&self, epoch: u64, before: &[Segment]) -> Vec<u64> {
        let c = &self.config;
        match &c.partition {
            Some(p) => node_epoch_order(
                &p.order(self.rows, c.shuffle, c.seed),
                epoch,
                before,
                c.world_size / p.local_world_size,
                p.local_world_size,
                c.rank,
            ),
            None => self.order_from(epoch, before.iter().map(|s| s.consumed).sum()),
        }
    }

    /// Counters over all epochs so far; `elapsed` is the time spent inside epochs.
    pub fn stats(&self) -> Stats {
        let shared = &self.shared;
        let mut busy = Duration::from_nanos(shared.busy_ns.load(Ordering::Relaxed));
        if let Some(start) = *shared
            .epoch_start
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
        {
            busy += start.elapsed();
        }
        Stats::from_counters(&shared.ring.counters, busy, self.readers)
    }

    /// Starts epoch `epoch`: reading begins at once. Only one epoch runs at a time; drop the
    /// previous one first.
    pub fn epoch(&self, epoch: u64) -> Result<Epoch<D>, StreamError> {
        self.epoch_from(epoch, 0)
    }

    /// Starts the rest of epoch `epoch` after `start` positions of its permutation were
    /// consumed by all ranks together (a resumed epoch, [`epoch_order_from`]).
    pub fn epoch_from(&self, epoch: u64, start: u64) -> Result<Epoch<D>, StreamError> {
        self.epoch_with(epoch, self.order_from(epoch, start))
    }

    /// Starts the rest of epoch `epoch` after the runs `before` of it ([`Loader::order_after`]).
    pub fn epoch_after(&self, epoch: u64, before: &[Segment]) -> Result<Epoch<D>, StreamError> {
        self.epoch_with(epoch, self.order_after(epoch, before))
    }

    /// Starts an epoch that visits `order`.
    fn epoch_with(&self, epoch: u64, order: Vec<u64>) -> Result<Epoch<D>, StreamError> {
        let shared = &self.shared;
        if shared.running.swap(true, Ordering::AcqRel) {
            return Err(StreamError::Config(
                "another epoch of this loader is still running; finish or drop it first".into(),
            ));
        }
        *shared
            .epoch_start
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
        let batches = self.batches_of(order.len() as u64);
        let order: Arc<[u64]> = order.into();
        let batch_size = self.config.batch_size;
        let fill = Arc::new(EpochFill {
            shared: shared.clone(),
            order: order.clone(),
            batch_size,
            seed: self.config.seed,
            epoch,
        });
        let mut epoch_state = Epoch {
            run: Run::new(fill, batches),
        };
        // Hints first, so the first window reaches the daemon ahead of the readers; direct
        // files (not held in memory) get the kernel's read-ahead advised in the same window.
        let advised: Vec<(Arc<std::fs::File>, u64, u64)> = shared
            .direct
            .files()
            .iter()
            .filter(|(i, _)| shared.resident[*i].is_none())
            .map(|(i, f)| {
                let s = &shared.sources[*i];
                (f.clone(), s.offset, s.row_bytes)
            })
            .collect();
        let hinter = self.hints.clone().filter(|h| !h.is_off());
        // A node partition: this node's part of the epoch is what its mount stages, and from
        // the middle of the epoch the next epoch's part as well (sent under this epoch's
        // generation, which adds to the part rather than replacing it), so the chunks the
        // next epoch exchanges in are staged before its readers ask. Its cost: after a job's
        // last epoch, those chunks (`exchange` of the part) were read for nobody, once per job.
        let mut ahead_scope = None;
        if let (Some(h), Some(p)) = (&hinter, &self.config.partition) {
            let c = &self.config;
            let nodes = c.world_size / p.local_world_size;
            let o = p.order(self.rows, c.shuffle, c.seed);
            let node = c.rank / p.local_world_size;
            let now = crate::partition::node_ranges(&o, epoch, nodes, node);
            h.send_scope(epoch, &now);
            let next = crate::partition::node_ranges(&o, epoch + 1, nodes, node);
            if next != now {
                ahead_scope = Some(next);
            }
        }
        if hinter.is_some() || !advised.is_empty() {
            let hinted = hinter.iter().flat_map(|h| h.sources());
            let row_bytes: u64 = hinted
                .map(|i| shared.sources[i].row_bytes)
                .chain(advised.iter().map(|a| a.2))
                .sum();
            let ahead = crate::hints::batches_ahead(batch_size.saturating_mul(row_bytes));
            let Watch {
                dispatched,
                dispatch_tick,
                cancel,
                stop,
            } = epoch_state.run.watch();
            let spawned = std::thread::Builder::new()
                .name("stagefs-load-hints".into())
                .spawn(move || {
                    for seq in 0..batches {
                        // Hints run `ahead` batches beyond the last one handed to a reader.
                        while seq >= dispatched.load(Ordering::Relaxed) + ahead {
                            crossbeam_channel::select! {
                                recv(dispatch_tick) -> tick => if tick.is_err()
                                    && seq >= dispatched.load(Ordering::Relaxed) + ahead
                                {
                                    return; // The dispatcher is done: no batch comes.
                                },
                                recv(stop) -> _ => return,
                            }
                        }
                        if cancel.load(Ordering::Relaxed) {
                            return;
                        }
                        if seq == batches / 2 {
                            if let (Some(h), Some(next)) = (&hinter, ahead_scope.take()) {
                                h.send_scope(epoch, &next);
                            }
                        }
                        let (a, b) = batch_range(seq, batch_size, order.len());
                        for (file, offset, row_bytes) in &advised {
                            crate::direct::advise(file, *offset, *row_bytes, &order[a..b]);
                        }
                        if hinter.as_ref().is_some_and(|h| !h.send(&order[a..b]))
                            && advised.is_empty()
                        {
                            return;
                        }
                    }
                });
            // No thread for hints: the epoch runs without them.
            if let Ok(t) = spawned {
                epoch_state.run.adopt(t);
            }
        }
        epoch_state.run.start(self.readers, "stagefs-load")?;
        Ok(epoch_state)
    }
}

/// What the readers of one epoch need to fill any of its batches.
struct EpochFill<D: Device> {
    shared: Arc<Shared<D>>,
    order: Arc<[u64]>,
    batch_size: u64,
    seed: u64,
    epoch: u64,
}

/// One pass over this rank's rows; dropping it early cancels the rest.
pub struct Epoch<D: Device> {
    /// The pipeline of the epoch's batches; its fill holds the epoch's order.
    run: Run<EpochFill<D>>,
}

impl<D: Device> Epoch<D> {
    /// Batches in this epoch.
    pub fn len(&self) -> u64 {
        self.run.len()
    }

    /// Whether the epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.run.len() == 0
    }

    /// The next batch, blocking until its copy to the device has been issued; `None` at the
    /// end of the epoch. After an error the epoch is over — except [`StreamError::RingHeld`]
    /// (the consumer holds every slot), after which dropping a batch and calling again goes on.
    pub fn next_batch(&mut self) -> Option<Result<LoadedBatch<D>, StreamError>> {
        let next = self.run.next();
        if self.run.is_finished() {
            self.run.fill().shared.end_epoch();
        }
        Some(next?.map(|(seq, slot)| self.batch(seq, slot)))
    }

    fn batch(&self, seq: u64, slot: usize) -> LoadedBatch<D> {
        let fill = self.run.fill();
        let (start, end) = batch_range(seq, fill.batch_size, fill.order.len());
        let rows = (end - start) as u64;
        let shared = &fill.shared;
        let parts = shared
            .out_rows
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut shape = vec![rows];
                if s.dtype.is_some() {
                    shape.extend_from_slice(&s.shape);
                }
                Part {
                    source: i,
                    offset: shared.offsets[i],
                    // Fits: at most the slot's bytes for this source.
                    len: (rows * s.bytes) as usize,
                    dtype: s.dtype,
                    shape,
                }
            })
            .collect::<Vec<_>>();
        shared.ring.hold(parts.iter().map(|p| p.len).sum());
        LoadedBatch {
            shared: shared.clone(),
            slot,
            seq,
            epoch: fill.epoch,
            rows: fill.order[start..end].to_vec(),
            parts,
            consumed_recorded: false,
        }
    }
}

impl<D: Device> Iterator for Epoch<D> {
    type Item = Result<LoadedBatch<D>, StreamError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch()
    }
}

impl<D: Device> Drop for Epoch<D> {
    fn drop(&mut self) {
        let shared = self.run.fill().shared.clone();
        self.run.finish();
        shared.end_epoch();
        // The slots the epoch held come back before the next epoch may start.
        self.run.stop();
        shared.running.store(false, Ordering::Release);
    }
}

/// Indices into the epoch's order of batch `seq`.
fn batch_range(seq: u64, batch_size: u64, len: usize) -> (usize, usize) {
    let start = (seq.saturating_mul(batch_size) as usize).min(len);
    let end = (start as u64).saturating_add(batch_size).min(len as u64) as usize;
    (start, end)
}

impl<D: Device> Fill for EpochFill<D> {
    type Device = D;
    type Scratch = Scratch;

    fn ring(&self) -> &Ring<D> {
        &self.shared.ring
    }

    /// Reads one batch of every source into the slot's host buffer, each at its part's offset.
    fn fill(&self, seq: u64, buf: &mut [u8], scratch: &mut Scratch) -> Result<usize, StreamError> {
        let shared = &self.shared;
        let (start, end) = batch_range(seq, self.batch_size, self.order.len());
        let rows = &self.order[start..end];
        let mut used = 0;
        for (i, ((source, &offset), resident)) in shared
            .sources
            .iter()
            .zip(&shared.offsets)
            .zip(&shared.resident)
            .enumerate()
        {
            // Fits: the slot was sized for a full batch of every source.
            let row_bytes = source.row_bytes as usize;
            if let (0, Some((transform, geom, table))) = (i, &shared.transform) {
                let out_bytes = shared.out_rows[0].bytes as usize;
                // The raw row is read into a buffer of the reader's own, kept across batches (a
                // row's size was checked against the file when the source was opened).
                let mut raw_buf = std::mem::take(&mut scratch.raw);
                if resident.is_none() && raw_buf.len() < row_bytes {
                    raw_buf
                        .try_reserve_exact(row_bytes - raw_buf.len())
                        .map_err(|e| StreamError::Config(format!("cannot hold one row: {e}")))?;
                    raw_buf.resize(row_bytes, 0);
                }
                for (k, &row) in rows.iter().enumerate() {
                    let raw: &[u8] = if let Some(data) = &resident {
                        // Inside: the row is one of the source's.
                        &data[row as usize * row_bytes..(row as usize + 1) * row_bytes]
                    } else {
                        source.read_rows(&mut raw_buf[..row_bytes], row)?;
                        &raw_buf[..row_bytes]
                    };
                    let window = transform.crop_box(self.seed, self.epoch, row, *geom);
                    let dst = &mut buf[offset + k * out_bytes..offset + (k + 1) * out_bytes];
                    transform.apply(raw, *geom, &window, scratch, table, dst)?;
                }
                scratch.raw = raw_buf;
                used = offset + rows.len() * out_bytes;
                continue;
            }
            let mut k = 0;
            while k < rows.len() {
                // One read per run of consecutive rows: a whole batch when not shuffled.
                let first = rows[k];
                let mut n = 1;
                while k + n < rows.len() && rows[k + n] == first + n as u64 {
                    n += 1;
                }
                let dst = &mut buf[offset + k * row_bytes..offset + (k + n) * row_bytes];
                if let Some(data) = &resident {
                    // Inside: `first + n` rows of the source fit in its data.
                    let start = first as usize * row_bytes;
                    dst.copy_from_slice(&data[start..start + n * row_bytes]);
                } else {
                    source.read_rows(dst, first)?;
                }
                k += n;
            }
            used = offset + rows.len() * row_bytes;
        }
        Ok(used)
    }
}

/// A batch in the consumer's hands: one part per source, rows aligned. Dropping it gives its
/// slot back to the ring; it keeps the ring (and so its memory) alive meanwhile.
pub struct LoadedBatch<D: Device> {
    shared: Arc<Shared<D>>,
    slot: usize,
    seq: u64,
    epoch: u64,
    rows: Vec<u64>,
    parts: Vec<Part>,
    consumed_recorded: bool,
}

impl<D: Device> LoadedBatch<D> {
    /// Position in the epoch, from 0.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The source rows in the batch, in order.
    pub fn rows(&self) -> &[u64] {
        &self.rows
    }

    /// One part per source.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// The device the batch is on.
    pub fn device(&self) -> &Arc<D> {
        &self.shared.ring.device
    }

    /// The slot's device buffer; parts lie at their offsets once [`Self::ready_event`] completed.
    pub fn device_buffer(&self) -> &D::DeviceBuffer {
        &self.shared.ring.slot(self.slot).device
    }

    /// Address of the slot's host buffer, where the readers wrote the batch (a [`crate::CpuDevice`]
    /// consumer reads the parts there; valid while the batch is held).
    pub fn host_ptr(&self) -> *const u8 {
        self.shared.ring.slot(self.slot).host_ptr as *const u8
    }

    /// The event that completes when the batch's copy to the device is done.
    pub fn ready_event(&self) -> &D::Event {
        &self.shared.ring.slot(self.slot).copied
    }

    /// The event the next copy into this slot waits for. A consumer that used the batch on a
    /// stream of its own records it there itself and then calls [`Self::mark_consumed_recorded`].
    pub fn consumed_event(&self) -> &D::Event {
        &self.shared.ring.slot(self.slot).consumed
    }

    /// Tells the batch that its consumed event was recorded on the consumer's own stream, so
    /// dropping it must not record it again on the device's consumer stream.
    pub fn mark_consumed_recorded(&mut self) {
        self.consumed_recorded = true;
    }

    /// Makes the device's consumer stream wait for the batch (does not block the host).
    pub fn wait_on_consumer_stream(&self) -> Result<(), StreamError> {
        Ok(self
            .shared
            .ring
            .device
            .stream_wait(StreamKind::Consumer, self.ready_event())?)
    }

    /// Blocks until the batch is on the device; the time counts as the consumer waiting.
    pub fn synchronize(&self) -> Result<(), StreamError> {
        let waited = Instant::now();
        let result = self
            .shared
            .ring
            .device
            .event_synchronize(self.ready_event());
        add_since(&self.shared.ring.counters.consumer_wait_ns, waited);
        Ok(result?)
    }

    /// Bytes of part `i` as the readers wrote them into the host buffer.
    pub fn host_part(&self, i: usize) -> &[u8] {
        let p = &self.parts[i];
        // SAFETY: the part lies inside the slot's host buffer, which lives as long as the ring
        // (kept alive by `self`) and is not written again until this batch is dropped.
        unsafe { std::slice::from_raw_parts(self.host_ptr().add(p.offset), p.len) }
    }
}

impl<D: Device> Drop for LoadedBatch<D> {
    fn drop(&mut self) {
        let record = !self.consumed_recorded;
        self.shared.ring.give_back(self.slot, self.seq, record);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributed_order_matches_distributed_sampler_without_shuffle() {
        // torch.utils.data.DistributedSampler(range(10), num_replicas=3, rank=r, shuffle=False)
        assert_eq!(epoch_order(10, false, 0, 0, 0, 3), [0, 3, 6, 9]);
        assert_eq!(epoch_order(10, false, 0, 0, 1, 3), [1, 4, 7, 0]);
        assert_eq!(epoch_order(10, false, 0, 0, 2, 3), [2, 5, 8, 1]);
        // Fewer rows than ranks: padding wraps around more than once.
        assert_eq!(epoch_order(2, false, 0, 0, 4, 5), [0]);
    }

    #[test]
    fn resumed_order_continues_the_same_split_and_covers_the_rest_once_under_a_new_one() {
        for (rows, w, b) in [(103u64, 4u64, 5u64), (10, 3, 1), (10, 4, 2), (7, 2, 3)] {
            for k in 0..=rows.div_ceil(w).div_ceil(b) {
                let start = (k * b * w).min(rows);
                for rank in 0..w {
                    let full = epoch_order(rows, true, 3, 1, rank, w);
                    let skip = ((k * b) as usize).min(full.len());
                    assert_eq!(
                        epoch_order_from(rows, true, 3, 1, start, rank, w),
                        full[skip..],
                        "rows {rows} world {w} batch {b} after {k}"
                    );
                }
                let seen: std::collections::BTreeSet<u64> = (0..w)
                    .flat_map(|r| {
                        epoch_order(rows, true, 3, 1, r, w)
                            .into_iter()
                            .take((k * b) as usize)
                    })
                    .collect();
                // The padding (at most w2 - 1 rows) repeats the epoch's first rows, which were
                // seen once `start` reaches w2: then every unseen row comes exactly once.
                for w2 in [1, 2, 3, 5].into_iter().filter(|&w2| start >= w2) {
                    let mut rest: Vec<u64> = (0..w2)
                        .flat_map(|r| epoch_order_from(rows, true, 3, 1, start, r, w2))
                        .filter(|row| !seen.contains(row))
                        .collect();
                    rest.sort_unstable();
                    let want: Vec<u64> = (0..rows).filter(|r| !seen.contains(r)).collect();
                    assert_eq!(rest, want, "rows {rows} {w}->{w2} after {k}");
                }
            }
        }
    }

    #[test]
    fn shuffled_ranks_are_disjoint_complete_and_seeded() {
        let n = 1000;
        let mut all: Vec<u64> = (0..4)
            .flat_map(|r| epoch_order(n, true, 7, 3, r, 4))
            .collect();
        assert_eq!(
            epoch_order(n, true, 7, 3, 1, 4),
            epoch_order(n, true, 7, 3, 1, 4)
        );
        assert_ne!(
            epoch_order(n, true, 7, 3, 1, 4),
            epoch_order(n, true, 7, 4, 1, 4)
        );
        assert_ne!(
            epoch_order(n, true, 7, 3, 1, 4),
            epoch_order(n, true, 8, 3, 1, 4)
        );
        all.sort_unstable();
        assert_eq!(all, (0..n).collect::<Vec<_>>());
    }
}
