//! `stagefs._native`: the loader of `stagefs-gpu` as a Python extension module.
//!
//! The Python side (`python/stagefs/__init__.py`) wraps these classes: [`PyLoader`] owns a
//! [`Loader`] on the CPU or on a CUDA GPU, [`PyEpoch`] is one pass over it (an iterator of
//! tuples), and each element of a tuple is a [`PyTensor`]: one part of a batch, which exports
//! itself through DLPack (`__dlpack__` / `__dlpack_device__`) so `torch.from_dlpack` and
//! `numpy.from_dlpack` see the ring's memory without a copy. Every tensor of a batch holds an
//! `Arc` of it; the batch (and so its ring slot) is given back when the last one goes, however
//! long that is after the epoch or the loader ended.
//!
//! On a GPU, `__dlpack__(stream=S)` makes the consumer's stream S wait for the batch's copy
//! event, and when the batch is released its consumed event is recorded on S, so the streamer's
//! next copy into that device buffer waits for the consumer's kernels that still read it.
//!
//! Waiting for a batch releases the GIL. Errors arrive as Python exceptions whose message names
//! the file: `OSError` for I/O, `ValueError` for files that are not what they claim and for bad
//! settings, `RuntimeError` for the device and for a consumer that holds every ring slot.

use std::ffi::c_void;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use dlpark::ffi::{
    DLDataType, DLDataTypeCode, DLDevice, DLManagedTensor, DLManagedTensorVersioned,
};
use dlpark::metadata::Dynamic;
use dlpark::python::{export_dlpack, CudaStreamRequest, DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyStopIteration, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use stagefs_gpu::partition::{NodeLayout, Segment};
use stagefs_gpu::{
    CpuDevice, Crop, CudaDevice, DeviceError, Epoch, Geometry, LoadedBatch, Loader, LoaderConfig,
    OutType, Source, StreamError, Transform,
};

mod partition;
use partition::{segments, SegmentArgs};
use stagefs_npy::DType;

/// A Rust error as the Python exception a user expects.
fn py_err(e: StreamError) -> PyErr {
    let msg = e.to_string();
    match &e {
        StreamError::Io { path, source } => match source.raw_os_error() {
            Some(errno) => PyOSError::new_err((errno, msg, path.display().to_string())),
            None => PyOSError::new_err(msg),
        },
        StreamError::Header { .. }
        | StreamError::Truncated { .. }
        | StreamError::TooLarge { .. }
        | StreamError::RowRange { .. }
        | StreamError::Scalar { .. }
        | StreamError::Config(_) => PyValueError::new_err(msg),
        StreamError::RingHeld { .. } => PyRuntimeError::new_err(format!(
            "{msg}. Tensors you keep hold their ring slot: keep a copy (tensor.clone()) instead, \
             or pass a larger ring= to stagefs.Loader"
        )),
        StreamError::Device(_) | StreamError::ReaderGone => PyRuntimeError::new_err(msg),
    }
}

fn device_err(e: DeviceError) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// The loader on one of the two devices a training program uses.
enum AnyLoader {
    Cpu(Loader<CpuDevice>),
    Cuda(Loader<CudaDevice>),
}

enum AnyEpoch {
    Cpu(Epoch<CpuDevice>),
    Cuda(Epoch<CudaDevice>),
}

enum AnyBatch {
    Cpu(LoadedBatch<CpuDevice>),
    Cuda(LoadedBatch<CudaDevice>),
}

/// A batch held by the tensors made from it.
struct HeldBatch {
    batch: AnyBatch,
    /// The consumer's CUDA stream (a raw handle) named in the last `__dlpack__` call; the
    /// release is recorded there. 0: none named yet.
    stream: AtomicIsize,
}

impl Drop for HeldBatch {
    fn drop(&mut self) {
        if let AnyBatch::Cuda(batch) = &mut self.batch {
            let stream = self.stream.load(Ordering::Acquire);
            if stream != 0 {
                // SAFETY: the handle came from the consumer for this device; a consumer's
                // stream outlives the tensors it used (PyTorch never destroys its pooled
                // streams).
                let recorded = unsafe {
                    batch
                        .device()
                        .record_on_raw_stream(batch.consumed_event(), stream as _)
                };
                match recorded {
                    Ok(()) => batch.mark_consumed_recorded(),
                    Err(e) => tracing::warn!("recording a batch's release failed: {e}"),
                }
            }
        }
    }
}

/// The transform that `stagefs.Loader` describes as a tuple: `(crop, size, scale, ratio, flip,
/// mean, std, dtype, layout)`, crop one of `full`, `random_resized`, `center`.
type TransformArgs = (
    String,
    u32,
    (f64, f64),
    (f64, f64),
    bool,
    Option<Vec<f64>>,
    Option<Vec<f64>>,
    String,
    String,
);

fn transform_of(args: TransformArgs) -> PyResult<Transform> {
    let (crop, size, scale, ratio, flip, mean, std, dtype, layout) = args;
    let crop = match crop.as_str() {
        "full" => Crop::Full,
        "random_resized" => Crop::RandomResized { size, scale, ratio },
        "center" => Crop::Center { size },
        other => return Err(PyValueError::new_err(format!("unknown crop {other:?}"))),
    };
    let dtype = match dtype.as_str() {
        "uint8" => OutType::U8,
        "float16" => OutType::F16,
        "float32" => OutType::F32,
        other => {
            return Err(PyValueError::new_err(format!(
                "dtype {other:?}: use uint8, float16 or float32"
            )))
        }
    };
    let channels_first = match layout.as_str() {
        "NHWC" => false,
        "NCHW" => true,
        other => {
            return Err(PyValueError::new_err(format!(
                "layout {other:?}: use NHWC or NCHW"
            )))
        }
    };
    let normalize = match (mean, std) {
        (Some(m), Some(s)) => Some((m, s)),
        (None, None) => None,
        _ => return Err(PyValueError::new_err("normalize needs both mean and std")),
    };
    Ok(Transform {
        crop,
        flip,
        normalize,
        dtype,
        channels_first,
    })
}

/// The crop window `(top, left, height, width, flip)` of sample `row` in `epoch` for images of
/// `height × width`: what the readers use (for tests and for checking a pipeline).
#[pyfunction]
fn crop_box(
    transform: TransformArgs,
    seed: u64,
    epoch: u64,
    row: u64,
    height: u32,
    width: u32,
) -> PyResult<(u32, u32, u32, u32, bool)> {
    let t = transform_of(transform)?;
    let g = Geometry {
        height,
        width,
        channels: 3,
    };
    t.check(&[u64::from(height), u64::from(width), 3], Some(DType::U8))
        .map_err(py_err)?;
    let b = t.crop_box(seed, epoch, row, g);
    Ok((b.top, b.left, b.height, b.width, b.flip))
}

/// `stagefs._native.Loader(paths, batch_size, shuffle, seed, drop_last, device, rank,
/// world_size, ring, readers, pin_memory, transform, hints, direct, partition)`: see
/// `stagefs.Loader`; `partition` is `(local_world_size, exchange)` for a node partition, `None`
/// for the global split.
#[pyclass(module = "stagefs._native", name = "Loader", frozen)]
struct PyLoader {
    loader: AnyLoader,
    /// The running epoch, closed when the next one starts.
    current: Mutex<Option<Py<PyEpoch>>>,
}

#[pymethods]
impl PyLoader {
    #[new]
    #[pyo3(signature = (paths, batch_size, shuffle, seed, drop_last, device, rank, world_size, ring, readers, pin_memory, transform=None, hints=true, direct=true, partition=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        paths: Vec<std::path::PathBuf>,
        batch_size: u64,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
        device: &str,
        rank: u64,
        world_size: u64,
        ring: usize,
        readers: usize,
        pin_memory: Option<bool>,
        transform: Option<TransformArgs>,
        hints: bool,
        direct: bool,
        partition: Option<(u64, f64)>,
    ) -> PyResult<Self> {
        let transform = transform.map(transform_of).transpose()?;
        let config = LoaderConfig {
            transform,
            batch_size,
            shuffle,
            seed,
            drop_last,
            rank,
            world_size,
            ring,
            readers,
            hints,
            direct,
            partition: partition.map(|(local_world_size, exchange)| NodeLayout {
                local_world_size,
                exchange,
                grid: None,
            }),
        };
        let device = device.trim().to_ascii_lowercase();
        let loader = py.detach(|| -> PyResult<AnyLoader> {
            let sources = paths
                .iter()
                .map(Source::npy)
                .collect::<Result<Vec<_>, _>>()
                .map_err(py_err)?;
            if device == "cpu" {
                let cpu = match pin_memory {
                    Some(true) => CpuDevice::pinned(0).map_err(device_err)?,
                    Some(false) => CpuDevice::new(),
                    // Pinned where a driver is present, as PyTorch's pin_memory needs one.
                    None => CpuDevice::pinned(0).unwrap_or_default(),
                };
                return Ok(AnyLoader::Cpu(
                    Loader::new(Arc::new(cpu), sources, config).map_err(py_err)?,
                ));
            }
            let ordinal = match device.strip_prefix("cuda") {
                Some("") => 0,
                Some(n) => n
                    .strip_prefix(':')
                    .and_then(|n| n.parse::<usize>().ok())
                    .ok_or_else(|| bad_device(&device))?,
                None => return Err(bad_device(&device)),
            };
            let cuda = CudaDevice::new(ordinal).map_err(device_err)?;
            Ok(AnyLoader::Cuda(
                Loader::new(Arc::new(cuda), sources, config).map_err(py_err)?,
            ))
        })?;
        Ok(PyLoader {
            loader,
            current: Mutex::new(None),
        })
    }

    /// Starts epoch `epoch` after `start` positions of its permutation were consumed by all
    /// ranks (0: the whole epoch) — or, when given, after the runs `before` of it
    /// (`[(nodes, local_world_size, consumed)]`) — closing the previous one if it still runs.
    #[pyo3(signature = (epoch, start=0, before=Vec::new()))]
    fn epoch(
        slf: &Bound<'_, Self>,
        epoch: u64,
        start: u64,
        before: Vec<SegmentArgs>,
    ) -> PyResult<Py<PyEpoch>> {
        let before: Vec<Segment> = segments(before);
        let py = slf.py();
        let this = slf.get();
        let mut current = this.current.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(old) = current.take() {
            old.get().close(py);
        }
        let started = py
            .detach(|| match &this.loader {
                AnyLoader::Cpu(l) if !before.is_empty() => {
                    l.epoch_after(epoch, &before).map(AnyEpoch::Cpu)
                }
                AnyLoader::Cuda(l) if !before.is_empty() => {
                    l.epoch_after(epoch, &before).map(AnyEpoch::Cuda)
                }
                AnyLoader::Cpu(l) => l.epoch_from(epoch, start).map(AnyEpoch::Cpu),
                AnyLoader::Cuda(l) => l.epoch_from(epoch, start).map(AnyEpoch::Cuda),
            })
            .map_err(py_err)?;
        let epoch = Py::new(
            py,
            PyEpoch {
                epoch: Mutex::new(Some(started)),
            },
        )?;
        *current = Some(epoch.clone_ref(py));
        Ok(epoch)
    }

    /// Closes the running epoch: its readers stop; tensors already handed out stay valid.
    fn close(&self, py: Python<'_>) {
        let current = self
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(epoch) = current {
            epoch.get().close(py);
        }
    }

    /// Batches per epoch.
    fn __len__(&self) -> usize {
        (match &self.loader {
            AnyLoader::Cpu(l) => l.batches_per_epoch(),
            AnyLoader::Cuda(l) => l.batches_per_epoch(),
        }) as usize
    }

    /// Rows in each file.
    #[getter]
    fn rows(&self) -> u64 {
        match &self.loader {
            AnyLoader::Cpu(l) => l.rows(),
            AnyLoader::Cuda(l) => l.rows(),
        }
    }

    /// Rows this rank visits per epoch.
    #[getter]
    fn rows_per_rank(&self) -> u64 {
        match &self.loader {
            AnyLoader::Cpu(l) => l.rows_per_rank(),
            AnyLoader::Cuda(l) => l.rows_per_rank(),
        }
    }

    /// Bytes of one ring slot (memory is `ring` slots on the host, and on the GPU too).
    #[getter]
    fn slot_bytes(&self) -> usize {
        match &self.loader {
            AnyLoader::Cpu(l) => l.slot_bytes(),
            AnyLoader::Cuda(l) => l.slot_bytes(),
        }
    }

    /// The device, in words (`cpu`, `cpu (pinned host memory)`, `cuda:0 (NVIDIA H200)`).
    #[getter]
    fn device(&self) -> String {
        use stagefs_gpu::Device;
        match &self.loader {
            AnyLoader::Cpu(l) => l.device().describe(),
            AnyLoader::Cuda(l) => l.device().describe(),
        }
    }

    /// The rows this rank visits in `epoch` from position `start` of its permutation, in order.
    /// With `before`, the rest after those runs of the epoch.
    #[pyo3(signature = (epoch, start=0, before=Vec::new()))]
    fn order(&self, epoch: u64, start: u64, before: Vec<SegmentArgs>) -> Vec<u64> {
        let before = segments(before);
        match &self.loader {
            AnyLoader::Cpu(l) if !before.is_empty() => l.order_after(epoch, &before),
            AnyLoader::Cuda(l) if !before.is_empty() => l.order_after(epoch, &before),
            AnyLoader::Cpu(l) => l.order_from(epoch, start),
            AnyLoader::Cuda(l) => l.order_from(epoch, start),
        }
    }

    /// Batches of epoch's rest from position `start` of its permutation (or after `before`).
    #[pyo3(signature = (start, before=Vec::new()))]
    fn batches_from(&self, start: u64, before: Vec<SegmentArgs>) -> u64 {
        let before = segments(before);
        match &self.loader {
            AnyLoader::Cpu(l) if !before.is_empty() => l.batches_after(&before),
            AnyLoader::Cuda(l) if !before.is_empty() => l.batches_after(&before),
            AnyLoader::Cpu(l) => l.batches_from(start),
            AnyLoader::Cuda(l) => l.batches_from(start),
        }
    }

    /// Where the node partition cuts exchanged chunks, `(offset, row_bytes, chunk_bytes)`
    /// (`None`: global split).
    #[getter]
    fn grid(&self) -> Option<(u64, u64, u64)> {
        let config = match &self.loader {
            AnyLoader::Cpu(l) => l.config(),
            AnyLoader::Cuda(l) => l.config(),
        };
        let g = config.partition.and_then(|p| p.grid)?;
        Some((g.offset, g.row_bytes, g.chunk_bytes))
    }

    /// Who waited on whom, over all epochs so far (the figures of `stagefs stream --json`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, ring, direct) = match &self.loader {
            AnyLoader::Cpu(l) => (l.stats(), l.config().ring, l.direct_status()),
            AnyLoader::Cuda(l) => (l.stats(), l.config().ring, l.direct_status()),
        };
        let d = PyDict::new(py);
        let fallbacks = PyDict::new(py);
        for (path, why) in direct {
            if let Some(why) = why {
                fallbacks.set_item(path.display().to_string(), why)?;
            }
        }
        d.set_item(
            "direct_files",
            direct.iter().filter(|(_, w)| w.is_none()).count(),
        )?;
        d.set_item("direct_fallbacks", fallbacks)?;
        d.set_item("device", self.device())?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("batches", s.batches)?;
        d.set_item("ring", ring)?;
        d.set_item("readers", s.readers)?;
        d.set_item("seconds", s.elapsed.as_secs_f64())?;
        d.set_item("gb_per_s", s.gb_per_s())?;
        d.set_item("batches_per_s", s.batches_per_s())?;
        d.set_item("device_wait_s", s.consumer_wait.as_secs_f64())?;
        d.set_item("device_wait_share", s.consumer_wait_share())?;
        d.set_item("storage_read_s", s.storage_read.as_secs_f64())?;
        d.set_item("storage_share", s.storage_share())?;
        d.set_item("ring_full_wait_s", s.ring_full_wait.as_secs_f64())?;
        d.set_item("ring_full_share", s.ring_full_share())?;
        d.set_item("verdict", s.verdict())?;
        Ok(d)
    }
}

fn bad_device(device: &str) -> PyErr {
    PyValueError::new_err(format!(
        "device {device:?}: use \"cpu\", \"cuda\" or \"cuda:N\""
    ))
}

/// One epoch: an iterator of tuples of tensors, one per file.
#[pyclass(module = "stagefs._native", name = "Epoch", frozen)]
struct PyEpoch {
    epoch: Mutex<Option<AnyEpoch>>,
}

impl PyEpoch {
    fn close(&self, py: Python<'_>) {
        // Dropping an epoch joins its threads: not with the GIL held.
        let epoch = self
            .epoch
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        py.detach(move || drop(epoch));
    }
}

#[pymethods]
impl PyEpoch {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        let next = py.detach(|| {
            let mut guard = self.epoch.lock().unwrap_or_else(PoisonError::into_inner);
            match guard.as_mut() {
                None => None,
                Some(AnyEpoch::Cpu(e)) => e.next_batch().map(|r| r.map(AnyBatch::Cpu)),
                Some(AnyEpoch::Cuda(e)) => e.next_batch().map(|r| r.map(AnyBatch::Cuda)),
            }
        });
        let batch = match next {
            None => {
                self.close(py);
                return Err(PyStopIteration::new_err(()));
            }
            Some(Err(e)) => return Err(py_err(e)),
            Some(Ok(b)) => b,
        };
        let parts = match &batch {
            AnyBatch::Cpu(b) => b.parts().len(),
            AnyBatch::Cuda(b) => b.parts().len(),
        };
        let held = Arc::new(HeldBatch {
            batch,
            stream: AtomicIsize::new(0),
        });
        let tensors = (0..parts)
            .map(|part| {
                Py::new(
                    py,
                    PyTensor {
                        held: held.clone(),
                        part,
                    },
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        pyo3::types::PyTuple::new(py, tensors)
    }

    /// Stops the epoch now; tensors already handed out stay valid.
    #[pyo3(name = "close")]
    fn py_close(&self, py: Python<'_>) {
        self.close(py);
    }
}

/// One part of a batch (one file's rows), exported through DLPack without a copy.
#[pyclass(module = "stagefs._native", name = "Tensor", frozen)]
struct PyTensor {
    held: Arc<HeldBatch>,
    part: usize,
}

impl PyTensor {
    fn part(&self) -> &stagefs_gpu::Part {
        match &self.held.batch {
            AnyBatch::Cpu(b) => &b.parts()[self.part],
            AnyBatch::Cuda(b) => &b.parts()[self.part],
        }
    }

    fn data_ptr(&self) -> *mut c_void {
        let offset = self.part().offset;
        match &self.held.batch {
            // SAFETY: the part lies inside the slot's host buffer (see `LoadedBatch::parts`).
            AnyBatch::Cpu(b) => unsafe { b.host_ptr().add(offset) as *mut c_void },
            AnyBatch::Cuda(b) => (b.device_buffer().device_ptr() as usize + offset) as *mut c_void,
        }
    }

    fn export<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let part = self.part();
        let shape: Vec<i64> = part
            .shape
            .iter()
            .map(|&d| i64::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| PyValueError::new_err("a dimension exceeds DLPack's int64"))?;
        let mut init = Dynamic::compact(shape)
            .initialize_as::<M>(self.held.clone())
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        init.set_data(self.data_ptr())
            .set_dtype(dl_dtype(part.dtype))
            .set_device(self.dl_device());
        // SAFETY: the data pointer covers the part's bytes (shape × element size, compact) and
        // stays valid while the context (an Arc of the batch, which keeps its slot and the ring
        // alive) lives; the memory is writable and not a copy, so no flag is set.
        Ok(unsafe { init.finish() })
    }

    fn dl_device(&self) -> DLDevice {
        match &self.held.batch {
            AnyBatch::Cpu(_) => DLDevice::CPU,
            AnyBatch::Cuda(b) => DLDevice::cuda(b.device().ordinal() as i32),
        }
    }
}

/// The DLPack type of a `.npy` dtype (raw sources are bytes).
fn dl_dtype(dtype: Option<DType>) -> DLDataType {
    let (code, bits) = match dtype {
        Some(DType::Bool) => (DLDataTypeCode::BOOL, 8),
        Some(DType::I8) => (DLDataTypeCode::INT, 8),
        Some(DType::I16) => (DLDataTypeCode::INT, 16),
        Some(DType::I32) => (DLDataTypeCode::INT, 32),
        Some(DType::I64) => (DLDataTypeCode::INT, 64),
        Some(DType::U8) | None => (DLDataTypeCode::UINT, 8),
        Some(DType::U16) => (DLDataTypeCode::UINT, 16),
        Some(DType::U32) => (DLDataTypeCode::UINT, 32),
        Some(DType::U64) => (DLDataTypeCode::UINT, 64),
        Some(DType::F16) => (DLDataTypeCode::FLOAT, 16),
        Some(DType::F32) => (DLDataTypeCode::FLOAT, 32),
        Some(DType::F64) => (DLDataTypeCode::FLOAT, 64),
    };
    DLDataType::scalar(code, bits)
}

impl DlpackExporter for PyTensor {
    fn device(&self) -> DLDevice {
        self.dl_device()
    }

    fn flags(&self) -> DlpackFlags {
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, request: &ExportRequest<'_>) -> PyResult<()> {
        let AnyBatch::Cuda(batch) = &self.held.batch else {
            return Ok(());
        };
        let stream: isize = match request.cuda_stream()? {
            // The protocol's default: the legacy default stream.
            CudaStreamRequest::Omitted | CudaStreamRequest::LegacyDefault => 1,
            CudaStreamRequest::PerThreadDefault => 2,
            CudaStreamRequest::Pointer(p) => p as isize,
            // The consumer synchronizes itself; the release is still ordered after the legacy
            // default stream, which every blocking stream synchronizes with.
            CudaStreamRequest::NoSync => {
                self.held.stream.store(1, Ordering::Release);
                return Ok(());
            }
        };
        // SAFETY: the consumer handed us its stream for this device (or a sentinel).
        unsafe {
            batch
                .device()
                .wait_on_raw_stream(stream as _, batch.ready_event())
        }
        .map_err(device_err)?;
        self.held.stream.store(stream, Ordering::Release);
        Ok(())
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.export()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.export()
    }
}

#[pymethods]
impl PyTensor {
    #[pyo3(signature = (stream=None, *, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<&Bound<'_, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream, max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    fn __dlpack_device__(&self) -> (u32, i32) {
        let d = self.dl_device();
        (d.device_type.0, d.device_id)
    }

    /// The part's shape: the batch's rows, then the file's row shape.
    #[getter]
    fn shape(&self) -> Vec<u64> {
        self.part().shape.clone()
    }

    /// The numpy dtype name (`uint8` for a raw source).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.part().dtype.map_or("uint8", DType::name)
    }

    /// The source rows in this batch, in order.
    #[getter]
    fn rows(&self) -> Vec<u64> {
        match &self.held.batch {
            AnyBatch::Cpu(b) => b.rows().to_vec(),
            AnyBatch::Cuda(b) => b.rows().to_vec(),
        }
    }

    /// Position of the batch in its epoch.
    #[getter]
    fn seq(&self) -> u64 {
        match &self.held.batch {
            AnyBatch::Cpu(b) => b.seq(),
            AnyBatch::Cuda(b) => b.seq(),
        }
    }
}

/// The native half of the `stagefs` package.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLoader>()?;
    m.add_class::<PyEpoch>()?;
    m.add_class::<PyTensor>()?;
    m.add_function(wrap_pyfunction!(crop_box, m)?)?;
    partition::register(m)?;
    Ok(())
}
