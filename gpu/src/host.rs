//! A host-memory "device" with real asynchronous streams, so the pipeline's logic is tested
//! without a GPU.
//!
//! Each of the two streams is a worker thread that runs its queued operations in order: copies,
//! event records and event waits — the semantics of CUDA streams, so a pipeline that forgot a
//! wait would read stale bytes here too. `copy_delay` slows every copy down to emulate a slow
//! bus in tests. Device buffers are plain heap memory; [`HostDevice::device_bytes`] reads one
//! directly once its copy is known to be done.

use std::cell::UnsafeCell;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{unbounded, Sender};

use crate::device::{Device, StreamKind};
use crate::error::DeviceError;

/// Page-locked host memory stand-in: an ordinary heap buffer.
pub struct HostBuffer(Box<[u8]>);

impl AsRef<[u8]> for HostBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl AsMut<[u8]> for HostBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// "Device" memory of the host device: heap memory written by the copy stream's thread.
pub struct HostDeviceBuffer(Box<[UnsafeCell<u8>]>);

// SAFETY: the buffer is written only by the copy stream's worker, and the `Device` contract
// (events ordering every copy before any read) keeps readers and that writer apart.
unsafe impl Sync for HostDeviceBuffer {}

impl HostDeviceBuffer {
    fn ptr(&self) -> *mut u8 {
        UnsafeCell::raw_get(self.0.as_ptr())
    }

    /// Buffer length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Touches every page so the buffer is resident before streaming starts, as pinned and device
/// memory are: otherwise the first pass over the ring pays a page fault per 4 KiB and the
/// host device under-reports throughput. Volatile writes, because the allocator's zeroed pages
/// let the compiler drop a plain write of zero.
fn prefault(buf: &mut [u8]) {
    const PAGE: usize = 4096;
    for i in (0..buf.len()).step_by(PAGE) {
        // SAFETY: `i` is in bounds of `buf`, which we borrow mutably.
        unsafe { std::ptr::write_volatile(buf.as_mut_ptr().add(i), 0) };
    }
}

/// Progress of one event: how many records were issued and how many of them have completed.
#[derive(Default)]
struct EventState {
    recorded: u64,
    completed: u64,
}

/// An event of the host device.
#[derive(Default)]
pub struct HostEvent {
    state: Mutex<EventState>,
    done: Condvar,
}

impl HostEvent {
    fn issue(&self) -> u64 {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.recorded += 1;
        s.recorded
    }

    fn last_issued(&self) -> u64 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .recorded
    }

    fn complete(&self, generation: u64) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.completed = s.completed.max(generation);
        self.done.notify_all();
    }

    fn wait_for(&self, generation: u64) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while s.completed < generation {
            s = self.done.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// Raw pointers moved to a stream worker.
struct CopyOp {
    src: *const u8,
    dst: *mut u8,
    len: usize,
}

// SAFETY: the `Device::copy_to_device_async` contract keeps both buffers alive and untouched by
// anyone else until the copy's completion is observed through an event.
unsafe impl Send for CopyOp {}

/// Work run on a stream's thread, like a kernel launch.
type Kernel = Box<dyn FnOnce() + Send>;

enum Op {
    Copy(CopyOp),
    Run(Kernel),
    Record(Arc<HostEvent>, u64),
    Wait(Arc<HostEvent>, u64),
}

struct Stream {
    tx: Option<Sender<Op>>,
    worker: Option<JoinHandle<()>>,
}

impl Stream {
    fn spawn(name: &str, copy_delay: Duration) -> Result<Self, DeviceError> {
        let (tx, rx) = unbounded::<Op>();
        let worker = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                for op in rx {
                    match op {
                        Op::Copy(c) => {
                            if !copy_delay.is_zero() {
                                std::thread::sleep(copy_delay);
                            }
                            // SAFETY: see `CopyOp`'s Send justification; lengths were checked
                            // against both buffers when the copy was enqueued.
                            unsafe { std::ptr::copy_nonoverlapping(c.src, c.dst, c.len) };
                        }
                        Op::Run(kernel) => kernel(),
                        Op::Record(ev, generation) => ev.complete(generation),
                        Op::Wait(ev, generation) => ev.wait_for(generation),
                    }
                }
            })
            .map_err(|_| DeviceError::StreamGone)?;
        Ok(Stream {
            tx: Some(tx),
            worker: Some(worker),
        })
    }

    fn send(&self, op: Op) -> Result<(), DeviceError> {
        self.tx
            .as_ref()
            .ok_or(DeviceError::StreamGone)?
            .send(op)
            .map_err(|_| DeviceError::StreamGone)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// The host-memory device: "device" buffers in RAM, streams as worker threads.
pub struct HostDevice {
    copy: Stream,
    consumer: Stream,
}

impl HostDevice {
    /// A host device whose copies run at memory speed.
    pub fn new() -> Result<Self, DeviceError> {
        Self::with_copy_delay(Duration::ZERO)
    }

    /// A host device that sleeps `delay` before every copy (a slow bus, for tests).
    pub fn with_copy_delay(delay: Duration) -> Result<Self, DeviceError> {
        Ok(HostDevice {
            copy: Stream::spawn("stagefs-hostdev-copy", delay)?,
            consumer: Stream::spawn("stagefs-hostdev-consumer", Duration::ZERO)?,
        })
    }

    fn stream(&self, kind: StreamKind) -> &Stream {
        match kind {
            StreamKind::Copy => &self.copy,
            StreamKind::Consumer => &self.consumer,
        }
    }

    /// Enqueues `kernel` on the consumer stream, called with the first `len` bytes of `buf`
    /// when the stream reaches it — the host device's kernel launch.
    ///
    /// # Safety
    /// `buf` must stay alive, and nothing may write it, until an event recorded on the consumer
    /// stream after this call has completed.
    pub unsafe fn launch(
        &self,
        buf: &HostDeviceBuffer,
        len: usize,
        kernel: impl FnOnce(&[u8]) + Send + 'static,
    ) -> Result<(), DeviceError> {
        let data = CopyOp {
            src: buf.ptr(),
            dst: std::ptr::null_mut(),
            len: len.min(buf.len()),
        };
        self.consumer.send(Op::Run(Box::new(move || {
            let data = data;
            // SAFETY: the caller keeps the buffer alive and unwritten until this has run.
            kernel(unsafe { std::slice::from_raw_parts(data.src, data.len) })
        })))
    }

    /// The first `len` bytes of a device buffer, read directly.
    ///
    /// # Safety
    /// No copy into `buf` may be pending: the event recorded after the last copy into it must
    /// have been waited for (e.g. by [`crate::Batch::synchronize`]) and no new copy issued.
    pub unsafe fn device_bytes(buf: &HostDeviceBuffer, len: usize) -> &[u8] {
        let len = len.min(buf.len());
        // SAFETY: the caller guarantees no concurrent writer; the pointer covers `len` bytes.
        unsafe { std::slice::from_raw_parts(buf.ptr(), len) }
    }
}

impl Device for HostDevice {
    type HostBuffer = HostBuffer;
    type DeviceBuffer = HostDeviceBuffer;
    type Event = Arc<HostEvent>;

    fn describe(&self) -> String {
        "cpu (host memory)".to_string()
    }

    fn alloc_host(&self, bytes: usize) -> Result<HostBuffer, DeviceError> {
        let mut buf = vec![0u8; bytes].into_boxed_slice();
        prefault(&mut buf);
        Ok(HostBuffer(buf))
    }

    fn alloc_device(&self, bytes: usize) -> Result<HostDeviceBuffer, DeviceError> {
        let mut zeroed = vec![0u8; bytes].into_boxed_slice();
        prefault(&mut zeroed);
        // SAFETY: `UnsafeCell<u8>` is `repr(transparent)` over `u8`, so the slice layouts match.
        let cells = unsafe { Box::from_raw(Box::into_raw(zeroed) as *mut [UnsafeCell<u8>]) };
        Ok(HostDeviceBuffer(cells))
    }

    fn new_event(&self) -> Result<Arc<HostEvent>, DeviceError> {
        Ok(Arc::new(HostEvent::default()))
    }

    unsafe fn copy_to_device_async(
        &self,
        src: &HostBuffer,
        dst: &HostDeviceBuffer,
        len: usize,
    ) -> Result<(), DeviceError> {
        let len = len.min(src.0.len()).min(dst.len());
        self.copy.send(Op::Copy(CopyOp {
            src: src.0.as_ptr(),
            dst: dst.ptr(),
            len,
        }))
    }

    fn record(&self, event: &Arc<HostEvent>, stream: StreamKind) -> Result<(), DeviceError> {
        let generation = event.issue();
        self.stream(stream)
            .send(Op::Record(event.clone(), generation))
    }

    fn stream_wait(&self, stream: StreamKind, event: &Arc<HostEvent>) -> Result<(), DeviceError> {
        let generation = event.last_issued();
        self.stream(stream)
            .send(Op::Wait(event.clone(), generation))
    }

    fn event_synchronize(&self, event: &Arc<HostEvent>) -> Result<(), DeviceError> {
        event.wait_for(event.last_issued());
        Ok(())
    }

    fn copy_to_host(&self, src: &HostDeviceBuffer, dst: &mut [u8]) -> Result<(), DeviceError> {
        let done = self.new_event()?;
        self.record(&done, StreamKind::Consumer)?;
        self.event_synchronize(&done)?;
        let len = dst.len().min(src.len());
        // SAFETY: the consumer stream has drained, and by the `Device` contract the consumer
        // only asks for buffers whose copies it has waited on.
        dst[..len].copy_from_slice(unsafe { HostDevice::device_bytes(src, len) });
        Ok(())
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        for kind in [StreamKind::Copy, StreamKind::Consumer] {
            let done = self.new_event()?;
            self.record(&done, kind)?;
            self.event_synchronize(&done)?;
        }
        Ok(())
    }
}
