//! The CPU as the consumer's device: batches stay in host memory, handed to the consumer where
//! the reader wrote them.
//!
//! [`crate::HostDevice`] emulates a GPU (separate "device" memory, asynchronous copy streams) to
//! test the pipeline; [`CpuDevice`] is what a training program on the CPU uses: its "copy to the
//! device" is a no-op and the consumer reads the host buffer itself, so a batch costs one read
//! from storage and no copy. Host buffers are page-aligned heap memory, or page-locked memory
//! from the CUDA driver when asked for and available (then `tensor.cuda(non_blocking=True)` in
//! the consumer is a true asynchronous DMA, as with PyTorch's `pin_memory=True`).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::device::{Device, StreamKind};
use crate::error::DeviceError;

/// Alignment of host buffers: a page, so any element type and DLPack's 256-byte rule hold.
const PAGE: usize = 4096;

/// Page-aligned heap memory, zeroed at allocation.
pub struct AlignedBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value; the pipeline's hand-offs (channels)
// keep the reader thread and the consumer apart.
unsafe impl Send for AlignedBuffer {}

impl AlignedBuffer {
    fn layout(len: usize) -> Result<Layout, DeviceError> {
        Layout::from_size_align(len.max(1), PAGE).map_err(|e| DeviceError::Alloc {
            kind: "host",
            bytes: len,
            reason: e.to_string(),
        })
    }

    /// Allocates `len` zeroed bytes.
    pub fn new(len: usize) -> Result<Self, DeviceError> {
        let layout = Self::layout(len)?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or(DeviceError::Alloc {
            kind: "host",
            bytes: len,
            reason: "out of memory".into(),
        })?;
        Ok(AlignedBuffer { ptr, len })
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        if let Ok(layout) = Self::layout(self.len) {
            // SAFETY: allocated in `new` with this very layout.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl AsRef<[u8]> for AlignedBuffer {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialised (zeroed at allocation) bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl AsMut<[u8]> for AlignedBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_ref`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// A host buffer of the CPU device: heap memory, or page-locked memory from the CUDA driver.
pub enum CpuBuffer {
    /// Page-aligned heap memory.
    Heap(AlignedBuffer),
    /// Page-locked memory (`cuMemHostAlloc`, portable to every CUDA context).
    #[cfg(feature = "cuda")]
    Pinned(crate::cuda::PinnedBuffer),
}

impl AsRef<[u8]> for CpuBuffer {
    fn as_ref(&self) -> &[u8] {
        match self {
            CpuBuffer::Heap(b) => b.as_ref(),
            #[cfg(feature = "cuda")]
            CpuBuffer::Pinned(b) => b.as_ref(),
        }
    }
}

impl AsMut<[u8]> for CpuBuffer {
    fn as_mut(&mut self) -> &mut [u8] {
        match self {
            CpuBuffer::Heap(b) => b.as_mut(),
            #[cfg(feature = "cuda")]
            CpuBuffer::Pinned(b) => b.as_mut(),
        }
    }
}

/// The CPU device: the consumer reads batches in the host buffers the readers filled.
pub struct CpuDevice {
    #[cfg(feature = "cuda")]
    pin: Option<crate::cuda::CudaDevice>,
}

impl CpuDevice {
    /// A CPU device with ordinary (pageable) host memory.
    pub fn new() -> Self {
        CpuDevice {
            #[cfg(feature = "cuda")]
            pin: None,
        }
    }

    /// A CPU device whose buffers are page-locked through the CUDA driver of GPU `ordinal`
    /// (feature `cuda`); a clean error where there is no driver.
    #[cfg(feature = "cuda")]
    pub fn pinned(ordinal: usize) -> Result<Self, DeviceError> {
        Ok(CpuDevice {
            pin: Some(crate::cuda::CudaDevice::new(ordinal)?),
        })
    }

    /// Whether host buffers are page-locked.
    pub fn is_pinned(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.pin.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }
}

impl Default for CpuDevice {
    fn default() -> Self {
        CpuDevice::new()
    }
}

impl Device for CpuDevice {
    type HostBuffer = CpuBuffer;
    /// No device memory: the host buffer is the batch.
    type DeviceBuffer = ();
    /// Nothing runs asynchronously, so there is nothing to wait for.
    type Event = ();

    fn describe(&self) -> String {
        if self.is_pinned() {
            "cpu (pinned host memory)".into()
        } else {
            "cpu".into()
        }
    }

    fn alloc_host(&self, bytes: usize) -> Result<CpuBuffer, DeviceError> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &self.pin {
            return Ok(CpuBuffer::Pinned(cuda.alloc_host(bytes)?));
        }
        Ok(CpuBuffer::Heap(AlignedBuffer::new(bytes)?))
    }

    fn alloc_device(&self, _bytes: usize) -> Result<(), DeviceError> {
        Ok(())
    }

    fn new_event(&self) -> Result<(), DeviceError> {
        Ok(())
    }

    unsafe fn copy_to_device_async(
        &self,
        _src: &CpuBuffer,
        _dst: &(),
        _len: usize,
    ) -> Result<(), DeviceError> {
        Ok(())
    }

    fn record(&self, _event: &(), _stream: StreamKind) -> Result<(), DeviceError> {
        Ok(())
    }

    fn stream_wait(&self, _stream: StreamKind, _event: &()) -> Result<(), DeviceError> {
        Ok(())
    }

    fn event_synchronize(&self, _event: &()) -> Result<(), DeviceError> {
        Ok(())
    }

    fn copy_to_host(&self, _src: &(), _dst: &mut [u8]) -> Result<(), DeviceError> {
        Err(DeviceError::NoDeviceMemory)
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        Ok(())
    }
}
