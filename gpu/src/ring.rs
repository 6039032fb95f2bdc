//! The ring pipeline under both the [`crate::Streamer`] and the [`crate::Loader`]: jobs
//! numbered `0..n`, read by threads into a ring of K slots and handed to one consumer in order.
//!
//! A [`Ring`] is K slots allocated once (a host buffer, its device twin, and two events ordering
//! them) and a free list of their indices. A [`Run`] is one pass of jobs over a ring: a
//! dispatcher hands each job the next free slot *in job order*, blocking while all K are taken
//! (back-pressure: memory stays K slots whatever the data), so the job the consumer needs next
//! always holds a slot and the pipeline cannot deadlock however the readers finish. Each reader
//! takes a job, waits until its slot's previous copy left the host buffer, lets the user's
//! [`Fill`] write the job's bytes into it (the only part that differs between the streamer and
//! the loader), makes the copy stream wait until the consumer released the slot's device
//! buffer, enqueues the host→device copy and records the copy-done event. [`Run::next`] reorders
//! finished jobs by number and hands them out in order; the consumer gives a slot back with
//! [`Ring::give_back`] (recording the consumed event the next copy into it waits for). A
//! consumer that holds all K slots and asks for another gets [`StreamError::RingHeld`] instead
//! of a hang. Time inside [`Fill::fill`] counts as storage time in the stats, time waiting for
//! a job or for a slot's previous copy as ring-full time.
//!
//! Channels and why each has its size:
//! - free slots, capacity K: it holds every index at once, so giving a slot back never blocks
//!   (a batch's drop must not wait).
//! - jobs, capacity K: a job always holds a slot, so there are never more than K and the
//!   dispatcher never blocks sending one.
//! - results, unbounded: each message holds a slot (or ends the run), so there are never more
//!   than K + readers of them, and a reader never blocks on a consumer that is not asking.
//! - stop, capacity 0 and never sent on: dropping its sender wakes a dispatcher waiting for a
//!   free slot, which the free list cannot do (the ring outlives the run and keeps its sender).
//!
//! A ring outlives its runs (the loader runs one per epoch on the same slots), so every slot a
//! run takes comes back when it ends early: the dispatcher gives back a slot it took after a
//! cancel, readers give back the slots of jobs they drain after a cancel or a failure and of
//! results nobody will receive, and [`Run::stop`] those of jobs and results left in the queues
//! and of finished jobs the consumer never asked for. Errors cancel the run and surface at the
//! consumer's next call; buffers are allocated once, never per job.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{bounded, select, unbounded, Receiver, Sender};

use crate::device::{Device, StreamKind};
use crate::error::StreamError;
use crate::stats::{add_since, Counters};

/// One slot of the ring: a host buffer, its device twin, and the two events ordering them.
pub(crate) struct Slot<D: Device> {
    /// Where a reader writes the slot's job (locked by that reader alone).
    pub(crate) host: Mutex<D::HostBuffer>,
    /// The host buffer's address, stable for its life (for consumers that read it in place).
    pub(crate) host_ptr: usize,
    /// Where the copy of the host buffer lands.
    pub(crate) device: D::DeviceBuffer,
    /// Recorded on the copy stream after the slot's copy: the consumer waits for it.
    pub(crate) copied: D::Event,
    /// Recorded on the consumer stream when the consumer gives the slot back: the next copy
    /// into the device buffer waits for it.
    pub(crate) consumed: D::Event,
}

/// K slots of one size, their free list, and the counters of the pipelines that use them.
pub(crate) struct Ring<D: Device> {
    /// The device the slots live on.
    pub(crate) device: Arc<D>,
    /// The slots, indexed by the numbers the free list carries.
    pub(crate) slots: Vec<Slot<D>>,
    /// Bytes of each slot's host and device buffer.
    slot_bytes: usize,
    free_tx: Sender<usize>,
    free_rx: Receiver<usize>,
    /// Slots in the consumer's hands.
    held: AtomicUsize,
    /// What moved and who waited, over every run of the ring.
    pub(crate) counters: Counters,
    /// What the ring feeds (`stream`, `loader`), for the warnings at its end.
    owner: &'static str,
}

impl<D: Device> Ring<D> {
    /// Allocates `slots` slots of `slot_bytes` bytes each on `device`, all free.
    pub(crate) fn new(
        device: Arc<D>,
        slots: usize,
        slot_bytes: usize,
        owner: &'static str,
    ) -> Result<Self, StreamError> {
        let mut all = Vec::with_capacity(slots);
        for _ in 0..slots {
            let mut host = device.alloc_host(slot_bytes)?;
            let host_ptr = host.as_mut().as_mut_ptr() as usize;
            all.push(Slot {
                host: Mutex::new(host),
                host_ptr,
                device: device.alloc_device(slot_bytes)?,
                copied: device.new_event()?,
                consumed: device.new_event()?,
            });
        }
        let (free_tx, free_rx) = bounded(slots);
        for slot in 0..slots {
            // Cannot fail: the channel holds exactly `slots` items and its receiver is alive.
            let _ = free_tx.send(slot);
        }
        Ok(Ring {
            device,
            slots: all,
            slot_bytes,
            free_tx,
            free_rx,
            held: AtomicUsize::new(0),
            counters: Counters::default(),
            owner,
        })
    }

    /// Slot `i`.
    pub(crate) fn slot(&self, i: usize) -> &Slot<D> {
        &self.slots[i]
    }

    /// Counts a slot of `bytes` bytes of data as handed to the consumer.
    pub(crate) fn hold(&self, bytes: usize) {
        self.held.fetch_add(1, Ordering::AcqRel);
        self.counters
            .bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes back a slot the consumer held (batch `seq`); with `record_consumed`, first records
    /// its consumed event on the device's consumer stream (a consumer that used its own stream
    /// recorded it there itself).
    pub(crate) fn give_back(&self, slot: usize, seq: u64, record_consumed: bool) {
        if record_consumed {
            if let Err(e) = self
                .device
                .record(&self.slots[slot].consumed, StreamKind::Consumer)
            {
                tracing::warn!("recording the release of batch {seq} failed: {e}");
            }
        }
        self.held.fetch_sub(1, Ordering::AcqRel);
        self.release(slot);
    }

    /// Returns `slot` to the free list.
    fn release(&self, slot: usize) {
        // Cannot fail while the ring lives: it holds the receiver, and the channel has room for
        // every slot.
        let _ = self.free_tx.send(slot);
    }
}

impl<D: Device> Drop for Ring<D> {
    fn drop(&mut self) {
        // Copies may still be in flight into buffers that are about to be freed, and a
        // consumer's work on its own stream may still read them (its release recorded there).
        if let Err(e) = self.device.synchronize() {
            tracing::warn!("device synchronize at {} end failed: {e}", self.owner);
        }
        for slot in &self.slots {
            if let Err(e) = self.device.event_synchronize(&slot.consumed) {
                tracing::warn!("waiting for the consumer at {} end failed: {e}", self.owner);
            }
        }
    }
}

/// How a pipeline produces a job's bytes: the part of the work that is its own.
pub(crate) trait Fill: Send + Sync + 'static {
    /// The device the ring is on.
    type Device: Device;
    /// Per-reader state kept across jobs (scratch buffers), so no job allocates its own.
    type Scratch: Default;
    /// The ring the jobs are read into.
    fn ring(&self) -> &Ring<Self::Device>;
    /// Writes job `seq`'s bytes at the start of the slot's host buffer `buf` and returns how
    /// many bytes the device copy carries (at most `buf.len()`).
    fn fill(
        &self,
        seq: u64,
        buf: &mut [u8],
        scratch: &mut Self::Scratch,
    ) -> Result<usize, StreamError>;
}

/// A job: its number and the slot it was handed.
struct Job {
    seq: u64,
    slot: usize,
}

/// What readers tell the consumer.
enum Msg {
    Ready { seq: u64, slot: usize },
    Failed(StreamError),
}

/// What a thread running beside a run (read-ahead hints) watches.
pub(crate) struct Watch {
    /// Jobs handed to readers so far.
    pub(crate) dispatched: Arc<AtomicU64>,
    /// Holds a message after `dispatched` moved (at most one waits), disconnected once the
    /// dispatcher is done: a watcher blocks on it instead of polling `dispatched`.
    pub(crate) dispatch_tick: Receiver<()>,
    /// Set once the run is cancelled or over.
    pub(crate) cancel: Arc<AtomicBool>,
    /// Disconnected once the run stops.
    pub(crate) stop: Receiver<()>,
}

/// One pass of jobs `0..len` over a ring: its threads, and the consumer's reorder state.
pub(crate) struct Run<F: Fill> {
    fill: Arc<F>,
    jobs: u64,
    cancel: Arc<AtomicBool>,
    dispatched: Arc<AtomicU64>,
    /// Moved to the dispatcher by [`Run::start`] (see [`Watch::dispatch_tick`]).
    tick_tx: Option<Sender<()>>,
    tick_rx: Receiver<()>,
    /// Dropped to wake a dispatcher waiting for a free slot.
    stop_tx: Option<Sender<()>>,
    stop_rx: Receiver<()>,
    /// Moved to the dispatcher by [`Run::start`].
    job_tx: Option<Sender<Job>>,
    /// Kept to give back the slots of jobs no reader took before the end.
    job_rx: Receiver<Job>,
    /// Moved to the readers by [`Run::start`]: once they are all gone the results disconnect.
    msg_tx: Option<Sender<Msg>>,
    rx: Receiver<Msg>,
    /// Finished jobs waiting for their turn, by number: their slots.
    pending: BTreeMap<u64, usize>,
    next_seq: u64,
    finished: bool,
    threads: Vec<JoinHandle<()>>,
}

/// The error of a thread that could not be started.
fn spawn_err(e: std::io::Error) -> StreamError {
    StreamError::Io {
        path: PathBuf::from("<thread>"),
        source: e,
    }
}

impl<F: Fill> Run<F> {
    /// A run of `jobs` jobs filled by `fill`; nothing is read before [`Run::start`].
    pub(crate) fn new(fill: Arc<F>, jobs: u64) -> Self {
        let slots = fill.ring().slots.len();
        let (stop_tx, stop_rx) = bounded::<()>(0);
        let (job_tx, job_rx) = bounded::<Job>(slots);
        let (msg_tx, rx) = unbounded::<Msg>();
        let (tick_tx, tick_rx) = bounded::<()>(1);
        Run {
            fill,
            jobs,
            cancel: Arc::new(AtomicBool::new(false)),
            dispatched: Arc::new(AtomicU64::new(0)),
            tick_tx: Some(tick_tx),
            tick_rx,
            stop_tx: Some(stop_tx),
            stop_rx,
            job_tx: Some(job_tx),
            job_rx,
            msg_tx: Some(msg_tx),
            rx,
            pending: BTreeMap::new(),
            next_seq: 0,
            finished: false,
            threads: Vec::new(),
        }
    }

    /// What fills the jobs.
    pub(crate) fn fill(&self) -> &Arc<F> {
        &self.fill
    }

    /// Jobs in the run.
    pub(crate) fn len(&self) -> u64 {
        self.jobs
    }

    /// Whether the run is over (all handed out, failed, or finished early).
    pub(crate) fn is_finished(&self) -> bool {
        self.finished
    }

    /// Handles for a thread running beside the run.
    pub(crate) fn watch(&self) -> Watch {
        Watch {
            dispatched: self.dispatched.clone(),
            dispatch_tick: self.tick_rx.clone(),
            cancel: self.cancel.clone(),
            stop: self.stop_rx.clone(),
        }
    }

    /// Joins `thread` when the run stops (a thread started with [`Run::watch`]'s handles).
    pub(crate) fn adopt(&mut self, thread: JoinHandle<()>) {
        self.threads.push(thread);
    }

    /// Starts the dispatcher and `readers` reader threads, named after `name`.
    pub(crate) fn start(&mut self, readers: usize, name: &str) -> Result<(), StreamError> {
        let (Some(job_tx), Some(msg_tx)) = (self.job_tx.take(), self.msg_tx.take()) else {
            // Started already.
            return Ok(());
        };
        {
            let (fill, cancel, stop_rx) =
                (self.fill.clone(), self.cancel.clone(), self.stop_rx.clone());
            let (jobs, done) = (self.jobs, self.dispatched.clone());
            // Dropped with the dispatcher: watchers see the end as a disconnection.
            let tick = self.tick_tx.take();
            self.threads.push(
                std::thread::Builder::new()
                    .name(format!("{name}-dispatch"))
                    .spawn(move || {
                        let to = Dispatched { count: &done, tick };
                        dispatch(fill.ring(), jobs, &cancel, &stop_rx, &job_tx, &to)
                    })
                    .map_err(spawn_err)?,
            );
        }
        for i in 0..readers {
            let (fill, cancel) = (self.fill.clone(), self.cancel.clone());
            let (job_rx, msg_tx) = (self.job_rx.clone(), msg_tx.clone());
            self.threads.push(
                std::thread::Builder::new()
                    .name(format!("{name}-read-{i}"))
                    .spawn(move || read_loop(&*fill, &cancel, &job_rx, &msg_tx))
                    .map_err(spawn_err)?,
            );
        }
        Ok(())
    }

    /// The next job in order as `(seq, slot)`, blocking until its copy has been issued; `None`
    /// at the end. After an error the run is over — except [`StreamError::RingHeld`] (the
    /// consumer holds every slot), after which giving a slot back and calling again goes on.
    /// The caller counts the slot as held ([`Ring::hold`]).
    pub(crate) fn next(&mut self) -> Option<Result<(u64, usize), StreamError>> {
        if self.finished {
            return None;
        }
        if self.next_seq == self.jobs {
            self.finish();
            return None;
        }
        let ring = self.fill.ring();
        if ring.held.load(Ordering::Acquire) >= ring.slots.len() {
            // Every slot is in the consumer's hands: waiting for the next job would never end.
            return Some(Err(StreamError::RingHeld {
                ring: ring.slots.len(),
            }));
        }
        loop {
            if let Some(slot) = self.pending.remove(&self.next_seq) {
                let seq = self.next_seq;
                self.next_seq += 1;
                return Some(Ok((seq, slot)));
            }
            let waited = Instant::now();
            let msg = self.rx.recv();
            add_since(&self.fill.ring().counters.consumer_wait_ns, waited);
            match msg {
                Ok(Msg::Ready { seq, slot }) => {
                    self.pending.insert(seq, slot);
                }
                Ok(Msg::Failed(e)) => {
                    self.finish();
                    return Some(Err(e));
                }
                Err(_) => {
                    self.finish();
                    return Some(Err(StreamError::ReaderGone));
                }
            }
        }
    }

    /// Ends the run: no more jobs are handed out and the readers stop.
    pub(crate) fn finish(&mut self) {
        self.finished = true;
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// Finishes the run, waits for its threads, and gives back every slot it still holds.
    pub(crate) fn stop(&mut self) {
        self.finish();
        // Wakes a dispatcher waiting for a free slot; it then drops the job sender, which ends
        // the readers once they have given back the slots of the jobs left.
        self.stop_tx = None;
        self.job_tx = None;
        self.msg_tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let ring = self.fill.ring();
        for job in self.job_rx.try_iter() {
            ring.release(job.slot);
        }
        for msg in self.rx.try_iter() {
            if let Msg::Ready { slot, .. } = msg {
                ring.release(slot);
            }
        }
        for (_, slot) in std::mem::take(&mut self.pending) {
            ring.release(slot);
        }
    }
}

impl<F: Fill> Drop for Run<F> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where the dispatcher counts the jobs handed out, and tells watchers it did.
struct Dispatched<'a> {
    count: &'a AtomicU64,
    tick: Option<Sender<()>>,
}

/// Hands jobs `0..jobs` the free slots in order until the end, a cancel or a stop.
fn dispatch<D: Device>(
    ring: &Ring<D>,
    jobs: u64,
    cancel: &AtomicBool,
    stop_rx: &Receiver<()>,
    job_tx: &Sender<Job>,
    dispatched: &Dispatched<'_>,
) {
    for seq in 0..jobs {
        if cancel.load(Ordering::Relaxed) {
            return;
        }
        let slot = select! {
            recv(ring.free_rx) -> slot => match slot { Ok(s) => s, Err(_) => return },
            recv(stop_rx) -> _ => return,
        };
        if cancel.load(Ordering::Relaxed) {
            ring.release(slot);
            return;
        }
        if let Err(e) = job_tx.send(Job { seq, slot }) {
            ring.release(e.into_inner().slot);
            return;
        }
        dispatched.count.store(seq + 1, Ordering::Relaxed);
        if let Some(tick) = &dispatched.tick {
            // Full: a tick is waiting already, and its watcher reads the count anew.
            let _ = tick.try_send(());
        }
    }
}

/// A reader: fills jobs until the dispatcher is done, giving back the slots of jobs it drains
/// after a cancel.
fn read_loop<F: Fill>(fill: &F, cancel: &AtomicBool, job_rx: &Receiver<Job>, msg_tx: &Sender<Msg>) {
    let ring = fill.ring();
    let mut scratch = F::Scratch::default();
    loop {
        // A reader without a job is waiting for the consumer to give a slot back: the
        // dispatcher hands out jobs as soon as slots are free.
        let waited = Instant::now();
        let job = job_rx.recv();
        add_since(&ring.counters.ring_wait_ns, waited);
        let Ok(job) = job else { return };
        if cancel.load(Ordering::Relaxed) {
            ring.release(job.slot);
            continue;
        }
        match fill_slot(fill, &job, &mut scratch) {
            Ok(()) => {
                let ready = Msg::Ready {
                    seq: job.seq,
                    slot: job.slot,
                };
                if msg_tx.send(ready).is_err() {
                    ring.release(job.slot);
                }
            }
            Err(e) => {
                cancel.store(true, Ordering::Relaxed);
                ring.release(job.slot);
                let _ = msg_tx.send(Msg::Failed(e));
            }
        }
    }
}

/// Fills one job's slot through `fill` and enqueues the copy to the device.
fn fill_slot<F: Fill>(fill: &F, job: &Job, scratch: &mut F::Scratch) -> Result<(), StreamError> {
    let ring = fill.ring();
    let slot = &ring.slots[job.slot];
    let device = &ring.device;
    // The host buffer may still be the source of this slot's previous copy: the slot is not
    // free until that copy is done, so this counts as waiting for a free buffer.
    let waited = Instant::now();
    let synced = device.event_synchronize(&slot.copied);
    add_since(&ring.counters.ring_wait_ns, waited);
    synced?;
    let mut host = slot.host.lock().unwrap_or_else(PoisonError::into_inner);
    let read = Instant::now();
    let used = fill.fill(job.seq, host.as_mut(), scratch);
    add_since(&ring.counters.storage_ns, read);
    // Both buffers were allocated with `slot_bytes`; a fill that claims more is a bug, and the
    // copy must not run past them.
    let used = used?.min(ring.slot_bytes);
    // The device buffer may still be in use by the consumer's work on the slot's last job.
    device.stream_wait(StreamKind::Copy, &slot.consumed)?;
    // SAFETY: the slot belongs to this job until the consumer gives it back, which comes after
    // `copied` (recorded next) is handed over with it; the next writer of `host` waits for
    // `copied` above, and the next copy into `device` follows this one on the copy stream.
    // `used` is at most the size both buffers were allocated with.
    unsafe { device.copy_to_device_async(&host, &slot.device, used)? };
    device.record(&slot.copied, StreamKind::Copy)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::HostDevice;

    /// Writes each job's number into its slot; fails job `fail_at`.
    struct Numbers {
        ring: Ring<HostDevice>,
        fail_at: Option<u64>,
    }

    impl Fill for Numbers {
        type Device = HostDevice;
        type Scratch = ();

        fn ring(&self) -> &Ring<HostDevice> {
            &self.ring
        }

        fn fill(&self, seq: u64, buf: &mut [u8], _: &mut ()) -> Result<usize, StreamError> {
            if Some(seq) == self.fail_at {
                return Err(StreamError::Config(format!("job {seq} fails")));
            }
            buf[..8].copy_from_slice(&seq.to_le_bytes());
            Ok(8)
        }
    }

    fn numbers(slots: usize, fail_at: Option<u64>) -> Arc<Numbers> {
        let device = Arc::new(HostDevice::new().unwrap());
        let ring = Ring::new(device, slots, 8, "test").unwrap();
        Arc::new(Numbers { ring, fail_at })
    }

    #[test]
    fn jobs_come_in_order_and_an_early_stop_gives_every_slot_back() {
        let fill = numbers(3, None);
        let mut run = Run::new(fill.clone(), 100);
        run.start(2, "test").unwrap();
        for want in 0..10 {
            let (seq, slot) = run.next().unwrap().unwrap();
            assert_eq!(seq, want);
            fill.ring.hold(8);
            fill.ring
                .device
                .event_synchronize(&fill.ring.slot(slot).copied)
                .unwrap();
            // SAFETY: the copy into the slot is complete and the slot is held until given back.
            let got = unsafe { HostDevice::device_bytes(&fill.ring.slot(slot).device, 8) };
            assert_eq!(got, want.to_le_bytes());
            fill.ring.give_back(slot, seq, true);
        }
        let (seq, held) = run.next().unwrap().unwrap();
        fill.ring.hold(8);
        // Stopped with one slot held, others read ahead or being read.
        drop(run);
        assert_eq!(fill.ring.free_rx.len(), 2);
        fill.ring.give_back(held, seq, true);
        assert_eq!(fill.ring.free_rx.len(), 3);
    }

    #[test]
    fn a_failed_fill_ends_the_run_and_gives_every_slot_back() {
        let fill = numbers(4, Some(5));
        let mut run = Run::new(fill.clone(), 100);
        run.start(3, "test").unwrap();
        let mut seen = 0;
        let err = loop {
            match run.next() {
                Some(Ok((seq, slot))) => {
                    assert_eq!(seq, seen);
                    seen += 1;
                    fill.ring.hold(8);
                    fill.ring.give_back(slot, seq, true);
                }
                Some(Err(e)) => break e,
                None => panic!("the run ended without its error"),
            }
        };
        assert!(err.to_string().contains("job 5 fails"), "{err}");
        assert!(seen <= 5);
        assert!(run.is_finished());
        assert!(run.next().is_none());
        run.stop();
        assert_eq!(fill.ring.free_rx.len(), 4);
    }

    #[test]
    fn holding_every_slot_is_an_error_until_one_comes_back() {
        let fill = numbers(2, None);
        let mut run = Run::new(fill.clone(), 5);
        run.start(1, "test").unwrap();
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(run.next().unwrap().unwrap());
            fill.ring.hold(8);
        }
        assert!(matches!(
            run.next(),
            Some(Err(StreamError::RingHeld { ring: 2 }))
        ));
        for (seq, slot) in held {
            fill.ring.give_back(slot, seq, true);
        }
        let rest: Vec<u64> = std::iter::from_fn(|| run.next())
            .map(|r| {
                let (seq, slot) = r.unwrap();
                fill.ring.hold(8);
                fill.ring.give_back(slot, seq, true);
                seq
            })
            .collect();
        assert_eq!(rest, [2, 3, 4]);
        assert!(run.is_finished());
    }
}
