//! `stagefs run`: the job wrapper. Mount inputs, run the command with signals forwarded, sync
//! outputs periodically, on SLURM's warning signal and at the end, unmount, and exit with the
//! command's status.
//!
//! Mounts are made by running this same executable as `stagefs mount SRC MNT --cache CACHE`
//! (which returns once the mount is usable) and removed with `stagefs umount MNT`, so `run`
//! depends only on the mount's command-line contract.

use anyhow::{bail, Context};
use stagefs_fs::{stable_hash, CacheDir};
use stagefs_sync::signals;
use stagefs_sync::supervise::{Event, Supervised};
use stagefs_sync::{SyncOptions, Syncer};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The long `--help` text.
const RUN_HELP: &str = concat!(
    "Sequence: mount every --mount; start CMD (environment and stdio inherited); every --every,\n",
    "sync every --sync pair (crash-safe, like `stagefs sync`). SIGTERM, SIGINT, SIGUSR1 and SIGUSR2\n",
    "are forwarded to CMD at once. On SIGUSR1 (SLURM's warning, `#SBATCH --signal=B:USR1@300`) a\n",
    "sync runs right away, CMD keeps running, and syncs repeat every 30 s (or --every if shorter)\n",
    "so that the checkpoint CMD writes in response reaches persistent storage before the limit.\n",
    "On SIGTERM/SIGINT CMD gets --grace to exit (then SIGKILL). When CMD has exited: a final\n",
    "sync, unmount, and exit with CMD's status\n",
    "(128+N if it died of signal N). If CMD succeeded but the final sync failed, the exit code is 1,\n",
    "so that a dependent job (`--dependency=afterok`) does not start on missing outputs.\n",
    "\n",
    "In an sbatch script, start it with `exec stagefs run ...`: with `--signal=B:...` SLURM signals\n",
    "only the batch shell, and `exec` makes stagefs that shell.\n",
    "\n",
    "The cache of a mount without CACHE is `stagefs-cache-<hash of SRC>` in the job's private\n",
    "scratch: `$SLURM_TMPDIR`, else `$TMPDIR`, else `/tmp` when that directory is yours and closed\n",
    "to others; otherwise inside a per-user directory `stagefs-<uid>` there (created 0700; refused\n",
    "if another user made it). Caches are private (0700/0600) and a later job reuses them.\n",
    "\n",
    "Direct reads: CMD runs with the direct-read library this binary carries in LD_PRELOAD\n",
    "(written into the first mount's cache directory). A read-only open of a staged, verified\n",
    "file under a mount then opens the cache's copy itself (small files, through the mount's\n",
    "direct table) or gets a descriptor of it from the mount's daemon over its private control\n",
    "socket (large files), and reads at local speed; anything else reads through the mount.\n",
    "The first lines say whether direct reads are on, and why not. --no-direct or\n",
    "STAGEFS_DIRECT=0 turns them off (docs/direct.md).\n",
);

/// Run a job step: mount inputs, run CMD, and bring its outputs home safely.
#[derive(clap::Args, Debug)]
#[command(after_long_help = RUN_HELP)]
pub struct Args {
    /// Mount SRC (read-only, cached) at MNT before starting CMD; repeatable.
    #[arg(long = "mount", value_name = "SRC:MNT[:CACHE]")]
    pub mounts: Vec<String>,
    /// An option for every `stagefs mount` (`--mount-arg=--index=FILE`,
    /// `--mount-arg=--stage-hinted`); repeatable.
    #[arg(long = "mount-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub mount_args: Vec<String>,
    /// Copy SRC's new and changed files to DST periodically and at the end; repeatable.
    /// SRC and DST are created if missing.
    #[arg(long = "sync", value_name = "SRC:DST")]
    pub syncs: Vec<String>,
    /// Interval between syncs while CMD runs (0 = only on SIGUSR1 and at the end).
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = super::units::parse_duration)]
    pub every: Duration,
    /// After SIGTERM/SIGINT, how long CMD may take to exit before it is killed.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = super::units::parse_duration)]
    pub grace: Duration,
    /// Files copied in parallel per sync [default: 16].
    #[arg(long, short = 'j', value_name = "N")]
    pub jobs: Option<usize>,
    /// Do not preload the direct-read library into CMD, and set `STAGEFS_DIRECT=0` for it (so
    /// `stagefs.Loader` does not read direct either): every read goes through the mounts.
    #[arg(long)]
    pub no_direct: bool,
    /// The command to run, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub cmd: Vec<OsString>,
}

/// One `--mount`.
#[derive(Debug, Clone)]
struct MountSpec {
    src: PathBuf,
    mnt: PathBuf,
    cache: PathBuf,
}

/// One `--sync`.
#[derive(Debug, Clone)]
struct SyncSpec {
    src: PathBuf,
    dst: PathBuf,
}

fn parse_mount(spec: &str) -> anyhow::Result<MountSpec> {
    let parts: Vec<&str> = spec.split(':').collect();
    let (src, mnt, cache) = match parts.as_slice() {
        [s, m] if !s.is_empty() && !m.is_empty() => (*s, *m, None),
        [s, m, c] if !s.is_empty() && !m.is_empty() && !c.is_empty() => (*s, *m, Some(*c)),
        _ => bail!(
            "--mount {spec:?}: expected SRC:MNT or SRC:MNT:CACHE (paths containing ':' are \
             not supported here; use a symlink)"
        ),
    };
    let src = PathBuf::from(src);
    let cache = match cache {
        Some(c) => PathBuf::from(c),
        None => default_cache(&src)?,
    };
    Ok(MountSpec {
        src,
        mnt: PathBuf::from(mnt),
        cache,
    })
}

fn parse_sync(spec: &str) -> anyhow::Result<SyncSpec> {
    match spec.split(':').collect::<Vec<_>>().as_slice() {
        [s, d] if !s.is_empty() && !d.is_empty() => Ok(SyncSpec {
            src: PathBuf::from(s),
            dst: PathBuf::from(d),
        }),
        _ => bail!("--sync {spec:?}: expected SRC:DST (paths containing ':' are not supported)"),
    }
}

/// The default cache of a mount: on the job's private scratch, never at a predictable name in
/// a directory others can write. `$SLURM_TMPDIR` (else `$TMPDIR`, else `/tmp`) is used as is
/// when it is ours and closed to others; otherwise a per-user directory inside it
/// (`stagefs-<uid>`, created 0700, refused if anyone else made it) holds the caches.
fn default_cache(src: &Path) -> anyhow::Result<PathBuf> {
    let base = ["SLURM_TMPDIR", "TMPDIR"]
        .iter()
        .find_map(|v| std::env::var_os(v).filter(|s| !s.is_empty()))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    default_cache_in(base, src)
}

fn default_cache_in(base: PathBuf, src: &Path) -> anyhow::Result<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let private = std::fs::symlink_metadata(&base)
        .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.mode() & 0o022 == 0);
    let base = if private {
        base
    } else {
        let mine = base.join(format!("stagefs-{uid}"));
        CacheDir::open(&mine).with_context(|| {
            format!(
                "the default cache lives in {}: give --mount SRC:MNT:CACHE with a directory of yours",
                mine.display()
            )
        })?;
        mine
    };
    let abs = std::path::absolute(src).unwrap_or_else(|_| src.to_path_buf());
    Ok(base.join(format!(
        "stagefs-cache-{:016x}",
        stable_hash(abs.as_os_str().as_bytes())
    )))
}

/// Runs `stagefs run`; returns the process exit code.
pub fn run(args: Args) -> anyhow::Result<i32> {
    let mounts = args
        .mounts
        .iter()
        .map(|s| parse_mount(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let syncs = args
        .syncs
        .iter()
        .map(|s| parse_sync(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Fail now, not after hours of training, if an output directory cannot be created.
    for s in &syncs {
        for dir in [&s.src, &s.dst] {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating --sync directory {}", dir.display()))?;
        }
    }
    let syncer = Syncer::new(SyncOptions {
        jobs: args.jobs.unwrap_or_else(stagefs_sync::pass::default_jobs),
        ..SyncOptions::default()
    })?;
    let exe = std::env::current_exe().context("finding the stagefs executable")?;

    let mut mounted: Vec<PathBuf> = Vec::new();
    for m in &mounts {
        if let Err(e) = mount(&exe, m, &args.mount_args) {
            unmount_all(&exe, &mounted);
            return Err(e);
        }
        eprintln!(
            "stagefs run: mounted {} at {} (cache {})",
            m.src.display(),
            m.mnt.display(),
            m.cache.display()
        );
        mounted.push(m.mnt.clone());
    }

    let (program, rest) = match args.cmd.split_first() {
        Some(split) => split,
        None => bail!("no command given after --"),
    };
    let mut library = None;
    let (envs, say) = if args.no_direct {
        // Said to CMD too, so that stagefs.Loader, which asks the daemon itself, reads through
        // the mounts as well.
        (
            vec![("STAGEFS_DIRECT".into(), "0".into())],
            "direct reads: off (--no-direct)".to_string(),
        )
    } else if std::env::var_os("STAGEFS_DIRECT").is_some_and(|v| v == "0") {
        (
            vec![("STAGEFS_DIRECT".into(), "0".into())],
            "direct reads: off (STAGEFS_DIRECT=0)".to_string(),
        )
    } else {
        direct_env(&mounts, &mut library)
    };
    if !mounts.is_empty() {
        eprintln!("stagefs run: {say}");
    }
    let child = match Supervised::spawn(program, rest, &envs) {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "stagefs run: cannot start {}: {e}",
                program.to_string_lossy()
            );
            unmount_all(&exe, &mounted);
            return Ok(if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            });
        }
    };
    let status = supervise(&child, &syncer, &syncs, args.every, args.grace);
    drop(child);

    let mut sync_ok = true;
    for s in &syncs {
        sync_ok &= sync_pair(&syncer, s, "final");
        eprintln!(
            "stagefs run: outputs of {} are in {}",
            s.src.display(),
            s.dst.display()
        );
    }
    let unmount_ok = unmount_all(&exe, &mounted);
    if status == 0 && !sync_ok {
        eprintln!("stagefs run: the command succeeded but the final sync failed: exit 1");
        return Ok(1);
    }
    if status == 0 && !unmount_ok {
        eprintln!("stagefs run: the command succeeded but an unmount failed: exit 1");
        return Ok(1);
    }
    Ok(status)
}

/// Sync interval after SLURM's warning (SIGUSR1), if `--every` is longer: the command writes
/// its last checkpoint after the warning, and with the usual 300 s warning 30 s leaves several
/// passes to bring it home before the time limit.
const WARNED_EVERY: Duration = Duration::from_secs(30);

/// Waits for the command, syncing periodically and on SIGUSR1; returns its status.
fn supervise(
    child: &Supervised,
    syncer: &Syncer,
    syncs: &[SyncSpec],
    every: Duration,
    grace: Duration,
) -> i32 {
    // With periodic syncs off we still wake up hourly, harmlessly.
    let mut period = if every.is_zero() {
        Duration::from_secs(3600)
    } else {
        every
    };
    let mut periodic = !every.is_zero();
    let mut next = Instant::now() + period;
    loop {
        let wait = next.saturating_duration_since(Instant::now());
        match child.next_event(wait) {
            Some(Event::Exited(status)) => {
                eprintln!("stagefs run: command exited with status {status}");
                return status;
            }
            Some(Event::Signal(sig)) if sig == libc::SIGUSR1 => {
                eprintln!(
                    "stagefs run: SIGUSR1 (time limit near): forwarded to the command, syncing now"
                );
                for s in syncs {
                    sync_pair(syncer, s, "on SIGUSR1");
                }
                // The command is checkpointing in response: keep persistent storage close
                // behind it until the end.
                periodic = true;
                period = period.min(WARNED_EVERY);
                next = Instant::now() + period;
                eprintln!("stagefs run: syncing every {period:?} until the command exits");
            }
            Some(Event::Signal(sig)) if sig == libc::SIGTERM || sig == libc::SIGINT => {
                eprintln!(
                    "stagefs run: {}: forwarded; giving the command {:?} to exit",
                    signals::name(sig),
                    grace
                );
                if let Some(status) = child.wait_exit(grace) {
                    eprintln!("stagefs run: command exited with status {status}");
                    return status;
                }
                eprintln!("stagefs run: command still running after {grace:?}: killing it");
                child.kill(libc::SIGKILL);
                let _ = child.wait_exit(Duration::from_secs(5));
                return 128 + sig;
            }
            Some(Event::Signal(sig)) => {
                eprintln!(
                    "stagefs run: {} forwarded to the command",
                    signals::name(sig)
                );
            }
            None => {
                if periodic && Instant::now() >= next {
                    for s in syncs {
                        sync_pair(syncer, s, "periodic");
                    }
                }
                if Instant::now() >= next {
                    next = Instant::now() + period;
                }
            }
        }
    }
}

/// Runs one sync pass and prints its summary and failures; true when nothing failed.
fn sync_pair(syncer: &Syncer, s: &SyncSpec, why: &str) -> bool {
    match super::sync::pass(syncer, &s.src, &s.dst, false) {
        Ok(report) => {
            eprintln!(
                "stagefs run: {why} sync: {}",
                super::sync::summary(&s.src, &s.dst, &report)
            );
            for (path, err) in &report.failed {
                eprintln!("stagefs run: FAILED {}: {err}", s.dst.join(path).display());
            }
            report.ok()
        }
        Err(e) => {
            eprintln!(
                "stagefs run: {why} sync {} -> {} failed: {e:#}",
                s.src.display(),
                s.dst.display()
            );
            false
        }
    }
}

/// The environment that gives CMD direct reads of staged files: the library this binary
/// carries ([`super::preload`]) first in `LD_PRELOAD`, and `STAGEFS_DIRECT_MOUNTS=MNT=SOCKET:...`,
/// each mount's control socket read from its stats file; and the line that says whether
/// direct reads are on (and why not). Mounts whose socket cannot be found are left out (read
/// through FUSE). The library stays written out while `keep` lives.
fn direct_env(
    mounts: &[MountSpec],
    keep: &mut Option<super::preload::Installed>,
) -> (Vec<(OsString, OsString)>, String) {
    let mut list = OsString::new();
    let mut missing = Vec::new();
    for m in mounts {
        let (Some(socket), Ok(mnt)) = (control_socket(&m.mnt), std::fs::canonicalize(&m.mnt))
        else {
            missing.push(m.mnt.display().to_string());
            continue;
        };
        if !list.is_empty() {
            list.push(":");
        }
        list.push(mnt.as_os_str());
        list.push("=");
        list.push(socket.as_os_str());
    }
    let Some(first) = mounts.first() else {
        return (Vec::new(), "direct reads: off (no --mount)".into());
    };
    if list.is_empty() {
        return (
            Vec::new(),
            "direct reads: off (no mount's control socket was found; reads go through the \
             mounts)"
                .into(),
        );
    }
    let lib = match super::preload::install(&first.cache) {
        Ok(lib) => lib,
        Err(why) => {
            return (
                Vec::new(),
                format!("direct reads: off ({why}); reads go through the mounts"),
            )
        }
    };
    let mut say = format!("direct reads: on (library {})", lib.path.display());
    if !missing.is_empty() {
        say.push_str(&format!(
            "; not for {} (no control socket)",
            missing.join(", ")
        ));
    }
    let env = vec![
        (
            "LD_PRELOAD".into(),
            super::preload::preload_value(&lib.path),
        ),
        ("STAGEFS_DIRECT_MOUNTS".into(), list),
    ];
    *keep = Some(lib);
    (env, say)
}

/// The control socket of the mount at `mnt` (the stats file's `hint_socket`).
fn control_socket(mnt: &Path) -> Option<PathBuf> {
    let text = std::fs::read(mnt.join(".stagefs/stats")).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&text).ok()?;
    let socket = PathBuf::from(v.get("hint_socket")?.as_str()?);
    // Split at "=/" by the library: a socket path must be absolute and free of ':'.
    let ok = socket.is_absolute() && !socket.as_os_str().as_encoded_bytes().contains(&b':');
    ok.then_some(socket)
}

fn mount(exe: &Path, m: &MountSpec, extra: &[String]) -> anyhow::Result<()> {
    std::fs::create_dir_all(&m.mnt)
        .with_context(|| format!("creating mount point {}", m.mnt.display()))?;
    // `stagefs mount` creates the cache (0700) and refuses one that is not private.
    let status = Command::new(exe)
        .arg("mount")
        .arg(&m.src)
        .arg(&m.mnt)
        .arg("--cache")
        .arg(&m.cache)
        .args(extra)
        .status()
        .context("running stagefs mount")?;
    if !status.success() {
        bail!(
            "stagefs mount {} {} failed ({status}); nothing was started",
            m.src.display(),
            m.mnt.display()
        );
    }
    Ok(())
}

/// Unmounts in reverse order; true when all succeeded.
fn unmount_all(exe: &Path, mounted: &[PathBuf]) -> bool {
    let mut ok = true;
    for mnt in mounted.iter().rev() {
        match Command::new(exe).arg("umount").arg(mnt).status() {
            Ok(s) if s.success() => eprintln!("stagefs run: unmounted {}", mnt.display()),
            Ok(s) => {
                eprintln!("stagefs run: stagefs umount {} failed ({s})", mnt.display());
                ok = false;
            }
            Err(e) => {
                eprintln!("stagefs run: cannot run stagefs umount: {e}");
                ok = false;
            }
        }
    }
    ok
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_reject_bad_input() {
        let m = parse_mount("/bigdata/p:/scratch/data:/scratch/cache").unwrap();
        assert_eq!(m.cache, PathBuf::from("/scratch/cache"));
        let m = parse_mount("/bigdata/p:/scratch/data").unwrap();
        assert!(m.cache.to_string_lossy().contains("stagefs-cache-"));
        assert!(parse_mount("/only").is_err());
        assert!(parse_mount("a:b:c:d").is_err());
        assert!(parse_sync("a:b").is_ok());
        assert!(parse_sync("a").is_err());
        assert!(parse_sync(":b").is_err());
    }

    #[test]
    fn default_cache_is_never_a_predictable_name_in_a_shared_dir() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let tmp = tempfile::tempdir().unwrap();
        let shared = tmp.path().join("tmp");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let c = default_cache_in(shared.clone(), Path::new("/bigdata/x")).unwrap();
        let parent = c.parent().unwrap();
        assert_ne!(
            parent,
            shared,
            "cache directly in a world-writable dir: {}",
            c.display()
        );
        let m = std::fs::symlink_metadata(parent).unwrap();
        assert_eq!(m.mode() & 0o777, 0o700);
        // A private base (ours, closed to others) is used as is.
        let private = tmp.path().join("job");
        std::fs::create_dir(&private).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
        let c = default_cache_in(private.clone(), Path::new("/bigdata/x")).unwrap();
        assert_eq!(c.parent().unwrap(), private);
    }

    #[test]
    fn default_cache_dir_precreated_by_another_user_is_refused() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root (to create a directory owned by another user)");
            return;
        }
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let shared = tmp.path().join("tmp");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let planted = shared.join("stagefs-0");
        std::fs::create_dir(&planted).unwrap();
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::os::unix::fs::chown(&planted, Some(65534), Some(65534)).unwrap();
        let e = default_cache_in(shared, Path::new("/bigdata/x")).unwrap_err();
        assert!(format!("{e:#}").contains("not by you"), "{e:#}");
    }
}
