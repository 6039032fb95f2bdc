//! `stagefs stream`: runs the GPU streamer over `.npy` files with a kernel-free sink as the
//! consumer, and reports throughput and who waited on whom.
//!
//! The sink waits on each batch's ready event from the host, so "device waited on data" is the
//! time a GPU job would have idled for lack of input. Defaults: the library's
//! [`StreamConfig::auto`] (batches of about 32 MiB, a reader per core up to 8, a ring of 4
//! more slots than readers).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use stagefs_gpu::{Device, HostDevice, Source, Stats, StreamConfig, Streamer};

/// Batches checked by `--verify` at most (spread evenly over the stream).
const VERIFY_SAMPLES: u64 = 64;

/// Arguments of `stagefs stream`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  stagefs stream data/images.npy --device 0 --verify
  stagefs stream train/*.npy --batch-rows 256 --epochs 3 --shuffle --seed 7
  stagefs stream big.npy --cold --device 0        # from disk, not the page cache
  stagefs stream --bench-peak --device 0          # the pinned host-to-device copy peak
  stagefs stream big.npy --cold --consume-gbps 5  # can storage feed a job eating 5 GB/s?

Reading the report: if the device waited on data for more than a few percent of the time, the
job is I/O-bound (storage or the bus cannot keep up); if the readers waited for free buffers,
the consumer is the bottleneck and faster storage would not help.")]
pub struct Args {
    /// `.npy` files to stream (C order, little-endian; each file is cut into its own batches).
    #[arg(required_unless_present = "bench_peak")]
    files: Vec<PathBuf>,
    /// Rows per batch [default: rows that make batches of about 32 MiB].
    #[arg(long, value_name = "N")]
    batch_rows: Option<u64>,
    /// `cpu` (host memory), a GPU number such as `0`, or `auto` (GPU 0 when CUDA is built in
    /// and a driver is present, otherwise cpu).
    #[arg(long, default_value = "auto", value_name = "0|cpu|auto")]
    device: String,
    /// Passes over all files.
    #[arg(long, default_value_t = 1, value_name = "E")]
    epochs: u32,
    /// Visit batches in a random order, a new one each epoch (deterministic for a seed).
    #[arg(long)]
    shuffle: bool,
    /// Seed for --shuffle.
    #[arg(long, default_value_t = 0, value_name = "S", requires = "shuffle")]
    seed: u64,
    /// Ring buffers K (pinned host and device memory used: K × batch bytes each)
    /// [default: readers + 4, at least 8].
    #[arg(long, value_name = "K")]
    ring: Option<usize>,
    /// Reader threads [default: min(16, CPU cores)].
    #[arg(long, value_name = "R")]
    readers: Option<usize>,
    /// Copy a sample of batches back from the device and compare CRC-32s with the files.
    #[arg(long)]
    verify: bool,
    /// Evict the files from the page cache first, to measure storage rather than memory.
    #[arg(long)]
    cold: bool,
    /// Measure the pinned host-to-device copy peak (CUDA) and report ratios against it.
    #[arg(long)]
    bench_peak: bool,
    /// Make the consumer take len/RATE seconds per batch, like a training step consuming RATE
    /// GB/s: checks that a job of that speed is kept fed (the device should then rarely wait).
    #[arg(long, value_name = "RATE")]
    consume_gbps: Option<f64>,
    /// Print the report as one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

/// The device chosen by `--device`.
enum Choice {
    Cpu,
    Gpu(usize),
}

fn choose(device: &str) -> anyhow::Result<Choice> {
    match device {
        "cpu" => Ok(Choice::Cpu),
        "auto" => Ok(auto_device()),
        n => n.parse().map(Choice::Gpu).map_err(|_| {
            anyhow::anyhow!("--device {n:?}: expected `cpu`, `auto` or a GPU number such as 0")
        }),
    }
}

#[cfg(feature = "cuda")]
fn auto_device() -> Choice {
    match stagefs_gpu::CudaDevice::new(0) {
        Ok(_) => Choice::Gpu(0),
        Err(e) => {
            tracing::info!("no usable GPU ({e}); streaming to host memory");
            Choice::Cpu
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn auto_device() -> Choice {
    Choice::Cpu
}

/// Runs `stagefs stream`; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    super::logging::init("warn");
    match choose(&args.device)? {
        Choice::Cpu => {
            if args.bench_peak {
                bail!("--bench-peak measures a GPU's copy peak; give --device 0 (or another GPU)");
            }
            let device = Arc::new(HostDevice::new().context("starting the host-memory device")?);
            stream(device, &args, None)
        }
        Choice::Gpu(ordinal) => run_gpu(ordinal, &args),
    }
}

#[cfg(feature = "cuda")]
fn run_gpu(ordinal: usize, args: &Args) -> anyhow::Result<i32> {
    /// Copy size and repetitions for the peak: 256 MiB × 20 = 5 GiB, ≈ 0.1 s at PCIe Gen5.
    const PEAK_BYTES: usize = 256 << 20;
    const PEAK_ITERS: u32 = 20;
    let device = Arc::new(
        stagefs_gpu::CudaDevice::new(ordinal).with_context(|| format!("opening GPU {ordinal}"))?,
    );
    let peak = if args.bench_peak {
        let bps = device
            .measure_h2d_peak(PEAK_BYTES, PEAK_ITERS)
            .context("measuring the host-to-device copy peak")?;
        if !args.json {
            println!(
                "pinned host-to-device copy peak on {}: {:.2} GB/s ({} MiB copies)",
                device.describe(),
                bps / 1e9,
                PEAK_BYTES >> 20
            );
        }
        Some(bps / 1e9)
    } else {
        None
    };
    if args.files.is_empty() {
        if args.json {
            println!(
                "{}",
                serde_json::json!({ "device": device.describe(), "peak_h2d_gb_per_s": peak })
            );
        }
        return Ok(0);
    }
    stream(device, args, peak)
}

#[cfg(not(feature = "cuda"))]
fn run_gpu(_ordinal: usize, _args: &Args) -> anyhow::Result<i32> {
    bail!(
        "this stagefs was built without CUDA; rebuild with `cargo build --release --features cuda` \
         (no CUDA toolkit needed, only the NVIDIA driver at run time) or use --device cpu"
    )
}

/// Evicts a file's clean pages from the page cache (no privileges needed).
fn evict(path: &PathBuf) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let file =
        std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    // SAFETY: a valid open descriptor; the advice only affects caching.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        tracing::warn!(
            "{}: could not evict from the page cache (errno {rc})",
            path.display()
        );
    }
    Ok(())
}

fn stream<D: Device>(device: Arc<D>, args: &Args, peak: Option<f64>) -> anyhow::Result<i32> {
    if args
        .consume_gbps
        .is_some_and(|r| !(r > 0.0 && r.is_finite()))
    {
        bail!("--consume-gbps must be a positive number of GB/s");
    }
    if args.cold {
        for path in &args.files {
            evict(path)?;
        }
    }
    let sources = args
        .files
        .iter()
        .map(Source::npy)
        .collect::<Result<Vec<_>, _>>()
        .context("reading .npy headers")?;
    let max_row = sources
        .iter()
        .map(|s| s.row_bytes)
        .max()
        .unwrap_or(1)
        .max(1);
    let auto = StreamConfig::auto(max_row);
    let batch_rows = match args.batch_rows {
        Some(0) => bail!("--batch-rows must be at least 1"),
        Some(n) => n,
        None => auto.batch_rows,
    };
    let readers = args.readers.unwrap_or(auto.readers);
    let config = StreamConfig {
        batch_rows,
        ring: args
            .ring
            .unwrap_or_else(|| StreamConfig::auto_ring(readers)),
        readers,
        epochs: args.epochs,
        shuffle_seed: args.shuffle.then_some(args.seed),
    };
    let data_bytes: u64 =
        sources.iter().map(Source::data_bytes).sum::<u64>() * u64::from(args.epochs);
    let streamer =
        Streamer::new(device.clone(), sources, &config).context("starting the streamer")?;
    let batch_bytes = streamer.batch_bytes() as u64;
    let total = streamer.len();
    let every = total.div_ceil(VERIFY_SAMPLES).max(1);

    let bar = if args.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(data_bytes)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let (mut verified, mut mismatches) = (0u64, Vec::new());
    while let Some(batch) = streamer.next_batch() {
        let batch = batch?;
        batch.synchronize()?;
        if let Some(rate) = args.consume_gbps {
            std::thread::sleep(std::time::Duration::from_secs_f64(
                batch.len() as f64 / (rate * 1e9),
            ));
        }
        if args.verify && (batch.meta().seq % every == 0 || batch.meta().seq + 1 == total) {
            let check = batch.verify()?;
            verified += 1;
            if !check.matches() {
                let m = batch.meta();
                mismatches.push(format!(
                    "{} rows {}..{}: device CRC-32 {:08x}, file {:08x}",
                    m.path.display(),
                    m.rows.start,
                    m.rows.end,
                    check.device_crc32,
                    check.file_crc32
                ));
            }
        }
        bar.inc(batch.len() as u64);
    }
    bar.finish_and_clear();
    let stats = streamer.stats();
    let describe = device.describe();
    if args.json {
        println!(
            "{}",
            json_report(
                &describe,
                &stats,
                &config,
                batch_bytes,
                peak,
                args.verify,
                verified,
                &mismatches,
                args.consume_gbps
            )
        );
    } else {
        print_report(&describe, &stats, &config, batch_bytes, peak);
        if args.verify {
            println!(
                "  verify      {}/{} sampled batches match the files (CRC-32 of the bytes copied back)",
                verified - mismatches.len() as u64,
                verified
            );
        }
    }
    for m in &mismatches {
        eprintln!("stagefs: error: data on the device differs from the file: {m}");
    }
    Ok(if mismatches.is_empty() { 0 } else { 2 })
}

fn print_report(device: &str, s: &Stats, c: &StreamConfig, batch_bytes: u64, peak: Option<f64>) {
    let secs = s.elapsed.as_secs_f64();
    println!(
        "streamed {} in {} batches (≤ {} rows, ≤ {} each) to {device}, ring {} × 2 buffers, {} readers",
        HumanBytes(s.bytes),
        s.batches,
        c.batch_rows,
        HumanBytes(batch_bytes),
        c.ring,
        s.readers
    );
    print!(
        "  throughput  {:.2} GB/s, {:.1} batches/s, {secs:.3} s",
        s.gb_per_s(),
        s.batches_per_s()
    );
    match peak {
        Some(p) if p > 0.0 => println!(" ({:.2}× the {p:.2} GB/s copy peak)", s.gb_per_s() / p),
        _ => println!(),
    }
    println!(
        "  device waited on data        {:5.1}% of the time ({:.3} s)",
        100.0 * s.consumer_wait_share(),
        s.consumer_wait.as_secs_f64()
    );
    println!(
        "  readers waited on storage    {:5.1}% of their time ({:.3} s summed over {} readers)",
        100.0 * s.storage_share(),
        s.storage_read.as_secs_f64(),
        s.readers
    );
    println!(
        "  readers waited for a buffer  {:5.1}% of their time ({:.3} s summed)",
        100.0 * s.ring_full_share(),
        s.ring_full_wait.as_secs_f64()
    );
    println!("  verdict     {}", s.verdict());
}

#[allow(clippy::too_many_arguments)]
fn json_report(
    device: &str,
    s: &Stats,
    c: &StreamConfig,
    batch_bytes: u64,
    peak: Option<f64>,
    verify: bool,
    verified: u64,
    mismatches: &[String],
    consume_gbps: Option<f64>,
) -> serde_json::Value {
    serde_json::json!({
        "device": device,
        "bytes": s.bytes,
        "batches": s.batches,
        "batch_rows": c.batch_rows,
        "batch_bytes": batch_bytes,
        "ring": c.ring,
        "readers": s.readers,
        "epochs": c.epochs,
        "consume_gbps": consume_gbps,
        "seconds": s.elapsed.as_secs_f64(),
        "gb_per_s": s.gb_per_s(),
        "batches_per_s": s.batches_per_s(),
        "device_wait_s": s.consumer_wait.as_secs_f64(),
        "device_wait_share": s.consumer_wait_share(),
        "storage_read_s": s.storage_read.as_secs_f64(),
        "storage_share": s.storage_share(),
        "ring_full_wait_s": s.ring_full_wait.as_secs_f64(),
        "ring_full_share": s.ring_full_share(),
        "verdict": s.verdict(),
        "peak_h2d_gb_per_s": peak,
        "ratio_to_peak": peak.map(|p| s.gb_per_s() / p),
        "verified_batches": if verify { Some(verified) } else { None },
        "verify_mismatches": mismatches,
    })
}
