//! The streaming pipeline: batches of rows from files, in plan order, through a ring of K
//! buffer pairs (pinned host buffer + device buffer + two events) into device memory.
//!
//! The plan ([`crate::plan`]) cuts every source into batches and orders them per epoch; the ring
//! pipeline ([`crate::ring`]) does the rest: a dispatcher hands each batch a free slot in plan
//! order (back-pressure; memory stays K × batch bytes on each side), reader threads fill a slot
//! with one positioned read of the batch's rows and enqueue its copy to the device, and
//! [`Streamer::next_batch`] hands batches out in plan order. Dropping a [`Batch`] records the
//! consumed event on the consumer stream and returns the slot to the ring. Errors stop the
//! readers and surface at the consumer's next call.

pub use crate::bounds::MAX_BATCH_BYTES;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use stagefs_npy::DType;

use crate::device::{Device, StreamKind};
use crate::error::StreamError;
use crate::host::HostDevice;
use crate::plan::{plan, PlannedBatch};
use crate::ring::{Fill, Ring, Run};
use crate::source::{read_full, Source};
use crate::stats::{add_since, Stats};

/// How a [`Streamer`] runs.
#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// Rows per batch (the last batch of each source may have fewer).
    pub batch_rows: u64,
    /// Ring slots K: batches that may be in flight at once (read, copying, or held by the consumer).
    pub ring: usize,
    /// Reader threads reading batches in parallel (clamped to `ring`).
    pub readers: usize,
    /// Passes over all sources.
    pub epochs: u32,
    /// Shuffle the batch order of every epoch with this seed (`None`: file order).
    pub shuffle_seed: Option<u64>,
}

impl Default for StreamConfig {
    /// 1024 rows, 4 slots (two in flight while the consumer holds one and one is being read),
    /// 2 readers, one epoch, file order.
    fn default() -> Self {
        StreamConfig {
            batch_rows: 1024,
            ring: 4,
            readers: 2,
            epochs: 1,
            shuffle_seed: None,
        }
    }
}

/// Batch size [`StreamConfig::auto`] aims at: large enough that per-batch costs vanish, small
/// enough that a ring of a dozen slots stays a few hundred MB.
pub const AUTO_BATCH_BYTES: u64 = 32 << 20;

/// Reader threads [`StreamConfig::auto`] starts at most. Each reader's `pread` out of the page
/// cache is a CPU copy of 3–4 GB/s on the H200 machine (scripts/gpu-sweep.sh, 2026-12-04, 16
/// cores, 55 GB/s pinned peak): 8 readers moved 30 GB/s, 16 moved 35, 24 and 32 moved 36–40,
/// 48 fewer. Past one reader per core the copies only contend, so 16 is where it stops.
pub const MAX_AUTO_READERS: usize = 16;

impl StreamConfig {
    /// The configuration for rows of at most `max_row_bytes` on this machine (what `stagefs
    /// stream` uses unless told otherwise): batches of about [`AUTO_BATCH_BYTES`], one reader
    /// per core up to [`MAX_AUTO_READERS`], and a ring of 4 more slots than readers (at least
    /// 8: every reader busy while the consumer holds a batch and copies run); one epoch, file
    /// order.
    pub fn auto(max_row_bytes: u64) -> StreamConfig {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let readers = cores.min(MAX_AUTO_READERS);
        StreamConfig {
            batch_rows: (AUTO_BATCH_BYTES / max_row_bytes.max(1)).max(1),
            ring: Self::auto_ring(readers),
            readers,
            ..StreamConfig::default()
        }
    }

    /// The ring [`auto`](Self::auto) gives `readers` reader threads.
    pub fn auto_ring(readers: usize) -> usize {
        (readers + 4).max(8)
    }
}

/// What a batch holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchMeta {
    /// Position in the stream, from 0 over all epochs.
    pub seq: u64,
    /// Epoch, from 0.
    pub epoch: u32,
    /// Index of the source in the list given to [`Streamer::new`].
    pub source: usize,
    /// The source's file.
    pub path: PathBuf,
    /// Rows of the source in this batch.
    pub rows: Range<u64>,
    /// File offset of the batch's first byte.
    pub offset: u64,
    /// Bytes in the batch.
    pub len: usize,
    /// Element type, when the source is a `.npy` file.
    pub dtype: Option<DType>,
    /// Shape of the batch: rows, then the source's row shape.
    pub shape: Vec<u64>,
}

/// What the stream's threads and its batches share: the ring, the sources and the plan.
struct Shared<D: Device> {
    ring: Ring<D>,
    sources: Vec<Source>,
    /// Every batch of the stream, by sequence number.
    planned: Vec<PlannedBatch>,
}

impl<D: Device> Fill for Shared<D> {
    type Device = D;
    type Scratch = ();

    fn ring(&self) -> &Ring<D> {
        &self.ring
    }

    /// Reads batch `seq`'s rows with one positioned read.
    fn fill(&self, seq: u64, buf: &mut [u8], _: &mut ()) -> Result<usize, StreamError> {
        // Inside: the run hands out only the plan's sequence numbers.
        let planned = &self.planned[seq as usize];
        let source = &self.sources[planned.source];
        let rows = &planned.rows;
        // Fits: the ring's buffers are sized for the largest batch.
        let len = ((rows.end - rows.start) * source.row_bytes) as usize;
        source.read_rows(&mut buf[..len], rows.start)?;
        Ok(len)
    }
}

/// Streams batches of rows from files into device buffers through a ring of pinned buffers.
///
/// See the crate documentation for an example.
pub struct Streamer<D: Device> {
    shared: Arc<Shared<D>>,
    /// The pipeline and the consumer's reorder state; dropping it stops the threads.
    run: Mutex<Run<Shared<D>>>,
    total: u64,
    readers: usize,
    batch_bytes: usize,
    started: Instant,
    ended: Mutex<Option<Duration>>,
}

impl<D: Device> Streamer<D> {
    /// Allocates the ring on `device` and starts reading `sources` at once.
    pub fn new(
        device: Arc<D>,
        sources: Vec<Source>,
        config: &StreamConfig,
    ) -> Result<Self, StreamError> {
        if sources.is_empty() {
            return Err(StreamError::Config("no sources to stream".into()));
        }
        if config.batch_rows == 0 {
            return Err(StreamError::Config("batch rows must be at least 1".into()));
        }
        if config.ring == 0 {
            return Err(StreamError::Config(
                "the ring needs at least 1 buffer (2 or more to overlap)".into(),
            ));
        }
        crate::bounds::check_counts(0, config.ring, config.readers)?;
        let batch_bytes = sources
            .iter()
            .map(|s| s.rows.min(config.batch_rows).checked_mul(s.row_bytes))
            .try_fold(0u64, |max, b| b.map(|b| max.max(b)))
            .filter(|&b| b <= MAX_BATCH_BYTES)
            .ok_or_else(|| {
                StreamError::Config(format!(
                    "{} rows per batch make batches over {} GiB; use fewer --batch-rows",
                    config.batch_rows,
                    MAX_BATCH_BYTES >> 30
                ))
            })?;
        let batch_bytes = usize::try_from(batch_bytes)
            .map_err(|_| StreamError::Config("batch too large for this platform".into()))?;
        let readers = config.readers.clamp(1, config.ring);

        let ring = Ring::new(device, config.ring, batch_bytes, "stream")?;
        let source_rows: Vec<u64> = sources.iter().map(|s| s.rows).collect();
        let planned = plan(
            &source_rows,
            config.batch_rows,
            config.epochs,
            config.shuffle_seed,
        );
        let total = planned.len() as u64;
        let shared = Arc::new(Shared {
            ring,
            sources,
            planned,
        });
        let mut run = Run::new(shared.clone(), total);
        run.start(readers, "stagefs-stream")?;

        Ok(Streamer {
            shared,
            run: Mutex::new(run),
            total,
            readers,
            batch_bytes,
            started: Instant::now(),
            ended: Mutex::new(None),
        })
    }

    /// Total batches this stream delivers (all epochs).
    pub fn len(&self) -> u64 {
        self.total
    }

    /// Whether the stream delivers no batch at all.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Bytes of each ring buffer: the largest batch (host and device use K of these each).
    pub fn batch_bytes(&self) -> usize {
        self.batch_bytes
    }

    /// The device the stream feeds.
    pub fn device(&self) -> &Arc<D> {
        &self.shared.ring.device
    }

    /// The sources, in the order given.
    pub fn sources(&self) -> &[Source] {
        &self.shared.sources
    }

    /// The next batch in plan order, blocking until its copy has been issued; `None` at the end.
    ///
    /// After an error the stream is over: later calls return `None` — except
    /// [`StreamError::RingHeld`] (the consumer holds every ring buffer), after which dropping a
    /// batch and calling again continues.
    pub fn next_batch(&self) -> Option<Result<Batch<'_, D>, StreamError>> {
        let mut run = self.run.lock().unwrap_or_else(PoisonError::into_inner);
        let next = run.next();
        if run.is_finished() {
            self.mark_end();
        }
        Some(next?.map(|(seq, slot)| self.batch(seq, slot)))
    }

    /// Counters so far (final once `next_batch` returned `None`).
    pub fn stats(&self) -> Stats {
        let elapsed = self
            .ended
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .unwrap_or_else(|| self.started.elapsed());
        Stats::from_counters(&self.shared.ring.counters, elapsed, self.readers)
    }

    fn mark_end(&self) {
        let mut ended = self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        if ended.is_none() {
            *ended = Some(self.started.elapsed());
        }
    }

    fn batch(&self, seq: u64, slot: usize) -> Batch<'_, D> {
        // Inside: the run hands out only the plan's sequence numbers.
        let planned = &self.shared.planned[seq as usize];
        let source = &self.shared.sources[planned.source];
        let rows = planned.rows.clone();
        let len = ((rows.end - rows.start) * source.row_bytes) as usize;
        let mut shape = vec![rows.end - rows.start];
        if source.dtype.is_some() {
            shape.extend_from_slice(&source.row_shape);
        }
        self.shared.ring.hold(len);
        Batch {
            streamer: self,
            slot,
            meta: BatchMeta {
                seq: planned.seq,
                epoch: planned.epoch,
                source: planned.source,
                path: source.path.clone(),
                offset: source.offset + rows.start * source.row_bytes,
                rows,
                len,
                dtype: source.dtype,
                shape,
            },
        }
    }
}

/// A batch on the device, held by the consumer; dropping it returns its buffers to the ring.
pub struct Batch<'a, D: Device> {
    streamer: &'a Streamer<D>,
    slot: usize,
    meta: BatchMeta,
}

impl<D: Device> Batch<'_, D> {
    /// What the batch holds.
    pub fn meta(&self) -> &BatchMeta {
        &self.meta
    }

    /// Bytes of data in the batch (the start of [`Batch::device_buffer`]).
    pub fn len(&self) -> usize {
        self.meta.len
    }

    /// Whether the batch has no bytes.
    pub fn is_empty(&self) -> bool {
        self.meta.len == 0
    }

    /// The device buffer; its first [`Batch::len`] bytes are the batch once
    /// [`Batch::ready_event`] has completed.
    pub fn device_buffer(&self) -> &D::DeviceBuffer {
        &self.streamer.shared.ring.slot(self.slot).device
    }

    /// The event that completes when the batch's copy to the device is done: make your own
    /// stream wait on it before using the buffer.
    pub fn ready_event(&self) -> &D::Event {
        &self.streamer.shared.ring.slot(self.slot).copied
    }

    /// Makes the device's consumer stream wait for the batch (does not block the host).
    pub fn wait_on_consumer_stream(&self) -> Result<(), StreamError> {
        let device = &self.streamer.shared.ring.device;
        Ok(device.stream_wait(StreamKind::Consumer, self.ready_event())?)
    }

    /// Blocks until the batch is on the device; the time counts as the consumer waiting on data.
    pub fn synchronize(&self) -> Result<(), StreamError> {
        let waited = Instant::now();
        let result = self
            .streamer
            .shared
            .ring
            .device
            .event_synchronize(self.ready_event());
        add_since(&self.streamer.shared.ring.counters.consumer_wait_ns, waited);
        Ok(result?)
    }

    /// Copies the batch back from the device (ordered after the copy that brought it there).
    pub fn copy_to_host(&self) -> Result<Vec<u8>, StreamError> {
        self.wait_on_consumer_stream()?;
        let mut out = vec![0u8; self.meta.len];
        self.streamer
            .shared
            .ring
            .device
            .copy_to_host(self.device_buffer(), &mut out)?;
        Ok(out)
    }

    /// Copies the batch back and compares its CRC-32 with a fresh read of the source's bytes.
    pub fn verify(&self) -> Result<Verification, StreamError> {
        let on_device = self.copy_to_host()?;
        let source = &self.streamer.shared.sources[self.meta.source];
        let mut in_file = vec![0u8; self.meta.len];
        read_full(source.reader.as_ref(), &mut in_file, self.meta.offset).map_err(|e| {
            StreamError::Io {
                path: source.path.clone(),
                source: e,
            }
        })?;
        Ok(Verification {
            device_crc32: crc32fast::hash(&on_device),
            file_crc32: crc32fast::hash(&in_file),
        })
    }
}

impl<'a> Batch<'a, HostDevice> {
    /// The batch's bytes in host-device memory (waits for the copy first).
    pub fn data(&self) -> Result<&[u8], StreamError> {
        self.synchronize()?;
        // SAFETY: the copy into this slot is complete (synchronized above) and no new copy into
        // it is issued until this batch is dropped, which the returned borrow prevents.
        Ok(unsafe { HostDevice::device_bytes(self.device_buffer(), self.meta.len) })
    }

    /// Runs `kernel` on the batch's bytes on the consumer stream, after the batch's copy and
    /// without blocking the host: how a GPU consumer uses a batch. The batch may be dropped
    /// right after; its buffer is not reused until the kernel has run.
    pub fn launch(&self, kernel: impl FnOnce(&[u8]) + Send + 'static) -> Result<(), StreamError> {
        self.wait_on_consumer_stream()?;
        let device = &self.streamer.shared.ring.device;
        // SAFETY: the slot's buffer lives until the streamer is dropped (which synchronizes the
        // device first) and is not written again before the consumed event, recorded on the
        // consumer stream after this kernel when the batch is dropped, has completed.
        Ok(unsafe { device.launch(self.device_buffer(), self.meta.len, kernel) }?)
    }
}

impl<D: Device> Drop for Batch<'_, D> {
    fn drop(&mut self) {
        let ring = &self.streamer.shared.ring;
        ring.give_back(self.slot, self.meta.seq, true);
    }
}

/// Checksums of a batch as it arrived on the device and as it is in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verification {
    /// CRC-32 of the bytes copied back from the device.
    pub device_crc32: u32,
    /// CRC-32 of the same range read from the source.
    pub file_crc32: u32,
}

impl Verification {
    /// Whether the device holds exactly the file's bytes.
    pub fn matches(&self) -> bool {
        self.device_crc32 == self.file_crc32
    }
}
