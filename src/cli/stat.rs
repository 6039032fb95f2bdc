//! `stagefs stat`: the mount's statistics for people. The verdict line answers the question a
//! user has when the GPU is idle: is the job waiting on storage?

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use stagefs_fs::StatsSnapshot;

/// Arguments of `stagefs stat`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A stagefs mountpoint.
    pub mountpoint: PathBuf,
    /// Refresh every SECONDS seconds (2 if not given), with rates, until interrupted.
    #[arg(long, short = 'w', num_args = 0..=1, default_missing_value = "2", value_name = "SECONDS")]
    pub watch: Option<f64>,
    /// Print the raw JSON instead.
    #[arg(long)]
    pub json: bool,
}

fn read(args: &Args) -> anyhow::Result<(String, StatsSnapshot)> {
    let path = args.mountpoint.join(".stagefs/stats");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => anyhow::bail!(
            "the daemon of the mount at {mnt} is gone (killed or crashed; its log is \
             CACHE/stagefs.log): run `stagefs umount {mnt}`, then mount again (the cache is reused)",
            mnt = args.mountpoint.display()
        ),
        Err(e) => {
            return Err(e).with_context(|| {
                format!(
                    "reading {} (is {} a stagefs mount?)",
                    path.display(),
                    args.mountpoint.display()
                )
            })
        }
    };
    let snap =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok((text, snap))
}

fn gib(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The human-readable report of a snapshot; `prev` (with its age in seconds) adds rates.
pub fn render(s: &StatsSnapshot, prev: Option<(&StatsSnapshot, f64)>) -> String {
    let mut out = String::new();
    // The share of wall time during which at least one reader was blocked on the source: the
    // same scale for one reader thread or sixteen (a sum of waits would exceed 100 %).
    let stall_share = if s.uptime_s > 0.0 {
        (s.stall_s / s.uptime_s).min(1.0)
    } else {
        0.0
    };
    out += &format!(
        "source     {}   (daemon pid {}, up {:.0} s)\n",
        s.source, s.pid, s.uptime_s
    );
    out += &format!(
        "served     {} from cache, {} from source (hit ratio {})   views {}\n",
        gib(s.bytes_from_cache),
        gib(s.bytes_from_source),
        s.hit_ratio
            .map_or("n/a: nothing read yet".into(), |h| format!(
                "{:.1}%",
                h * 100.0
            )),
        gib(s.view_bytes),
    );
    out += &format!(
        "read       {} from the source in all (demand, read-ahead, staging, hints)\n",
        gib(s.source_bytes_read)
    );
    if s.passthrough_opens > 0 {
        out += &format!(
            "passthru   {} opens, {} in those files (read by the kernel straight from scratch)\n",
            s.passthrough_opens,
            gib(s.bytes_passthrough)
        );
    }
    if s.direct_opens + s.direct_refused > 0 {
        let why: Vec<String> = s
            .direct_refused_by
            .iter()
            .map(|(code, n)| format!("{code} {n}"))
            .collect();
        let why = if why.is_empty() {
            String::new()
        } else {
            format!(": {}", why.join(", "))
        };
        out += &format!(
            "direct     {} opens, {} in those files (read by the job straight from scratch), \
             {} refused{why} (read through the mount)\n",
            s.direct_opens,
            gib(s.bytes_direct),
            s.direct_refused
        );
    }
    if let Some((p, dt)) = prev.filter(|(_, dt)| *dt > 0.0) {
        let rate = |a: u64, b: u64| gib(((a.saturating_sub(b)) as f64 / dt) as u64) + "/s";
        out += &format!(
            "now        {} from cache, {} from source, {} staged; readers waiting {:.0}% of the time\n",
            rate(s.bytes_from_cache, p.bytes_from_cache),
            rate(s.bytes_from_source, p.bytes_from_source),
            rate(s.bytes_staged, p.bytes_staged),
            ((s.stall_s - p.stall_s) / dt * 100.0).clamp(0.0, 100.0)
        );
    }
    out += &format!(
        "waiting    some reader waited on the source during {:.1} s ({:.1} s summed over readers, {} demand misses)\n",
        s.stall_s, s.reader_wait_s, s.block_misses
    );
    out += &format!(
        "cache      {} of {} used   staged {} files, {} (target {})   prefetched {}\n",
        gib(s.cache_used),
        gib(s.cache_capacity),
        s.files_staged,
        gib(s.bytes_staged),
        if s.staging_target > 0 {
            gib(s.staging_target)
        } else {
            "none: tree larger than cache or staging off".into()
        },
        gib(s.bytes_prefetched)
    );
    out += &format!(
        "events     {} blocks evicted, {} corrupt blocks re-fetched, {} cache-full events, {} fetches in flight, {} view chunks rendered\n",
        s.blocks_evicted, s.corrupt_blocks, s.cache_full_events, s.fetches_in_flight, s.views_rendered
    );
    if s.error_count > 0 {
        out += &format!("errors     {} (latest first):\n", s.error_count);
        for e in s.errors.iter().rev().take(5) {
            out += &format!("           {e}\n");
        }
    }
    // Readers waiting more than a tenth of the time means the data path, not compute, is the limit.
    let read_anything = s.bytes_from_cache + s.bytes_from_source + s.view_bytes > 0;
    let verdict = if stall_share > 0.10 {
        "I/O-BOUND: readers spend much of their time waiting on the source; staging or a warm cache will help"
    } else if !read_anything && s.passthrough_opens > 0 {
        "not I/O-bound: files are read straight from scratch by the kernel (passthrough)"
    } else if !read_anything {
        "idle: nothing read yet"
    } else {
        "not I/O-bound: reads are served from the cache fast enough"
    };
    out += &format!(
        "verdict    {verdict} ({:.1}% of uptime with a reader waiting)\n",
        stall_share * 100.0
    );
    out
}

/// Runs `stagefs stat`.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let (text, snap) = read(&args)?;
    if args.json {
        print!("{text}");
        return Ok(0);
    }
    print!("{}", render(&snap, None));
    let Some(interval) = args.watch else {
        return Ok(0);
    };
    let interval = Duration::from_secs_f64(interval.max(0.1));
    let mut prev = snap;
    loop {
        std::thread::sleep(interval);
        let (_, snap) = read(&args)?;
        println!();
        print!("{}", render(&snap, Some((&prev, interval.as_secs_f64()))));
        prev = snap;
    }
}
