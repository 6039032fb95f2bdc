//! Hostile inputs against a real mount whose daemon runs under a 1 GiB memory limit (a memory
//! cgroup, as a batch system gives a job): every bad input fails its own reads with EIO, the
//! good ones read back exactly, and the daemon is never killed for memory. Needs root and a
//! memory cgroup to create; skipped with a visible line otherwise.
#![allow(missing_docs, clippy::unwrap_used)]

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::BIN;
use stagefs_parquet_bounds::testing::{dictionary_bomb, Values};
use stagefs_test_support::{memory_cgroup_root, test, Need};

/// The job's memory limit: 1 GiB.
const LIMIT: u64 = 1 << 30;

/// A memory cgroup of its own, removed (once empty) on drop.
struct Cgroup {
    dir: PathBuf,
    usage_max: PathBuf,
}

impl Cgroup {
    fn new(limit: u64) -> Cgroup {
        let (root, limit_file) = memory_cgroup_root().unwrap();
        let dir = root.join(format!("stagefs-test-{}", std::process::id()));
        let _ = fs::remove_dir(&dir);
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join(limit_file), limit.to_string()).unwrap();
        let usage_max = if limit_file == "memory.max" {
            dir.join("memory.peak")
        } else {
            dir.join("memory.max_usage_in_bytes")
        };
        Cgroup { dir, usage_max }
    }

    /// The most memory the group has used.
    fn peak(&self) -> u64 {
        fs::read_to_string(&self.usage_max)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Times the kernel killed a process of the group for memory (0 where not reported).
    fn oom_kills(&self) -> u64 {
        for (file, key) in [
            ("memory.oom_control", "oom_kill "),
            ("memory.events", "oom_kill "),
        ] {
            if let Ok(text) = fs::read_to_string(self.dir.join(file)) {
                if let Some(n) = text
                    .lines()
                    .find_map(|l| l.strip_prefix(key))
                    .and_then(|n| n.trim().parse().ok())
                {
                    return n;
                }
            }
        }
        0
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while fs::remove_dir(&self.dir).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn png(w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let mut e = png::Encoder::new(&mut out, w, h);
    e.set_color(png::ColorType::Rgb);
    let px: Vec<u8> = (0..w * h * 3).map(|i| (i % 251) as u8).collect();
    e.write_header().unwrap().write_image_data(&px).unwrap();
    out
}

/// The inputs: Parquet bombs, a wide CSV, empty and tiny images, and good files beside them.
fn dataset(src: &Path) {
    fs::create_dir_all(src.join("tables")).unwrap();
    fs::write(
        src.join("tables/bomb.parquet"),
        dictionary_bomb(3, Values::Int64, (2 << 30) - 1, None),
    )
    .unwrap();
    fs::write(
        src.join("tables/bomb1.parquet"),
        dictionary_bomb(1, Values::Int64, (2 << 30) - 1, None),
    )
    .unwrap();
    fs::write(
        src.join("tables/good.parquet"),
        dictionary_bomb(3, Values::Int64, 16, None),
    )
    .unwrap();
    let cols = 5000;
    let mut csv = (0..cols)
        .map(|c| format!("c{c}"))
        .collect::<Vec<_>>()
        .join(",");
    csv.push('\n');
    for r in 0..200 {
        csv.push_str(
            &(0..cols)
                .map(|c| ((r + c) % 7).to_string())
                .collect::<Vec<_>>()
                .join(","),
        );
        csv.push('\n');
    }
    fs::write(src.join("tables/wide.csv"), csv).unwrap();
    fs::create_dir_all(src.join("imgs/a")).unwrap();
    for i in 0..200 {
        fs::write(src.join(format!("imgs/a/z{i:03}.jpg")), b"").unwrap();
        fs::write(src.join(format!("imgs/a/p{i:03}.png")), png(1, 1)).unwrap();
    }
    fs::create_dir_all(src.join("good/x")).unwrap();
    for i in 0..8 {
        fs::write(src.join(format!("good/x/{i}.png")), png(64, 48)).unwrap();
    }
}

fn regression_the_daemon_under_a_1_gib_memory_limit_survives_every_hostile_input() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    dataset(&src);
    let mnt = tmp.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let cache = tmp.path().join("cache");
    let cg = Cgroup::new(LIMIT);
    // The daemon (and everything it forks) starts inside the group.
    let procs = cg.dir.join("cgroup.procs");
    let out = Command::new("sh")
        .arg("-c")
        .arg("echo $$ > \"$1\" && exec \"$2\" mount \"$3\" \"$4\" --cache \"$5\"")
        .args(["sh", procs.to_str().unwrap(), BIN])
        .args([&src, &mnt, &cache])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    struct Umount<'a>(&'a Path);
    impl Drop for Umount<'_> {
        fn drop(&mut self) {
            let _ = Command::new(BIN).arg("umount").arg(self.0).status();
        }
    }
    let guard = Umount(&mnt);
    let npy = mnt.join(".npy");
    let eio = |rel: &str| {
        let e = fs::read(npy.join(rel)).expect_err(rel);
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{rel}: {e}");
    };
    for _ in 0..3 {
        eio("tables/bomb.parquet/features.npy");
        eio("tables/bomb.parquet/c2.npy");
        eio("tables/bomb1.parquet/c0.npy");
    }
    // Honest tables and images read; the wide table's views too, all of them.
    let good = fs::read(npy.join("tables/good.parquet/c0.npy")).unwrap();
    assert!(good[128..].chunks_exact(8).all(|c| c == 7i64.to_le_bytes()));
    let wide = fs::read(npy.join("tables/wide.csv/features.npy")).unwrap();
    assert_eq!(wide.len() as u64, 128 + 200 * 5000 * 4);
    for c in (0..5000).step_by(97) {
        let col = fs::read(npy.join(format!("tables/wide.csv/c{c}.npy"))).unwrap();
        assert!(col.len() > 128);
    }
    let imgs = fs::read(npy.join("imgs/images.npy")).unwrap();
    assert!(imgs.len() > 128);
    assert!(!fs::read(npy.join("good/images.npy")).unwrap().is_empty());
    // Still answering, never killed.
    let stats: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(mnt.join(".stagefs/stats")).unwrap()).unwrap();
    assert!(stats["error_count"].as_u64().unwrap() >= 1, "{stats}");
    drop(guard);
    assert_eq!(cg.oom_kills(), 0, "the daemon was killed for memory");
    let peak = cg.peak();
    assert!(peak > 0 && peak < LIMIT, "peak {peak} bytes");
    eprintln!("memory peak of the daemon's group: {} MiB", peak >> 20);
}

fn main() -> std::process::ExitCode {
    stagefs_test_support::run(vec![test!(
        regression_the_daemon_under_a_1_gib_memory_limit_survives_every_hostile_input,
        Need::Fuse,
        Need::Root,
        Need::MemoryCgroup
    )])
}
