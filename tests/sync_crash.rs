//! Crash safety of `stagefs sync`: SIGKILL at ≥ 50 random moments during passes over files of
//! mixed sizes; after every kill each destination file must be its complete old or complete new
//! version, and a final re-run must complete and leave no temporaries.
#![allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)

use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

const BIN: &str = env!("CARGO_BIN_EXE_stagefs");
/// Effective kills (the process was still running when SIGKILL hit) required.
const KILLS: usize = 60;

/// Random bytes that file contents are cut from: generating every version with a
/// cryptographic RNG in a debug build would dominate the test's run time.
fn pool() -> &'static [u8] {
    static POOL: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut v = vec![0u8; 12 << 20];
        rng.fill(&mut v[..]);
        v
    })
}

/// Deterministic content of file `i` at `version`: sizes vary with the version so both size and
/// content change between versions; a header makes every (file, version) distinct.
fn content(i: usize, version: usize, big: bool) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64((i as u64) << 20 | version as u64);
    let size = if big {
        (2 << 20) + rng.random_range(0..(3 << 20))
    } else {
        rng.random_range(16..48 * 1024)
    };
    let pool = pool();
    let off = rng.random_range(0..pool.len() - size);
    let mut v = pool[off..off + size].to_vec();
    v[..16].copy_from_slice(&[(i as u64).to_le_bytes(), (version as u64).to_le_bytes()].concat());
    v
}

fn rel_name(i: usize) -> PathBuf {
    if i < 6 {
        PathBuf::from(format!("ckpt/model-{i}.pt"))
    } else {
        PathBuf::from(format!("logs/d{}/f{i}.json", i % 7))
    }
}

/// Writes `version` of every file (and one file new in this version) into `src`.
fn write_version(src: &Path, version: usize, n: usize) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    for i in 0..n {
        let rel = rel_name(i);
        let data = content(i, version, i < 6);
        let p = src.join(&rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, &data).unwrap();
        age(&p);
        files.insert(rel, data);
    }
    // One file appears in each version and then stays unchanged.
    std::fs::create_dir_all(src.join("new")).unwrap();
    for v in 0..=version {
        let extra = PathBuf::from(format!("new/v{v}.bin"));
        let data = content(10_000 + v, 0, false);
        if v == version {
            std::fs::write(src.join(&extra), &data).unwrap();
            age(&src.join(&extra));
        }
        files.insert(extra, data);
    }
    files
}

/// Dates a just-written file 5 s back (still unique per version), so that passes copy it at
/// once instead of first waiting for it to settle (see stagefs_sync::copy): the kills should
/// land in copies, not in that wait.
fn age(p: &Path) {
    let f = std::fs::File::options().write(true).open(p).unwrap();
    f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(5))
        .unwrap();
}

fn all_files(root: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(root).unwrap() {
        let e = e.unwrap();
        let p = e.path();
        if e.file_type().unwrap().is_dir() {
            all_files(&p, out);
        } else {
            out.push(p);
        }
    }
}

fn is_temp(p: &Path) -> bool {
    p.file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with(".stagefs-tmp.")
}

#[test]
fn sigkill_at_random_moments_never_leaves_a_partial_file() {
    let base = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (src, dst) = (base.path().join("src"), base.path().join("dst"));
    let n = 206; // 6 files of 2-5 MB, 200 small ones
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);

    let mut version = 0;
    let mut old = write_version(&src, version, n);
    let t0 = Instant::now();
    let st = Command::new(BIN)
        .arg("sync")
        .arg(&src)
        .arg(&dst)
        .arg("-q")
        .status()
        .unwrap();
    assert!(st.success());
    let full = t0.elapsed();
    version += 1;
    let mut new = write_version(&src, version, n);

    let (mut kills, mut runs, mut finished) = (0usize, 0usize, 0usize);
    let (mut with_temps, mut mixed, mut checked, mut partial) = (0usize, 0usize, 0usize, 0usize);
    while kills < KILLS && runs < 600 {
        runs += 1;
        let mut child = Command::new(BIN)
            .arg("sync")
            .arg(&src)
            .arg(&dst)
            .arg("-q")
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let delay = full.mul_f64(rng.random_range(0.0..1.0));
        std::thread::sleep(delay);
        let done = child.try_wait().unwrap().is_some();
        if !done {
            child.kill().unwrap();
            kills += 1;
        }
        child.wait().unwrap();

        // Every destination file: complete old or complete new version, nothing else.
        let mut found = Vec::new();
        all_files(&dst, &mut found);
        let (mut n_old, mut n_new, mut temps) = (0, 0, 0);
        for p in &found {
            if is_temp(p) {
                temps += 1;
                continue;
            }
            let rel = p.strip_prefix(&dst).unwrap().to_path_buf();
            let data = std::fs::read(p).unwrap();
            checked += 1;
            if new.get(&rel) == Some(&data) {
                n_new += 1;
            } else if old.get(&rel) == Some(&data) {
                n_old += 1;
            } else {
                partial += 1;
                eprintln!(
                    "PARTIAL or unexpected: {} ({} bytes)",
                    rel.display(),
                    data.len()
                );
            }
        }
        if temps > 0 {
            with_temps += 1;
        }
        if n_old > 0 && n_new > 0 {
            mixed += 1;
        }
        let complete = new
            .iter()
            .all(|(rel, data)| std::fs::read(dst.join(rel)).ok().as_ref() == Some(data));
        if done && complete {
            // A pass finished: start the next round with fresh versions of everything.
            finished += 1;
            version += 1;
            old = std::mem::take(&mut new);
            new = write_version(&src, version, n);
        }
    }

    // A re-run completes the job and removes every temporary.
    let out = Command::new(BIN)
        .arg("sync")
        .arg(&src)
        .arg(&dst)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut found = Vec::new();
    all_files(&dst, &mut found);
    let temps_left = found.iter().filter(|p| is_temp(p)).count();
    for (rel, data) in &new {
        assert_eq!(
            &std::fs::read(dst.join(rel)).unwrap(),
            data,
            "{}",
            rel.display()
        );
    }
    eprintln!(
        "crash test: {kills} SIGKILLs during a pass ({runs} runs, {finished} rounds completed, \
         full pass {full:?}); {checked} destination files checked, kills that left temporaries: \
         {with_temps}, kills that left old and new versions side by side: {mixed}; \
         partial files found: {partial}; temporaries left after re-run: {temps_left}"
    );
    assert_eq!(partial, 0, "partial or corrupt destination files found");
    assert_eq!(temps_left, 0, "re-run left temporaries");
    assert!(kills >= 50, "only {kills} kills hit a running sync");
    // The kills must have landed inside copies, or the test proves nothing.
    assert!(
        with_temps + mixed >= kills / 4,
        "too few kills interrupted a copy ({with_temps} with temporaries, {mixed} mixed)"
    );
}
