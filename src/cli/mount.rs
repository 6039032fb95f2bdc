//! `stagefs mount` and `stagefs umount`.
//!
//! Without `--foreground`, `mount` starts itself again as a daemon (new session, output to
//! `CACHE/stagefs.log`) and waits on a pipe until the daemon reports the mount usable or fails;
//! so a script can use the mount on the very next line, and errors reach the terminal.

use std::fs;
use std::io::{BufRead, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rustix::fs::Access;
use rustix::io::Errno;
use rustix::mount::UnmountFlags;
use rustix::pipe::PipeFlags;
use rustix::process::Pid;
use stagefs_fs::mount::{mount, MountOptions};
use stagefs_fs::{CacheDir, FetchConfig};
use stagefs_fs::{FsConfig, FsCore};

/// The daemon's log, inside the (private) cache directory.
const LOG_FILE: &str = "stagefs.log";

/// Arguments of `stagefs mount`.
#[derive(clap::Args, Debug)]
#[command(after_long_help = "Example (in a SLURM job):\n  \
    stagefs mount /bigdata/imagenet $SLURM_TMPDIR/data --cache $SLURM_TMPDIR/cache --cache-size 300G\n  \
    python train.py --data $SLURM_TMPDIR/data      # reads start at once, epoch 2 comes from scratch\n  \
    stagefs stat $SLURM_TMPDIR/data                 # is the job waiting on storage?\n  \
    stagefs umount $SLURM_TMPDIR/data\n\n\
Snapshot semantics: the mount shows SOURCE as it was when its metadata was listed (at the first\n\
mount, kept in the cache and reused by later mounts, or taken earlier by `stagefs index` and given\n\
with --index, so that N training nodes list nothing; a tree regenerated at SOURCE is listed\n\
again). A file changed on SOURCE since then (size, mtime, ctime or inode) fails to read with\n\
ESTALE (never other bytes) and is named in the log and `stagefs stat`; use --rescan to list\n\
again, or --revalidate SECONDS if SOURCE changes while mounted.\n\n\
MOUNTPOINT/.stagefs/stats (statistics) and MOUNTPOINT/.npy/ (tables and images as NumPy arrays)\n\
are reachable by name but not listed in MOUNTPOINT, so du, find, tar and rsync see the dataset only.")]
pub struct Args {
    /// The dataset directory on shared storage (read-only access is enough).
    pub source: PathBuf,
    /// An existing empty directory where the dataset appears.
    pub mountpoint: PathBuf,
    /// Start from this snapshot of SOURCE's metadata (written by `stagefs index SOURCE`)
    /// instead of listing SOURCE: on N nodes, N× fewer metadata requests to shared storage.
    #[arg(long, value_name = "FILE")]
    pub index: Option<PathBuf>,
    /// List SOURCE again even if the cache holds a snapshot of it (SOURCE changed since).
    #[arg(long, conflicts_with = "index")]
    pub rescan: bool,
    /// Re-check a file's or directory's metadata on SOURCE when it was last checked more than
    /// DURATION ago (seconds, or e.g. 5m; for sources that change while mounted; costs metadata
    /// requests).
    #[arg(long, value_name = "DURATION", value_parser = super::units::parse_positive_duration)]
    pub revalidate: Option<Duration>,
    /// Metadata requests kept in flight while listing SOURCE (parallel filesystems answer
    /// concurrent requests far faster than serial ones).
    #[arg(long, default_value_t = stagefs_fs::fscore::DEFAULT_SCAN_THREADS as u64, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub scan_threads: u64,
    /// Cache directory on node-local scratch (created if missing; reused by later mounts; one
    /// mount at a time: its cache log and the snapshot of SOURCE are kept there).
    #[arg(long)]
    pub cache: PathBuf,
    /// Cache capacity: bytes or with a suffix K, M, G, T (powers of 1024). Default: 90% of the
    /// free space on the cache's filesystem.
    #[arg(long, value_parser = super::units::parse_size)]
    pub cache_size: Option<u64>,
    #[command(flatten)]
    pub image: super::convert::ImageArgs,
    /// Make reads of a view fail with EIO when an input image is corrupt (default: zeros).
    #[arg(long)]
    pub strict_views: bool,
    /// Do not stage the whole tree in the background, even if it fits.
    #[arg(long)]
    pub no_staging: bool,
    /// Stage only what loaders declare as this node's part (`stagefs.Loader(partition="node")`
    /// on several nodes), not the whole tree: nothing is staged until a loader connects.
    #[arg(long, conflicts_with = "no_staging")]
    pub stage_hinted: bool,
    /// Do not use kernel FUSE passthrough for fully cached files.
    #[arg(long)]
    pub no_passthrough: bool,
    /// Longest a reader waits for one block from SOURCE before its read fails with ETIMEDOUT
    /// (a hung parallel filesystem must not hang the training job forever). Seconds, or e.g. 5m.
    #[arg(long, value_name = "DURATION", default_value = "300", value_parser = super::units::parse_positive_duration)]
    pub read_timeout: Duration,
    /// Source reads kept in flight ahead of readers (read-ahead, prefetch, staging).
    #[arg(long, default_value_t = FetchConfig::DEFAULT_WORKERS as u64, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub fetch_threads: u64,
    /// Have the kernel ask the daemon at every open and close of a file (FUSE's default). By
    /// default it does not: the first open is answered "not implemented", after which the
    /// kernel opens files by itself and keeps their pages across opens — two round trips fewer
    /// per file, which is most of a warm small-file epoch. Opens are asked for anyway where
    /// they are needed: with passthrough (root) and with --revalidate.
    #[arg(long)]
    pub daemon_opens: bool,
    /// Answer reads of large files (over 4 MiB) with direct I/O: one request per read of up to
    /// 1 MiB, copied straight into the reader's buffer, no page cache on the mount. Needs the
    /// daemon's opens, so it implies --daemon-opens. A lever to measure (docs/mount.md#large-files).
    #[arg(long)]
    pub direct_io: bool,
    /// Kept for scripts written for the previous default; opens are skipped by default now.
    #[arg(long, hide = true, conflicts_with = "daemon_opens")]
    pub skip_open: bool,
    /// Read the cache on scratch through the page cache instead of with O_DIRECT. By default
    /// cached blocks are read straight from the device: through the page cache every byte
    /// costs one more copy and the dataset is held in memory twice (scratch's pages and the
    /// mount's). A lever to measure (docs/mount.md#large-files).
    #[arg(long)]
    pub buffered_scratch: bool,
    /// Also push the next 16 MiB of a large file into the kernel's page cache ahead of a reader
    /// streaming it. Off by default: on a 2-core VM it lost to plain requests (a reader of
    /// 1 MiB chunks has its pages requested before the push lands, and both copy them;
    /// docs/mount.md#large-files). Halves the requests of a reader of small chunks.
    #[arg(long, conflicts_with = "no_push")]
    pub push_ahead: bool,
    /// Do not push cached data into the kernel's page cache: neither the files ahead of a reader
    /// that walks a directory in order (without, it pays one round trip per file, not per 64)
    /// nor the rest of each block of a large file that a random reader touches (without, an
    /// mmap of a .npy read in random row order takes a round trip per 128 KiB, not per MiB).
    #[arg(long)]
    pub no_push: bool,
    /// Listings without attributes (plain readdir): cheaper for tools that only list names
    /// (find, ls), dearer for readers that then open each file (a lookup per file).
    #[arg(long)]
    pub no_readdirplus: bool,
    /// FUSE request threads.
    #[arg(long, default_value_t = MountOptions::DEFAULT_THREADS)]
    pub fuse_threads: usize,
    /// Let other users read the mount (needs `user_allow_other` in /etc/fuse.conf unless root).
    #[arg(long)]
    pub allow_other: bool,
    /// Stay in the foreground (logs to stderr) instead of daemonizing.
    #[arg(long, short = 'f')]
    pub foreground: bool,
    /// Internal: descriptor on which to report readiness to the parent.
    #[arg(long, hide = true)]
    pub ready_fd: Option<i32>,
}

/// Arguments of `stagefs umount`.
#[derive(clap::Args, Debug)]
pub struct UmountArgs {
    /// The mountpoint to unmount.
    pub mountpoint: PathBuf,
    /// Detach even if busy (lazy unmount): the mount goes away when its last user closes.
    /// Without it, a busy mount is tried again for 3 seconds (processes that just exited may
    /// still be closing their files), then refused.
    #[arg(long, short = 'l')]
    pub lazy: bool,
}

fn check_args(args: &Args) -> anyhow::Result<()> {
    let src = fs::metadata(&args.source).with_context(|| {
        format!(
            "source {} is not accessible (does it exist? is shared storage mounted?)",
            args.source.display()
        )
    })?;
    if !src.is_dir() {
        bail!("source {} is not a directory", args.source.display());
    }
    match fs::metadata(&args.mountpoint) {
        Err(e) if e.raw_os_error() == Some(Errno::NOTCONN.raw_os_error()) => bail!(
            "{} is a stale mount (its daemon died): run `stagefs umount {}` first",
            args.mountpoint.display(),
            args.mountpoint.display()
        ),
        Err(e) => bail!(
            "mountpoint {}: {e} (create it first: mkdir -p {})",
            args.mountpoint.display(),
            args.mountpoint.display()
        ),
        Ok(m) if !m.is_dir() => bail!(
            "mountpoint {} is not a directory",
            args.mountpoint.display()
        ),
        Ok(_) => {}
    }
    if is_mountpoint(&args.mountpoint) {
        bail!(
            "{} is already a mountpoint: unmount it first (stagefs umount {})",
            args.mountpoint.display(),
            args.mountpoint.display()
        );
    }
    if fs::read_dir(&args.mountpoint).is_ok_and(|mut d| d.next().is_some()) {
        bail!(
            "mountpoint {} is not empty: the mount would hide its files; use an empty directory",
            args.mountpoint.display()
        );
    }
    // Created 0700 if missing; refused if another user owns it, others may write it, or it is
    // a symlink (a pre-created cache on a shared /tmp would let them read or steer ours).
    let cache = CacheDir::open(&args.cache)?;
    cache
        .create_temp(".stagefs-write-test")
        .and_then(|(_, name)| cache.remove(name))
        .with_context(|| {
            format!(
                "cache directory {} is not writable (choose a directory on node-local scratch you own)",
                args.cache.display()
            )
        })?;
    if fs::canonicalize(&args.cache)
        .ok()
        .zip(fs::canonicalize(&args.mountpoint).ok())
        .is_some_and(|(c, m)| c.starts_with(&m))
    {
        bail!("the cache directory must not be inside the mountpoint");
    }
    if !Path::new("/dev/fuse").exists() {
        bail!("/dev/fuse does not exist: this node has no FUSE support (ask your admins to load the fuse module)");
    }
    if !rustix::process::geteuid().is_root() {
        if rustix::fs::access("/dev/fuse", Access::READ_OK | Access::WRITE_OK).is_err() {
            bail!("/dev/fuse is not usable by this user (mode is not 0666): an admin must run `chmod 0666 /dev/fuse`");
        }
        if which("fusermount3").is_none() {
            bail!("fusermount3 not found in PATH: install the fuse3 package (unprivileged mounts need it)");
        }
    }
    Ok(())
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// Whether `path` is the root of a mount (its device differs from its parent's, or it is `/`).
fn is_mountpoint(path: &Path) -> bool {
    let Ok(canon) = fs::canonicalize(path) else {
        return false;
    };
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines().any(|l| {
        l.split(' ')
            .nth(4)
            .is_some_and(|m| unescape(m) == canon.as_os_str().as_bytes())
    })
}

fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// Runs `stagefs mount`.
pub fn run(args: Args) -> anyhow::Result<i32> {
    check_args(&args)?;
    if args.foreground {
        super::logging::init("info");
        return serve(args);
    }
    daemonize(&args)
}

fn daemonize(args: &Args) -> anyhow::Result<i32> {
    // Without O_CLOEXEC, as pipe(2): the daemon inherits the write end (--ready-fd).
    let (rd, wr) = rustix::pipe::pipe_with(PipeFlags::empty())
        .map_err(|e| anyhow::anyhow!("pipe: {}", std::io::Error::from(e)))?;
    let log_path = args.cache.join(LOG_FILE);
    let log = CacheDir::open(&args.cache)?
        .open_append(LOG_FILE)
        .with_context(|| format!("opening log {}", log_path.display()))?;
    let exe = std::env::current_exe().context("locating the stagefs binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(std::env::args_os().skip(1))
        .arg("--foreground")
        .arg("--ready-fd")
        .arg(wr.as_raw_fd().to_string())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    let rd_raw = rd.as_raw_fd();
    // SAFETY: the closure only makes async-signal-safe system calls (setsid, close), and
    // closes the child's copy of the read end, which nothing else in the child owns.
    unsafe {
        cmd.pre_exec(move || {
            let _ = rustix::process::setsid();
            rustix::io::close(rd_raw);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the mount daemon")?;
    drop(wr);
    // One line: "ok" or "error: ...". Not read to EOF: helpers the daemon starts may hold the pipe.
    let mut msg = String::new();
    let _ = std::io::BufReader::new(fs::File::from(rd)).read_line(&mut msg);
    if msg.starts_with("ok") {
        return Ok(0);
    }
    let status = child.wait().ok();
    let reason = msg
        .strip_prefix("error: ")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .unwrap_or_else(|| {
            let log = CacheDir::open(&args.cache)
                .ok()
                .and_then(|d| d.open_read(LOG_FILE).ok())
                .map(|f| {
                    let mut s = String::new();
                    let _ =
                        std::io::Read::read_to_string(&mut std::io::Read::take(f, 1 << 20), &mut s);
                    s
                })
                .unwrap_or_default();
            let tail: Vec<_> = log.lines().rev().take(5).collect();
            format!(
                "the daemon exited ({status:?}); last log lines:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            )
        });
    bail!("mount failed: {reason}")
}

fn serve(args: Args) -> anyhow::Result<i32> {
    // Before any thread starts, so that every thread inherits the mask and only sigwait sees them.
    let signals = block_signals()?;
    // A normal user's soft limit is often 1024: raised to the hard one before the caches are
    // sized from it (stagefs_prefetch::fds).
    let nofile = stagefs_prefetch::fds::raise_limit();
    tracing::info!(nofile, "descriptor limit");
    let mut ready = args.ready_fd.map(|fd| {
        // SAFETY: the parent passed us this descriptor, open and ours alone.
        unsafe { fs::File::from_raw_fd(fd) }
    });
    let result = start(&args);
    let (core, mut mounted) = match result {
        Ok(x) => x,
        Err(e) => {
            if let Some(f) = ready.as_mut() {
                let _ = writeln!(f, "error: {e:#}");
            }
            return Err(e);
        }
    };
    raise_kernel_readahead(&args.mountpoint);
    if let Some(mut f) = ready.take() {
        let _ = f.write_all(b"ok\n");
    }
    tracing::info!(source = %args.source.display(), mountpoint = %args.mountpoint.display(), "mounted");
    // SIGTERM/SIGINT/SIGHUP: unmount cleanly (the session then ends and the cache is flushed).
    let mut unmounter_slot = mounted.take_unmounter();
    let mountpoint = args.mountpoint.clone();
    std::thread::Builder::new()
        .name("stagefs-signals".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: sigwait on a set we built; the signals are blocked in every thread.
            if unsafe { libc::sigwait(&signals, &mut sig) } == 0 {
                tracing::info!(signal = sig, "unmounting on signal");
                if let Some(mut u) = unmounter_slot.take() {
                    if u.unmount().is_err() {
                        let _ = unmount_path(&mountpoint, true);
                    }
                }
            }
        })?;
    let joined = mounted.join();
    core.shutdown();
    stagefs_fs::fscore::log_summary(&core);
    joined.context("FUSE session ended with an error")?;
    Ok(0)
}

fn start(args: &Args) -> anyhow::Result<(std::sync::Arc<FsCore>, stagefs_fs::mount::Mounted)> {
    let (source, cache_dir) = (
        fs::canonicalize(&args.source)?,
        fs::canonicalize(&args.cache)?,
    );
    let index = args
        .index
        .as_ref()
        .map(fs::canonicalize)
        .transpose()
        .with_context(|| {
            format!(
                "index {} is not accessible",
                args.index.as_deref().unwrap_or(Path::new("")).display()
            )
        })?;
    let cfg = fs_config(args, source, cache_dir, index);
    let core = FsCore::new(cfg)
        .map_err(|e| anyhow::anyhow!("opening the cache in {}: {e}", args.cache.display()))?;
    super::logging::count_dropped_replies_in(core.stats().clone());
    // What was asked; `mount` applies the rules (passthrough only as root, no skipped opens
    // nor pushes under --revalidate, daemon opens for direct I/O): MountOptions::settled.
    let mounted = mount(core.clone(), &args.mountpoint, &mount_options(args))
        .with_context(|| format!("mounting at {}", args.mountpoint.display()))?;
    Ok((core, mounted))
}

/// The library's configuration ([`FsConfig::new`], whose defaults the flags' defaults equal:
/// `cli_defaults_are_the_library_defaults`) with what the flags change.
fn fs_config(args: &Args, source: PathBuf, cache_dir: PathBuf, index: Option<PathBuf>) -> FsConfig {
    let mut cfg = FsConfig::new(source, cache_dir);
    if let Some(size) = args.cache_size {
        cfg.cache_size = size;
    }
    cfg.direct_scratch = !args.buffered_scratch;
    cfg.fetch.workers = args.fetch_threads as usize;
    cfg.fetch.read_timeout = args.read_timeout;
    cfg.stage = !args.no_staging;
    cfg.stage_hinted = args.stage_hinted;
    cfg.image_size = args.image.image_size;
    cfg.strict_views = args.strict_views;
    cfg.index = index;
    cfg.rescan = args.rescan;
    cfg.revalidate = args.revalidate;
    cfg.scan_threads = args.scan_threads as usize;
    cfg.fast_decode = args.image.fast_decode;
    cfg.max_image_pixels = args.image.max_image_pixels;
    cfg.decode_budget = args.image.decode_budget;
    cfg
}

/// The session options asked by the flags (the defaults are [`MountOptions::default`]'s).
fn mount_options(args: &Args) -> MountOptions {
    MountOptions {
        passthrough: !args.no_passthrough,
        threads: args.fuse_threads,
        allow_other: args.allow_other,
        skip_open: !args.daemon_opens,
        push: !args.no_push,
        readdirplus: !args.no_readdirplus,
        direct_io_large: args.direct_io,
        push_ahead: args.push_ahead,
    }
}

/// The kernel offers FUSE only 128 KiB of read-ahead at init, so daemon-served reads arrive in
/// 128 KiB pieces; as root, raise the mount's read-ahead to one cache block (1 MiB), which the
/// kernel then sends as single requests. Best effort: without root it stays at 128 KiB.
fn raise_kernel_readahead(mountpoint: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = fs::metadata(mountpoint) else {
        return;
    };
    let dev = meta.dev();
    let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
    let path = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    if let Err(e) = fs::write(&path, b"1024") {
        tracing::debug!(error = %e, path, "could not raise the mount's read-ahead");
    }
}

/// Blocks SIGTERM, SIGINT and SIGHUP in the calling thread (and the threads it starts), for
/// `sigwait`. On libc: rustix offers no signal masks or `sigwait` outside its `runtime`
/// feature, which is for implementing a libc, not for programs that use one.
fn block_signals() -> anyhow::Result<libc::sigset_t> {
    // SAFETY: sigset operations on a zeroed set we own; pthread_sigmask on the calling thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            bail!("blocking signals failed");
        }
        Ok(set)
    }
}

/// How long a busy mount is tried again before `stagefs umount` gives up: processes that just
/// exited may still be closing their files (a DataLoader's workers end after their parent, and
/// a forked child holds its parent's descriptors until it execs), which makes an unmount right
/// after a job's last read fail with EBUSY although nothing is using the mount any more.
const BUSY_GRACE: Duration = Duration::from_secs(3);

/// Unmounts `path` (see [`unmount_once`]), trying a busy mount again for [`BUSY_GRACE`].
fn unmount_path(path: &Path, lazy: bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + BUSY_GRACE;
    loop {
        match unmount_once(path, lazy)? {
            Unmount::Done => return Ok(()),
            Unmount::Busy if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Unmount::Busy => bail!(
                "{} is busy (a process has files open or its cwd there); close them or use --lazy",
                path.display()
            ),
        }
    }
}

/// What one unmount attempt found.
enum Unmount {
    Done,
    Busy,
}

/// One unmount attempt: umount2 as root, else `fusermount3 -u`.
fn unmount_once(path: &Path, lazy: bool) -> anyhow::Result<Unmount> {
    if rustix::process::geteuid().is_root() {
        let flags = if lazy {
            UnmountFlags::DETACH
        } else {
            UnmountFlags::empty()
        };
        let err = match rustix::mount::unmount(path, flags) {
            Ok(()) => return Ok(Unmount::Done),
            Err(Errno::BUSY) => return Ok(Unmount::Busy),
            Err(e) => std::io::Error::from(e),
        };
        if which("fusermount3").is_none() {
            bail!("unmounting {}: {err}", path.display());
        }
    }
    let mut cmd = Command::new("fusermount3");
    cmd.arg("-u");
    if lazy {
        cmd.arg("-z");
    }
    let out = cmd
        .arg(path)
        .output()
        .context("running fusermount3 (install the fuse3 package)")?;
    if out.status.success() {
        return Ok(Unmount::Done);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    // fusermount3 says "Device or resource busy" (strerror(EBUSY)).
    if stderr.contains("busy") {
        return Ok(Unmount::Busy);
    }
    bail!("fusermount3 -u {}: {}", path.display(), stderr.trim());
}

/// How long `stagefs umount` waits for the stats file (which names the daemon's pid) before it
/// unmounts without it: the control files answer at once unless the daemon is hung.
const STATS_WAIT: Duration = Duration::from_secs(3);

/// The daemon's pid from the mount's stats file, or `None` if the mount does not answer within
/// [`STATS_WAIT`] (the read goes on in a thread of its own, which exit ends).
fn daemon_pid(mountpoint: &Path) -> Option<u64> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = mountpoint.join(".stagefs/stats");
    std::thread::Builder::new()
        .name("stats".into())
        .spawn(move || {
            let _ = tx.send(fs::read_to_string(path).ok());
        })
        .ok()?;
    match rx.recv_timeout(STATS_WAIT) {
        Ok(stats) => stats
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .and_then(|v| v.get("pid").and_then(|p| p.as_u64())),
        Err(_) => {
            eprintln!(
                "stagefs umount: {} does not answer (daemon busy or hung): unmounting lazily without waiting for the daemon",
                mountpoint.display()
            );
            None
        }
    }
}

/// How long `stagefs umount` waits for the daemon to write its cache log and exit. The log of
/// a mount of 200,000 files and the `syncfs` of a scratch that other jobs are writing to took
/// over 30 s (the bound before) on a loaded 2-core machine; until the daemon exits the cache
/// stays locked and the next mount of it is refused, so `umount` waits for as long as a
/// stuck-but-alive daemon could reasonably need.
const DAEMON_EXIT_WAIT: Duration = Duration::from_secs(600);

/// After this long `stagefs umount` says what it is waiting for (and again every
/// [`SAY_AGAIN`]), so a job's log shows why its last step takes time.
const SAY_WAITING: Duration = Duration::from_secs(3);
/// See [`SAY_WAITING`].
const SAY_AGAIN: Duration = Duration::from_secs(30);

/// Runs `stagefs umount`: unmounts, then waits for the daemon to write its cache log and exit,
/// so the next mount of the same cache (the next job of a chain) finds it free. Exit status 1
/// if the daemon is still running after [`DAEMON_EXIT_WAIT`].
pub fn umount(args: UmountArgs) -> anyhow::Result<i32> {
    if !is_mountpoint(&args.mountpoint) {
        bail!("{} is not mounted", args.mountpoint.display());
    }
    let pid = daemon_pid(&args.mountpoint);
    // A mount that did not answer still has our stats read open: a plain unmount would be EBUSY.
    unmount_path(&args.mountpoint, args.lazy || pid.is_none())?;
    // Signal 0 only checks that the process exists. A pid that is no process id (0, or past
    // i32) is not waited for.
    let Some(pid) = pid
        .and_then(|p| i32::try_from(p).ok())
        .and_then(Pid::from_raw)
    else {
        return Ok(0);
    };
    let mnt = args.mountpoint.display();
    let say = |waited: Duration| {
        eprintln!(
            "stagefs umount: {mnt} is unmounted; waiting for its daemon (pid {}) to write the cache log and exit ({} s so far): the cache stays locked until it does",
            pid.as_raw_nonzero(),
            waited.as_secs()
        )
    };
    if wait_for_exit(pid, DAEMON_EXIT_WAIT, SAY_WAITING, SAY_AGAIN, say) {
        return Ok(0);
    }
    eprintln!(
        "stagefs umount: the daemon of {mnt} (pid {}) is still running after {} s; its cache stays locked (see CACHE/stagefs.log; `kill {0}` frees it, and the next mount replays the cache log)",
        pid.as_raw_nonzero(),
        DAEMON_EXIT_WAIT.as_secs()
    );
    Ok(1)
}

/// Waits until process `pid` is gone or `limit` has passed (true if gone), calling `say` with
/// the time waited once `first` has passed and every `again` after.
fn wait_for_exit(
    pid: Pid,
    limit: Duration,
    first: Duration,
    again: Duration,
    mut say: impl FnMut(Duration),
) -> bool {
    let start = Instant::now();
    let mut next_say = first;
    while rustix::process::test_kill_process(pid).is_ok() {
        let waited = start.elapsed();
        if waited >= limit {
            return false;
        }
        if waited >= next_say {
            say(waited);
            next_say = waited + again;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    /// The flags' defaults live in the libraries (FsConfig::new, MountOptions::default); the
    /// ones clap writes as text ("300", "64M") are held to them here.
    #[test]
    fn cli_defaults_are_the_library_defaults() {
        let cli = Cli::try_parse_from(["stagefs", "src", "mnt", "--cache", "c"]).unwrap();
        let (src, cache) = (PathBuf::from("/src"), std::env::temp_dir());
        let mut from_flags = fs_config(&cli.args, src.clone(), cache.clone(), None);
        let mut library = FsConfig::new(src, cache);
        // The free-space default is asked of the filesystem twice: it may move between.
        (from_flags.cache_size, library.cache_size) = (0, 0);
        assert_eq!(format!("{from_flags:?}"), format!("{library:?}"));
        assert_eq!(
            format!("{:?}", mount_options(&cli.args)),
            format!("{:?}", MountOptions::default())
        );
    }

    /// Regression: `umount` gave up on the daemon after 30 s and returned 0 while it was still
    /// writing its cache log, so the next mount of the cache was refused "in use by another
    /// mount" (tests/scale.rs, 200,000 files, on a loaded machine). It waits for the exit now
    /// and says so while it waits. A child reaped by a thread of its own stands for the daemon
    /// (an unreaped one would linger as a zombie that signal 0 still finds).
    #[test]
    fn umount_waits_for_a_daemon_still_writing_and_says_so() {
        let mut child = Command::new("sleep").arg("0.6").spawn().unwrap();
        let pid = Pid::from_raw(child.id() as i32).unwrap();
        let reaper = std::thread::spawn(move || child.wait());
        let mut said = Vec::new();
        let start = Instant::now();
        let gone = wait_for_exit(
            pid,
            Duration::from_secs(30),
            Duration::from_millis(100),
            Duration::from_millis(200),
            |w| said.push(w),
        );
        assert!(gone);
        assert!(
            start.elapsed() >= Duration::from_millis(500),
            "returned before the exit"
        );
        assert!((1..=4).contains(&said.len()), "{said:?}");
        assert!(said[0] >= Duration::from_millis(100), "{said:?}");
        reaper.join().unwrap().unwrap();
    }

    #[test]
    fn umount_gives_up_on_a_daemon_that_never_exits() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = Pid::from_raw(child.id() as i32).unwrap();
        let gone = wait_for_exit(
            pid,
            Duration::from_millis(200),
            Duration::from_secs(60),
            Duration::from_secs(60),
            |_| panic!("said before the first mark"),
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!gone);
    }

    #[test]
    fn flags_reach_the_configuration() {
        let cli = Cli::try_parse_from([
            "stagefs",
            "src",
            "mnt",
            "--cache",
            "c",
            "--read-timeout",
            "10m",
            "--fetch-threads",
            "4",
            "--image-size",
            "64",
            "--cache-size",
            "2G",
            "--no-push",
        ])
        .unwrap();
        let cfg = fs_config(&cli.args, "/src".into(), std::env::temp_dir(), None);
        assert_eq!(cfg.fetch.read_timeout, Duration::from_secs(600));
        assert_eq!(cfg.fetch.workers, 4);
        assert_eq!(cfg.image_size, 64);
        assert_eq!(cfg.cache_size, 2 << 30);
        assert!(!mount_options(&cli.args).push);
    }
}
