//! Helpers for tests that mount stagefs for real: a generated dataset, a mount that is always
//! unmounted (even when the test fails), and byte/metadata comparisons.
#![allow(dead_code, missing_docs, clippy::unwrap_used)]

pub use stagefs_test_support::pattern;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_stagefs");

#[allow(unused_imports)]
pub use stagefs_test_support::is_root;

/// A small tree: files of many sizes (empty, tiny, block-straddling, multi-block), nested
/// directories, modes, a relative and an absolute symlink.
pub fn make_tree(root: &Path) -> Vec<PathBuf> {
    let sizes = [
        0usize,
        1,
        100,
        4095,
        4096,
        65_537,
        1 << 20,
        (1 << 20) + 1,
        3 * (1 << 20) + 12_345,
    ];
    let mut files = Vec::new();
    for (d, dir) in ["", "a", "a/b", "c"].iter().enumerate() {
        fs::create_dir_all(root.join(dir)).unwrap();
        for (i, size) in sizes.iter().enumerate() {
            let rel = Path::new(dir).join(format!("f{i}.bin"));
            fs::write(root.join(&rel), pattern((d * 100 + i) as u64, *size)).unwrap();
            files.push(rel);
        }
    }
    // Large enough to be kept as an exact copy on scratch (kernel passthrough as root).
    fs::write(root.join("a/big.bin"), pattern(777, 6 * (1 << 20) + 123)).unwrap();
    files.push(PathBuf::from("a/big.bin"));
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(root.join("a/f2.bin"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::set_permissions(root.join("c/f3.bin"), fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("b/f1.bin", root.join("a/link")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", root.join("abs-link")).unwrap();
    files
}

/// A stagefs mount, unmounted on drop.
pub struct Mount {
    pub src: PathBuf,
    pub mnt: PathBuf,
    pub cache: PathBuf,
    args: Vec<String>,
    pub mounted: bool,
    pub runas: Option<u32>,
    /// A command the daemon is started under (`prlimit --nofile=...`), if any.
    prefix: Vec<String>,
}

impl Mount {
    pub fn new(base: &Path, src: &Path, args: &[&str]) -> Mount {
        Mount::with_cache(base, src, &base.join("cache"), args)
    }

    pub fn with_cache(base: &Path, src: &Path, cache: &Path, args: &[&str]) -> Mount {
        Mount::under(base, src, cache, args, &[])
    }

    /// A mount whose daemon is started under the command `prefix` (for example `prlimit`).
    pub fn under(base: &Path, src: &Path, cache: &Path, args: &[&str], prefix: &[&str]) -> Mount {
        let mnt = base.join("mnt");
        let cache = cache.to_path_buf();
        fs::create_dir_all(&mnt).unwrap();
        let mut m = Mount {
            src: src.to_path_buf(),
            mnt,
            cache,
            args: args.iter().map(|s| s.to_string()).collect(),
            mounted: false,
            runas: None,
            prefix: prefix.iter().map(|s| s.to_string()).collect(),
        };
        m.mount();
        m
    }

    pub fn command(&self, bin: &str) -> Command {
        match self.runas {
            None => Command::new(bin),
            Some(uid) => {
                let mut c = Command::new("setpriv");
                c.args([
                    format!("--reuid={uid}"),
                    format!("--regid={uid}"),
                    "--clear-groups".into(),
                    bin.into(),
                ]);
                c
            }
        }
    }

    pub fn mount(&mut self) {
        let bin = self.bin();
        let mut cmd = match self.prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&bin);
                c
            }
            None => self.command(&bin),
        };
        let out = cmd
            .arg("mount")
            .arg(&self.src)
            .arg(&self.mnt)
            .arg("--cache")
            .arg(&self.cache)
            .args(&self.args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "mount failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.mounted = true;
    }

    pub fn bin(&self) -> String {
        BIN.to_string()
    }

    pub fn umount(&mut self) {
        if !self.mounted {
            return;
        }
        let out = self
            .command(&self.bin())
            .arg("umount")
            .arg(&self.mnt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "umount failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.mounted = false;
    }

    pub fn stats(&self) -> serde_json::Value {
        serde_json::from_slice(&fs::read(self.mnt.join(".stagefs/stats")).unwrap()).unwrap()
    }

    /// The counters rendered now, asked on the control socket (`stats_now`): unlike the stats
    /// file, never a rendering kept from up to a second ago.
    pub fn stats_now(&self) -> serde_json::Value {
        let sock = self.cache.join(stagefs_protocol::SOCKET_NAME);
        stagefs_protocol::DirectClient::connect(&sock)
            .unwrap()
            .stats_now()
            .unwrap()
    }

    /// Waits until `pred` holds for the counters, asked on the control socket each time.
    pub fn wait_stats_now(
        &self,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let sock = self.cache.join(stagefs_protocol::SOCKET_NAME);
        let mut c = stagefs_protocol::DirectClient::connect(&sock).unwrap();
        poll(
            what,
            Duration::from_millis(5),
            || c.stats_now().unwrap(),
            pred,
        )
    }

    /// Waits until `pred` holds for the stats (background staging, flushes).
    pub fn wait_stats(
        &self,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        poll(what, Duration::from_millis(50), || self.stats(), pred)
    }
}

/// Takes `get()` every `every` until `pred` holds for it (at most 30 s) and returns it.
fn poll(
    what: &str,
    every: Duration,
    mut get: impl FnMut() -> serde_json::Value,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = get();
        if pred(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {s}"
        );
        std::thread::sleep(every);
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.mounted {
            let lazy = Command::new("umount")
                .arg("-l")
                .arg(&self.mnt)
                .stderr(std::process::Stdio::null())
                .status();
            if !lazy.is_ok_and(|s| s.success()) {
                let _ = Command::new("fusermount3")
                    .arg("-u")
                    .arg("-z")
                    .arg(&self.mnt)
                    .status();
            }
        }
    }
}

/// Asserts that every file under `src` reads back identically under `mnt` with equal metadata.
pub fn assert_same_tree(src: &Path, mnt: &Path) {
    let mut stack = vec![PathBuf::new()];
    let mut files = 0;
    while let Some(rel) = stack.pop() {
        let mut names: Vec<_> = fs::read_dir(src.join(&rel))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        let mut mnames: Vec<_> = fs::read_dir(mnt.join(&rel))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        mnames.sort();
        assert_eq!(names, mnames, "listing of {}", rel.display());
        for n in names {
            let r = rel.join(&n);
            let a = fs::symlink_metadata(src.join(&r)).unwrap();
            let b = fs::symlink_metadata(mnt.join(&r)).unwrap();
            assert_eq!(a.mode(), b.mode(), "mode of {}", r.display());
            assert_eq!(a.size(), b.size(), "size of {}", r.display());
            assert_eq!(
                (a.mtime(), a.mtime_nsec()),
                (b.mtime(), b.mtime_nsec()),
                "mtime of {}",
                r.display()
            );
            if a.is_dir() {
                stack.push(r);
            } else if a.file_type().is_symlink() {
                assert_eq!(
                    fs::read_link(src.join(&r)).unwrap(),
                    fs::read_link(mnt.join(&r)).unwrap()
                );
            } else {
                assert!(
                    fs::read(src.join(&r)).unwrap() == fs::read(mnt.join(&r)).unwrap(),
                    "bytes of {}",
                    r.display()
                );
                files += 1;
            }
        }
    }
    assert!(files > 0);
}

/// Runs `cmd` to completion; its output, after asserting it succeeded (its stderr otherwise).
pub fn output_ok(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
