//! The CUDA device (feature `cuda`): cudarc's driver API, with libcuda loaded at run time.
//!
//! Pinned buffers come from `cuMemHostAlloc` (cached, not write-combined, because the kernel's
//! `pread` copy into them and the verification read both touch them from the CPU; portable, so a
//! training program's own CUDA context copies from them at DMA speed too), device
//! buffers from `cuMemAlloc`, and the two streams are cudarc non-blocking streams. Events use
//! blocking sync so a consumer waiting on data sleeps instead of spinning a core. cudarc's
//! event tracking is turned off: the streamer orders its streams with its own events.
//!
//! cudarc panics when libcuda cannot be loaded; [`CudaDevice::new`] checks for the library
//! first and also catches a panic during initialisation, so a machine without a driver gets
//! [`DeviceError::DriverMissing`] instead of a crash.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};

use crate::device::{Device, StreamKind};
use crate::error::DeviceError;

fn cuda_err(call: &'static str) -> impl Fn(DriverError) -> DeviceError {
    move |e| DeviceError::Cuda {
        call,
        error: e.to_string(),
    }
}

/// Page-locked host memory from `cuMemHostAlloc`.
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain memory owned by this value; the streamer's events keep the CPU
// and the copy engine from using it at the same time.
unsafe impl Send for PinnedBuffer {}

impl AsRef<[u8]> for PinnedBuffer {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes allocated by cuMemHostAlloc and owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl AsMut<[u8]> for PinnedBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_ref`, and `&mut self` makes the access exclusive on the CPU side.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in this context; the streamer synchronizes the
            // device before dropping its ring, so no copy still reads it.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// Device memory from `cuMemAlloc`.
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    /// The raw device pointer, for the consumer's kernels.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemAlloc in this context; the device was synchronized first.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A CUDA GPU with a copy stream and a consumer stream.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    copy: Arc<CudaStream>,
    consumer: Arc<CudaStream>,
    name: String,
}

impl CudaDevice {
    /// Opens GPU `ordinal`; a clean error when there is no driver or no such GPU.
    pub fn new(ordinal: usize) -> Result<Self, DeviceError> {
        // SAFETY: only tries to dlopen the library; no CUDA call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::DriverMissing(
                "no libcuda.so or libcuda.so.1 on the library path".into(),
            ));
        }
        std::panic::catch_unwind(|| Self::open(ordinal)).unwrap_or_else(|_| {
            Err(DeviceError::DriverMissing(
                "the driver lacks a required CUDA 12 function".into(),
            ))
        })
    }

    fn open(ordinal: usize) -> Result<Self, DeviceError> {
        let count = CudaContext::device_count().map_err(cuda_err("cuDeviceGetCount"))?;
        if ordinal >= count.max(0) as usize {
            return Err(DeviceError::Cuda {
                call: "cuDeviceGet",
                error: format!("GPU {ordinal} does not exist; this machine has {count}"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: no CudaSlice is ever created in this context; buffers are ordered by our events.
        unsafe { ctx.disable_event_tracking() };
        let copy = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        let consumer = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        Ok(CudaDevice {
            ctx,
            copy,
            consumer,
            name,
        })
    }

    /// The context, for consumers that launch their own work.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The consumer stream: launch work that uses batches here (after [`crate::Batch::wait_on_consumer_stream`]).
    pub fn consumer_stream(&self) -> &Arc<CudaStream> {
        &self.consumer
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Makes a stream the caller owns (e.g. PyTorch's current stream, as a raw handle; 1 and 2
    /// are CUDA's legacy and per-thread default streams) wait for `event`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's context (or one of the two sentinels).
    pub unsafe fn wait_on_raw_stream(
        &self,
        stream: sys::CUstream,
        event: &CudaEvent,
    ) -> Result<(), DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: the event is alive (borrowed); the caller vouches for the stream.
        unsafe {
            result::stream::wait_event(
                stream,
                event.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda_err("cuStreamWaitEvent"))
    }

    /// Records `event` at the current end of a stream the caller owns (see
    /// [`CudaDevice::wait_on_raw_stream`]).
    ///
    /// # Safety
    /// As for [`CudaDevice::wait_on_raw_stream`].
    pub unsafe fn record_on_raw_stream(
        &self,
        event: &CudaEvent,
        stream: sys::CUstream,
    ) -> Result<(), DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: the event is alive (borrowed); the caller vouches for the stream.
        unsafe { result::event::record(event.cu_event(), stream) }
            .map_err(cuda_err("cuEventRecord"))
    }

    fn stream(&self, kind: StreamKind) -> &CudaStream {
        match kind {
            StreamKind::Copy => &self.copy,
            StreamKind::Consumer => &self.consumer,
        }
    }

    /// Measures the pinned host→device copy peak: `iters` async copies of `bytes` on one stream.
    /// Returns bytes per second.
    pub fn measure_h2d_peak(&self, bytes: usize, iters: u32) -> Result<f64, DeviceError> {
        let host = self.alloc_host(bytes)?;
        let dev = self.alloc_device(bytes)?;
        let done = self.new_event()?;
        // One untimed copy to warm up the copy engine and the page tables.
        // SAFETY: `host` and `dev` outlive the copies; we synchronize before returning.
        unsafe { self.copy_to_device_async(&host, &dev, bytes)? };
        self.record(&done, StreamKind::Copy)?;
        self.event_synchronize(&done)?;
        let start = Instant::now();
        for _ in 0..iters {
            // SAFETY: as above; nothing writes `host` or reads `dev` meanwhile.
            unsafe { self.copy_to_device_async(&host, &dev, bytes)? };
        }
        self.record(&done, StreamKind::Copy)?;
        self.event_synchronize(&done)?;
        Ok(bytes as f64 * f64::from(iters) / start.elapsed().as_secs_f64())
    }
}

impl Device for CudaDevice {
    type HostBuffer = PinnedBuffer;
    type DeviceBuffer = DeviceBuffer;
    type Event = CudaEvent;

    fn describe(&self) -> String {
        format!("cuda:{} ({})", self.ctx.ordinal(), self.name)
    }

    fn alloc_host(&self, bytes: usize) -> Result<PinnedBuffer, DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: a plain allocation call; the pointer is owned by the returned value.
        let ptr = unsafe { result::malloc_host(bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| DeviceError::Alloc {
                kind: "pinned host",
                bytes,
                reason: e.to_string(),
            })?;
        Ok(PinnedBuffer {
            ptr: ptr.cast(),
            len: bytes,
            ctx: self.ctx.clone(),
        })
    }

    fn alloc_device(&self, bytes: usize) -> Result<DeviceBuffer, DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: a plain allocation call; the pointer is owned by the returned value.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(|e| DeviceError::Alloc {
            kind: "device",
            bytes,
            reason: e.to_string(),
        })?;
        Ok(DeviceBuffer {
            ptr,
            len: bytes,
            ctx: self.ctx.clone(),
        })
    }

    fn new_event(&self) -> Result<CudaEvent, DeviceError> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(cuda_err("cuEventCreate"))
    }

    unsafe fn copy_to_device_async(
        &self,
        src: &PinnedBuffer,
        dst: &DeviceBuffer,
        len: usize,
    ) -> Result<(), DeviceError> {
        let len = len.min(src.len).min(dst.len);
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: the caller keeps `src` and `dst` alive and untouched until the copy is done.
        unsafe { result::memcpy_htod_async(dst.ptr, &src.as_ref()[..len], self.copy.cu_stream()) }
            .map_err(cuda_err("cuMemcpyHtoDAsync"))
    }

    fn record(&self, event: &CudaEvent, stream: StreamKind) -> Result<(), DeviceError> {
        event
            .record(self.stream(stream))
            .map_err(cuda_err("cuEventRecord"))
    }

    fn stream_wait(&self, stream: StreamKind, event: &CudaEvent) -> Result<(), DeviceError> {
        self.stream(stream)
            .wait(event)
            .map_err(cuda_err("cuStreamWaitEvent"))
    }

    fn event_synchronize(&self, event: &CudaEvent) -> Result<(), DeviceError> {
        event.synchronize().map_err(cuda_err("cuEventSynchronize"))
    }

    fn copy_to_host(&self, src: &DeviceBuffer, dst: &mut [u8]) -> Result<(), DeviceError> {
        let len = dst.len().min(src.len);
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        // SAFETY: `dst` lives until the stream is synchronized below; `src` holds `len` bytes.
        unsafe { result::memcpy_dtoh_async(&mut dst[..len], src.ptr, self.consumer.cu_stream()) }
            .map_err(cuda_err("cuMemcpyDtoHAsync"))?;
        self.consumer
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.copy
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
        self.consumer
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))
    }
}
