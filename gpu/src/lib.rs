//! The GPU streamer: `.npy` tensors into device memory through a ring of pinned host buffers.
//!
//! A [`Streamer`] takes [`Source`]s (`.npy` files, row ranges of them, or raw byte ranges), cuts
//! them into batches of `batch_rows` rows, reads batches on reader threads with large positioned
//! reads into a ring of K pinned host buffers, copies each to a device buffer asynchronously on a
//! copy stream, and hands batches out in order, each with an event the consumer's stream waits
//! on. Memory is bounded (K host and K device buffers of one batch each); readers block while
//! the ring is full; dropping a [`Batch`] returns its buffers. Shuffling by batch is
//! deterministic for a seed. [`Stats`] tell who waited on whom.
//!
//! A [`Loader`] is the same pipeline shaped for a training loop: several files with aligned
//! rows, batch by batch and epoch by epoch (shuffled per epoch, split across data-parallel
//! ranks as PyTorch's `DistributedSampler` does), each batch owning its ring slot until the
//! consumer drops it; the Python package `stagefs` (`gpu/python`) hands those batches to
//! PyTorch and numpy through DLPack. Its readers can also augment image rows ([`augment`]:
//! random resized crop, flip, normalisation, drawn from seed, epoch and sample), and an epoch can
//! start part-way ([`epoch_order_from`]), which is how a run resumes mid-epoch.
//!
//! The device is a trait: `CudaDevice` (feature `cuda`; libcuda is loaded at run time, so the
//! crate builds and runs without CUDA), [`CpuDevice`] (batches stay in host memory: what a CPU
//! consumer reads) or [`HostDevice`], host memory with asynchronous stream threads that tests
//! use to check the pipeline without a GPU.
//!
//! ```
//! use std::sync::Arc;
//! use stagefs_npy::{DType, NpyHeader};
//! use stagefs_gpu::{HostDevice, Source, StreamConfig, Streamer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A 10 × 3 float32 array: 120 bytes of data after the header.
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("x.npy");
//! let mut file = NpyHeader::new(DType::F32, vec![10, 3]).encode();
//! file.extend((0..120u8).collect::<Vec<u8>>());
//! std::fs::write(&path, &file)?;
//!
//! let device = Arc::new(HostDevice::new()?); // or CudaDevice::new(0)? with feature `cuda`
//! let config = StreamConfig { batch_rows: 4, ring: 3, ..StreamConfig::default() };
//! let streamer = Streamer::new(device, vec![Source::npy(&path)?], &config)?;
//! let mut rows = Vec::new();
//! while let Some(batch) = streamer.next_batch() {
//!     let batch = batch?;
//!     // On a GPU: batch.wait_on_consumer_stream()?, then launch kernels on that stream.
//!     rows.push(batch.meta().shape[0]);
//!     assert!(batch.verify()?.matches());
//!     assert_eq!(batch.data()?, &file[file.len() - 120 + batch.meta().rows.start as usize * 12..][..batch.len()]);
//! } // dropping the batch returns its buffers to the ring
//! assert_eq!(rows, [4, 4, 2]); // the last batch is partial
//! println!("{:.2} GB/s; {}", streamer.stats().gb_per_s(), streamer.stats().verdict());
//! # Ok(())
//! # }
//! ```

pub mod augment;
pub mod bounds;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod device;
pub mod direct;
mod error;
pub mod hints;
mod host;
pub mod loader;
pub mod order;
pub mod partition;
pub mod plan;
mod ring;
mod source;
mod stats;
mod streamer;

pub use augment::{Crop, CropBox, Geometry, OutType, Transform};
pub use cpu::{AlignedBuffer, CpuBuffer, CpuDevice};
#[cfg(feature = "cuda")]
pub use cuda::{CudaDevice, DeviceBuffer as CudaDeviceBuffer, PinnedBuffer};
pub use device::{Device, StreamKind};
pub use error::{DeviceError, StreamError};
pub use host::{HostBuffer, HostDevice, HostDeviceBuffer, HostEvent};
pub use loader::{epoch_order, epoch_order_from, Epoch, LoadedBatch, Loader, LoaderConfig, Part};
pub use source::{ReadAt, Source};
pub use stats::Stats;
pub use streamer::{
    Batch, BatchMeta, StreamConfig, Streamer, Verification, AUTO_BATCH_BYTES, MAX_AUTO_READERS,
    MAX_BATCH_BYTES,
};
