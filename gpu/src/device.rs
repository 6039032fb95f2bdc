//! The `Device` trait: the five things the pipeline needs from a GPU, and nothing else.
//!
//! The pipeline talks to two streams: the *copy* stream, where host→device copies run, and the
//! *consumer* stream, where the user's work runs. Events order them: a copy-done event recorded
//! on the copy stream after each batch's copy (the consumer waits on it), and a consumed event
//! recorded on the consumer stream when a batch is released (the next copy into that device
//! buffer waits on it). The same semantics as CUDA's `cuEventRecord` / `cuStreamWaitEvent`: a
//! wait covers the work recorded by the most recent `record` before it.

use crate::error::DeviceError;

/// Which of the device's two streams an operation goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// Host→device copies issued by the streamer.
    Copy,
    /// The consumer's work (kernels, copies back for verification).
    Consumer,
}

/// A device the streamer can feed: CUDA (`CudaDevice`, feature `cuda`) or host memory
/// ([`crate::HostDevice`]).
pub trait Device: Send + Sync + 'static {
    /// Page-locked host memory the reader fills.
    type HostBuffer: AsMut<[u8]> + AsRef<[u8]> + Send;
    /// Device memory a batch lands in.
    type DeviceBuffer: Send + Sync;
    /// A point in a stream's work that another stream or the host can wait for.
    type Event: Send + Sync;

    /// A short description for reports, e.g. `cuda:0 (NVIDIA H200)` or `cpu`.
    fn describe(&self) -> String;
    /// Allocates `bytes` of pinned host memory.
    fn alloc_host(&self, bytes: usize) -> Result<Self::HostBuffer, DeviceError>;
    /// Allocates `bytes` of device memory.
    fn alloc_device(&self, bytes: usize) -> Result<Self::DeviceBuffer, DeviceError>;
    /// Creates an event with no work recorded.
    fn new_event(&self) -> Result<Self::Event, DeviceError>;
    /// Enqueues a copy of the first `len` bytes of `src` to the start of `dst` on the copy stream.
    ///
    /// # Safety
    /// Until an event recorded on the copy stream after this call has completed, the caller must
    /// not write `src` nor read or write `dst`, and both must stay alive; `len` must not exceed
    /// either buffer.
    unsafe fn copy_to_device_async(
        &self,
        src: &Self::HostBuffer,
        dst: &Self::DeviceBuffer,
        len: usize,
    ) -> Result<(), DeviceError>;
    /// Records `event` at the current end of `stream`'s work.
    fn record(&self, event: &Self::Event, stream: StreamKind) -> Result<(), DeviceError>;
    /// Makes `stream`'s later work wait for the work `event` last recorded (does not block the host).
    fn stream_wait(&self, stream: StreamKind, event: &Self::Event) -> Result<(), DeviceError>;
    /// Blocks the calling thread until the work `event` last recorded is done.
    fn event_synchronize(&self, event: &Self::Event) -> Result<(), DeviceError>;
    /// Copies the first `dst.len()` bytes of `src` to `dst`, ordered after the consumer
    /// stream's work, and waits for it (used to verify what arrived on the device).
    fn copy_to_host(&self, src: &Self::DeviceBuffer, dst: &mut [u8]) -> Result<(), DeviceError>;
    /// Blocks until all work on both streams is done.
    fn synchronize(&self) -> Result<(), DeviceError>;
}
