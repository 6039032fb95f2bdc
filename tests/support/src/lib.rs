//! What the integration tests share: a test harness that knows what each test needs from the
//! machine (FUSE, root, the test accounts, a GPU) and skips honestly.
//!
//! Rust's built-in harness has no run-time skip: a test that finds no FUSE can only return early,
//! and then counts as passed although it tested nothing. Test files that need the machine set
//! `harness = false` and hand their tests to [`run`], which uses libtest-mimic (same command line
//! and output as `cargo test`): a test whose needs are not met prints a visible
//! `skipped: needs ...` line and is counted as *ignored* by the runner. Under `CI=true` a missing
//! FUSE, root or account is a failure instead, because CI must run those tests.
#![allow(clippy::unwrap_used)]

use std::process::{Command, ExitCode};

/// Something a test needs from the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// A usable `/dev/fuse` (and `fusermount3` for a normal user).
    Fuse,
    /// Root (to switch users, mount a tmpfs, make pid namespaces).
    Root,
    /// The unprivileged test accounts `stagefs-test` and `stagefs-test2` (scripts/env.sh makes them).
    Accounts,
    /// `/dev/fuse` usable by every user (mode 0666), so a normal user can mount.
    UserFuse,
    /// A CUDA driver and a GPU.
    Gpu,
    /// A memory cgroup this process may create (cgroup v1's memory hierarchy, or v2 with the
    /// memory controller enabled for children), to run a daemon under a memory limit.
    MemoryCgroup,
}

impl Need {
    /// Why this machine does not meet the need, or `None` when it does.
    pub fn missing(self) -> Option<String> {
        match self {
            Need::Fuse => fuse_missing(),
            Need::Root => (!is_root()).then(|| "root".to_string()),
            Need::Accounts => ["stagefs-test", "stagefs-test2"]
                .iter()
                .find(|u| uid_of(u).is_none())
                .map(|u| format!("the account {u} (scripts/env.sh creates it as root)")),
            Need::UserFuse => {
                use std::os::unix::fs::MetadataExt;
                let mode = std::fs::metadata("/dev/fuse").map_or(0, |m| m.mode() & 0o777);
                (mode & 0o666 != 0o666).then(|| {
                    format!("/dev/fuse of mode 0666, not {mode:o} (as root: chmod 0666 /dev/fuse)")
                })
            }
            Need::Gpu => gpu_missing(),
            Need::MemoryCgroup => memory_cgroup_root()
                .err()
                .map(|why| format!("a memory cgroup to create ({why})")),
        }
    }

    /// Whether CI must be able to run tests with this need (it has FUSE, root and the accounts;
    /// it has no GPU).
    fn required_in_ci(self) -> bool {
        !matches!(self, Need::Gpu | Need::MemoryCgroup)
    }
}

/// Where memory cgroups are made, and the file that limits one: cgroup v1's memory hierarchy
/// (`memory.limit_in_bytes`) or cgroup v2 with the memory controller delegated (`memory.max`).
pub fn memory_cgroup_root() -> Result<(std::path::PathBuf, &'static str), String> {
    if !is_root() {
        return Err("root".into());
    }
    let v1 = std::path::Path::new("/sys/fs/cgroup/memory");
    if v1.join("memory.limit_in_bytes").exists() {
        return Ok((v1.to_path_buf(), "memory.limit_in_bytes"));
    }
    let v2 = std::path::Path::new("/sys/fs/cgroup");
    let controllers =
        std::fs::read_to_string(v2.join("cgroup.subtree_control")).unwrap_or_default();
    if controllers.split_whitespace().any(|c| c == "memory") {
        return Ok((v2.to_path_buf(), "memory.max"));
    }
    Err("no cgroup v1 memory hierarchy, and cgroup v2 does not delegate memory".into())
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The uid of a local account, or `None` if there is none.
pub fn uid_of(user: &str) -> Option<u32> {
    let out = Command::new("id").arg("-u").arg(user).output().ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

/// Whether `name` is an executable file in one of PATH's folders.
pub fn in_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
}

/// Why this machine cannot mount FUSE filesystems, if it cannot: no `/dev/fuse` to open, or
/// (as a normal user) no `fusermount3`.
pub fn fuse_missing() -> Option<String> {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        return Some(format!(
            "FUSE (/dev/fuse cannot be opened: {e}; as root: apt-get install fuse3, chmod 0666 /dev/fuse)"
        ));
    }
    if !is_root() && !in_path("fusermount3") {
        return Some("FUSE (fusermount3 is not installed: package fuse3)".into());
    }
    None
}

/// Why there is no GPU to test on: no NVIDIA driver library, or no device file.
fn gpu_missing() -> Option<String> {
    let driver = ["/dev/nvidiactl", "/dev/nvidia0"]
        .iter()
        .all(|p| std::path::Path::new(p).exists());
    (!driver).then(|| "a CUDA GPU (no /dev/nvidia0 here)".to_string())
}

/// Whether this run is CI's (`CI=true`), where FUSE, root and the accounts must be present.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// One test: its name, what it needs, and its body (which panics to fail).
pub struct Test {
    /// The name `cargo test NAME` filters on.
    pub name: &'static str,
    /// What the machine must offer for the test to run.
    pub needs: &'static [Need],
    /// The test itself.
    pub body: fn(),
}

/// A [`Test`] from a function, named after it: `test!(fn_name, Need::Fuse, Need::Root)`.
#[macro_export]
macro_rules! test {
    ($f:ident $(, $need:expr)* $(,)?) => {
        $crate::Test { name: stringify!($f), needs: &[$($need),*], body: $f }
    };
}

/// Runs `tests` as `cargo test` would (same arguments: filters, `--test-threads`, `--list`),
/// skipping visibly those whose needs are not met. Use as a test file's `main`.
pub fn run(tests: Vec<Test>) -> ExitCode {
    let args = libtest_mimic::Arguments::from_args();
    let ci = in_ci();
    let trials = tests
        .into_iter()
        .map(|t| {
            let missing: Vec<(Need, String)> = t
                .needs
                .iter()
                .filter_map(|n| n.missing().map(|why| (*n, why)))
                .collect();
            if missing.is_empty() {
                let body = t.body;
                return libtest_mimic::Trial::test(t.name, move || {
                    body();
                    Ok(())
                });
            }
            let why = missing
                .iter()
                .map(|(_, w)| w.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            if ci && missing.iter().any(|(n, _)| n.required_in_ci()) {
                let msg = format!("CI must run this test, but this machine lacks {why}");
                return libtest_mimic::Trial::test(t.name, move || Err(msg.into()));
            }
            let filtered_in = args.filter.as_deref().is_none_or(|f| {
                if args.exact {
                    t.name == f
                } else {
                    t.name.contains(f)
                }
            });
            if filtered_in && !args.list {
                eprintln!("skipped: needs {why}: {}", t.name);
            }
            // Ignored, so not run; run anyway (`--ignored`), it fails rather than pass untested.
            let msg = format!("skipped: needs {why}");
            libtest_mimic::Trial::test(t.name, move || Err(msg.into())).with_ignored_flag(true)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// Deterministic pseudo-random bytes (xorshift from `seed`): test data that checks itself
/// without a second read of the source.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Regular files under `dir`, recursively (how many files a cache keeps on scratch).
pub fn files_under(dir: &std::path::Path) -> usize {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                n += 1;
            }
        }
    }
    n
}
