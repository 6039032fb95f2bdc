//! Counters of a stream: what moved, and who waited on whom.
//!
//! Three waits answer "is my job I/O-bound?": the consumer waiting for data (the device idles:
//! storage or the bus is too slow), the readers waiting on storage (time inside `pread`), and the
//! readers waiting for a free ring buffer (the consumer is the bottleneck: storage keeps up).
//! Counters are atomics updated once per batch, so their cost is nil next to a batch's copy.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Live counters shared by the streamer's threads.
#[derive(Default)]
pub(crate) struct Counters {
    pub bytes: AtomicU64,
    pub batches: AtomicU64,
    pub consumer_wait_ns: AtomicU64,
    pub storage_ns: AtomicU64,
    pub ring_wait_ns: AtomicU64,
}

/// Adds the time since `start` to `counter`.
pub(crate) fn add_since(counter: &AtomicU64, start: Instant) {
    counter.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// A snapshot of a stream's counters.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Bytes delivered to the consumer.
    pub bytes: u64,
    /// Batches delivered to the consumer.
    pub batches: u64,
    /// Wall time from the streamer's start to the snapshot (or to the end of the stream).
    pub elapsed: Duration,
    /// Time the consumer was blocked waiting for a batch to arrive on the device.
    pub consumer_wait: Duration,
    /// Time reader threads spent inside storage reads, summed over all readers.
    pub storage_read: Duration,
    /// Time reader threads waited for a free ring buffer (the consumer still holding it, or its
    /// previous copy still running), summed over all readers.
    pub ring_full_wait: Duration,
    /// Number of reader threads (to turn `storage_read` into a per-reader share).
    pub readers: usize,
}

impl Stats {
    pub(crate) fn from_counters(c: &Counters, elapsed: Duration, readers: usize) -> Stats {
        let ns = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
        Stats {
            bytes: c.bytes.load(Ordering::Relaxed),
            batches: c.batches.load(Ordering::Relaxed),
            elapsed,
            consumer_wait: ns(&c.consumer_wait_ns),
            storage_read: ns(&c.storage_ns),
            ring_full_wait: ns(&c.ring_wait_ns),
            readers,
        }
    }

    /// Throughput in GB/s (10^9 bytes per second).
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e9 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Batches per second.
    pub fn batches_per_s(&self) -> f64 {
        self.batches as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Share of wall time the consumer (the device) waited for data, 0..=1.
    pub fn consumer_wait_share(&self) -> f64 {
        self.consumer_wait.as_secs_f64() / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Share of wall time an average reader spent in storage reads, 0..=1.
    pub fn storage_share(&self) -> f64 {
        self.storage_read.as_secs_f64()
            / self.readers.max(1) as f64
            / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Share of wall time an average reader waited for a free ring buffer, 0..=1.
    pub fn ring_full_share(&self) -> f64 {
        self.ring_full_wait.as_secs_f64()
            / self.readers.max(1) as f64
            / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// One-line answer to "is the consumer I/O-bound?".
    pub fn verdict(&self) -> &'static str {
        if self.consumer_wait_share() > 0.05 {
            "I/O-bound: the device waited on data (storage or the bus is the bottleneck)"
        } else if self.ring_full_share() > 0.05 {
            "consumer-bound: data was ready before the device asked for it"
        } else {
            "balanced: neither side waited more than 5% of the time"
        }
    }
}
