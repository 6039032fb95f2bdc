//! Direct reads of unmodified programs under `stagefs run` (the preload library
//! `libstagefs_direct.so`, `direct/preload`): a C program as a normal user, Python threads and
//! fork/spawn workers, a static binary (falls back), `--no-direct`, and a daemon killed while a
//! preloaded program reads (nothing hangs); `stagefs.Loader`'s core reading `.npy` files direct.
#![allow(missing_docs, clippy::unwrap_used)]

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{pattern, Mount, BIN};
use stagefs_test_support::{test, Need};

const MB: usize = 1 << 20;
const FILES: [&str; 3] = ["f0.bin", "d/f1.bin", "f2.bin"];

/// A directory holding `stagefs` (hard link, or a copy with `copy`: a file another user will
/// own). The binary carries the direct-read library: nothing goes beside it.
fn install(dir: &Path, copy: bool) -> PathBuf {
    fs::create_dir_all(dir).unwrap();
    let to = dir.join("stagefs");
    if copy || fs::hard_link(BIN, &to).is_err() {
        fs::copy(BIN, &to).unwrap();
    }
    to
}

/// The library `stagefs run` writes out (into its first mount's cache), for a test that sets
/// `LD_PRELOAD` itself: from a throwaway `stagefs run` of `true` over `src`.
fn written_library(t: &Path, src: &Path) -> PathBuf {
    let (mnt, cache) = (t.join("lib-mnt"), t.join("lib-cache"));
    let o = Command::new(BIN)
        .arg("run")
        .arg("--mount")
        .arg(format!(
            "{}:{}:{}",
            src.display(),
            mnt.display(),
            cache.display()
        ))
        .args(["--", "true"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let lib = fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "so"))
        .expect("stagefs run wrote its library into the cache");
    let keep = t.join("libstagefs_direct.so");
    fs::copy(&lib, &keep).unwrap();
    keep
}

/// A source of three large files and a small one; the reader compiled (`static`: also a
/// static build).
fn setup(tmp: &Path, static_too: bool) -> PathBuf {
    let src = tmp.join("src");
    fs::create_dir_all(src.join("d")).unwrap();
    for (i, f) in FILES.iter().enumerate() {
        fs::write(src.join(f), pattern(i as u64, 12 * MB + 4321 * i)).unwrap();
    }
    fs::write(src.join("small.txt"), b"small\n").unwrap();
    let c = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/direct/reader.c");
    let mut builds = vec![("reader", false)];
    if static_too {
        builds.push(("reader-static", true));
    }
    for (name, st) in builds {
        let mut cc = Command::new("cc");
        cc.args(["-O2", "-o"]).arg(tmp.join(name)).arg(&c);
        if st {
            cc.arg("-static");
        }
        let o = cc.output().expect("cc is needed for this test");
        assert!(
            o.status.success(),
            "cc: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    src
}

/// Gives the tree `t` to user `uid` (`chown -R`), its top directory 0755.
fn give_to(uid: u32, t: &Path) {
    let st = Command::new("chown")
        .arg("-R")
        .arg(format!("{uid}:{uid}"))
        .arg(t)
        .status()
        .unwrap();
    assert!(st.success());
    fs::set_permissions(t, fs::Permissions::from_mode(0o755)).unwrap();
}

/// `setpriv` to user `uid` (its own group, no others): the program and its arguments follow.
fn as_user(uid: u32) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        &format!("--reuid={uid}"),
        &format!("--regid={uid}"),
        "--clear-groups",
    ]);
    c
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn stats(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

/// As `stagefs-test`: `stagefs run` preloads the library; the C program (open, openat,
/// fopen, fopen64; with and without close-on-exec) gets direct descriptors of the staged
/// files, byte-exact, counted by the daemon, their fstat the path's file (`cp` copies them:
/// regression, it refused "replaced while being copied" when fstat showed the cache's copy).
/// The small file opens its copy itself, through the direct table (no round trip, counted in
/// `direct_table_opens`). A static build, `--no-direct` and `STAGEFS_DIRECT=0` read through
/// the mount.
fn c_program_under_stagefs_run_reads_staged_files_direct_as_a_normal_user() {
    let uid = stagefs_test_support::uid_of("stagefs-test").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let src = setup(t, true);
    let bin = install(&t.join("bin"), true);
    let out = t.join("out");
    fs::create_dir(&out).unwrap();
    give_to(uid, t);
    let (mnt, cache) = (t.join("mnt"), t.join("cache"));
    let spec = format!("{}:{}:{}", src.display(), mnt.display(), cache.display());
    let run = |extra: &[&str], env: &[(&str, &str)], script: String| {
        let mut c = as_user(uid);
        c.arg(&bin)
            .args(["run", "--mount", &spec])
            .args(extra)
            .args(["--", "sh", "-c", &script])
            .current_dir(t)
            .env("HOME", t)
            .env_remove("LD_PRELOAD")
            .env_remove("STAGEFS_DIRECT");
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    let (m, s) = (mnt.display(), src.display());
    let files = FILES.join(" ");
    let script = format!(
        "./reader {m} {s} 60 {files} f0.bin && cp {m}/f0.bin out/f0.copy && \
         cmp out/f0.copy {s}/f0.bin && sleep 1.2 && cat {m}/.stagefs/stats > out/before.json && \
         ./reader {m} {s} 60 small.txt && \
         sleep 1.2 && cat {m}/.stagefs/stats > out/direct.json && \
         ./reader-static {m} {s} 0 {files} > out/static.txt && \
         sleep 1.2 && cat {m}/.stagefs/stats > out/static.json"
    );
    let o = run(&[], &[], script);
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("direct 4 of 4"), "{}", text(&o));
    assert!(
        stdout.contains("direct 1 of 1"),
        "the small file: {}",
        text(&o)
    );
    let d = stats(&out.join("direct.json"));
    // The small file went through the table: opened by the reader itself.
    let before = stats(&out.join("before.json"));
    assert!(
        d["direct_table_opens"].as_u64().unwrap() > before["direct_table_opens"].as_u64().unwrap(),
        "{d}"
    );
    assert!(d["direct_opens"].as_u64().unwrap() >= 5, "{d}");
    assert!(
        d["bytes_direct"].as_u64().unwrap() >= 4 * 12 * MB as u64,
        "{d}"
    );
    // The static build never asked: the count did not move, and it saw no direct descriptor.
    assert_eq!(
        fs::read_to_string(out.join("static.txt")).unwrap(),
        "direct 0 of 3\n"
    );
    let s2 = stats(&out.join("static.json"));
    assert_eq!(s2["direct_opens"], d["direct_opens"], "{s2}");
    // Another user cannot reach the control socket (0700 cache directory, 0600 socket).
    let uid2 = stagefs_test_support::uid_of("stagefs-test2").unwrap();
    let mut held = as_user(uid)
        .arg(&bin)
        .args(["run", "--mount", &spec, "--", "sh", "-c"])
        .arg("touch out/ready; while [ ! -e out/go ]; do sleep 0.05; done")
        .current_dir(t)
        .env("HOME", t)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !out.join("ready").exists() {
        assert!(Instant::now() < deadline, "the held run never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let socket = cache.join(stagefs_protocol::SOCKET_NAME);
    let other = as_user(uid2)
        .args([
            "/usr/bin/python3",
            "-c",
            "import socket, sys\n\
             s = socket.socket(socket.AF_UNIX)\n\
             try:\n    s.connect(sys.argv[1]); print('connected')\n\
             except PermissionError:\n    print('denied')",
        ])
        .arg(&socket)
        .output()
        .unwrap();
    fs::write(out.join("go"), b"").unwrap();
    assert!(held.wait().unwrap().success());
    assert!(socket.parent().unwrap().exists());
    assert_eq!(
        String::from_utf8_lossy(&other.stdout),
        "denied\n",
        "{}",
        text(&other)
    );
    // Off: --no-direct and STAGEFS_DIRECT=0 (the cache is warm and verified by now).
    for (extra, env) in [
        (&["--no-direct"][..], &[][..]),
        (&[][..], &[("STAGEFS_DIRECT", "0")][..]),
    ] {
        // CMD is told too (stagefs.Loader asks the daemon itself, without the library).
        let script = format!(
            "./reader {m} {s} 0 {files} && cat {m}/.stagefs/stats > out/off.json && \
             [ \"$STAGEFS_DIRECT\" = 0 ]"
        );
        let o = run(extra, env, script);
        assert!(o.status.success(), "{}", text(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("direct 0 of 3"),
            "{}",
            text(&o)
        );
        let off = stats(&out.join("off.json"));
        assert_eq!(off["direct_opens"], 0, "{off}");
        assert_eq!(off["direct_refused"], 0, "nothing asked: {off}");
    }
}

const PY: &str = r#"
import multiprocessing as mp, os, sys, threading, time
MNT, SRC, FILES = sys.argv[1], sys.argv[2], sys.argv[3:]
def read(f):
    until = time.time() + 60
    path = os.path.join(MNT, f)
    while True:
        with open(path, "rb") as fh:
            direct = not os.readlink(f"/proc/self/fd/{fh.fileno()}").startswith(MNT)
            st, ps = os.fstat(fh.fileno()), os.stat(path)
            assert (st.st_dev, st.st_ino, st.st_mtime_ns) == (ps.st_dev, ps.st_ino, ps.st_mtime_ns)
            data = fh.read()
        if direct or time.time() > until:
            break
        time.sleep(0.05)
    with open(os.path.join(SRC, f), "rb") as fh:
        want = fh.read()
    return data == want, direct
if __name__ == "__main__":
    main = [read(f) for f in FILES]
    res = {}
    ts = [threading.Thread(target=lambda i=i, f=f: res.__setitem__(i, read(f))) for i, f in enumerate(FILES * 3)]
    [t.start() for t in ts]; [t.join() for t in ts]
    out = {"main": main, "threads": [res[i] for i in sorted(res)]}
    for how in ("fork", "spawn"):
        with mp.get_context(how).Pool(3) as pool:
            out[how] = pool.map(read, FILES * 2)
    bad = {k: v for k, v in out.items() if not all(ok and d for ok, d in v)}
    # A mapping outlives its file object (numpy's memmap closes the file): the pin stays.
    import json, mmap
    with open(os.path.join(MNT, FILES[0]), "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    time.sleep(1.2)  # a fresh rendering of the stats file
    with open(os.path.join(MNT, ".stagefs", "stats")) as f:
        pins = json.load(f)["direct_pins"]
    with open(os.path.join(SRC, FILES[0]), "rb") as fh:
        if mm[:] != fh.read() or pins != 1:
            bad["mmap"] = f"pins {pins}"
    print("ok" if not bad else f"bad {bad}", flush=True)
"#;

/// Python (threads, multiprocessing fork and spawn) under `stagefs run`: every worker's reads
/// are byte-exact and go direct; the daemon counts them. A mapping of a direct file keeps its
/// pin after the file is closed (regression: close released it, eviction could then punch
/// holes under the mapping).
fn python_threads_fork_and_spawn_workers_read_direct() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let src = setup(t, false);
    let bin = install(&t.join("bin"), false);
    let (mnt, cache) = (t.join("mnt"), t.join("cache"));
    fs::write(t.join("read.py"), PY).unwrap();
    let spec = format!("{}:{}:{}", src.display(), mnt.display(), cache.display());
    let script = format!(
        "python3 read.py {m} {s} {files} && cat {m}/.stagefs/stats > stats.json && \
         {b} stat {m} > stat.txt",
        b = bin.display(),
        m = mnt.display(),
        s = src.display(),
        files = FILES.join(" ")
    );
    let o = Command::new(&bin)
        .args(["run", "--mount", &spec, "--", "sh", "-c", &script])
        .current_dir(t)
        .env_remove("LD_PRELOAD")
        .env_remove("STAGEFS_DIRECT")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}",
        text(&o)
    );
    let s = stats(&t.join("stats.json"));
    // main 3 + threads 9 + fork 6 + spawn 6.
    assert!(s["direct_opens"].as_u64().unwrap() >= 24, "{s}");
    let stat = fs::read_to_string(t.join("stat.txt")).unwrap();
    assert!(
        stat.contains("\ndirect     "),
        "stagefs stat shows direct opens: {stat}"
    );
}

/// The daemon killed (SIGKILL) while a preloaded program holds a direct descriptor: reads of
/// that descriptor stay exact, the next open fails or falls back at once, nothing hangs.
fn killed_daemon_under_a_preloaded_program_hangs_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let src = setup(t, false);
    let lib = written_library(t, &src);
    let mut m = Mount::new(t, &src, &[]);
    let m_s = (m.mnt.display().to_string(), src.display().to_string());
    let socket = m.stats()["hint_socket"].as_str().unwrap().to_string();
    let env = [
        ("LD_PRELOAD", lib.display().to_string()),
        (
            "STAGEFS_DIRECT_MOUNTS",
            format!("{}={socket}", fs::canonicalize(&m.mnt).unwrap().display()),
        ),
    ];
    // Staged and verified: the reader gets f0.bin direct.
    let o = Command::new(t.join("reader"))
        .args([&m_s.0, &m_s.1, "60", "f0.bin"])
        .envs(env.clone())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    // Holds f0.bin open (direct), waits for the go file, reads it, then opens f2.bin.
    let script = format!(
        "exec 3< {mnt}/f0.bin; echo held; while [ ! -e {t}/go ]; do sleep 0.05; done; \
         cmp - {src}/f0.bin <&3 && echo same; cat {mnt}/f2.bin > /dev/null; echo done $?",
        mnt = m_s.0,
        src = m_s.1,
        t = t.display()
    );
    let mut child = Command::new("bash")
        .args(["-c", &script])
        .envs(env)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line, "held\n");
    let pid = m.stats()["pid"].as_i64().unwrap() as i32;
    // SAFETY: kill(2) of the daemon's process.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    fs::write(t.join("go"), b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the preloaded program hung after the daemon was killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(status.success(), "{rest}");
    assert!(
        rest.starts_with("same\n"),
        "the held descriptor's bytes: {rest}"
    );
    assert!(rest.contains("done "), "{rest}");
    // The dead mount is cleared as after any killed daemon.
    m.umount();
}

/// A `.npy` of `rows` rows of `row_bytes` bytes, row r filled with (r * 7 + i) % 251.
fn npy_rows(path: &Path, rows: u64, row_bytes: u64) {
    use stagefs_npy::{DType, NpyHeader};
    let mut file = NpyHeader::new(DType::U8, vec![rows, row_bytes]).encode();
    for r in 0..rows {
        file.extend((0..row_bytes).map(|i| ((r * 7 + i) % 251) as u8));
    }
    fs::write(path, file).unwrap();
}

/// `stagefs.Loader`'s core over a mount: a staged, verified large `.npy` is read through a
/// direct descriptor (the daemon counts it) with every batch exact; a small file falls back
/// with its reason; `direct: false` asks nothing.
fn loader_reads_staged_npy_direct_and_falls_back_per_file_with_a_reason() {
    use stagefs_gpu::{CpuDevice, Loader, LoaderConfig, Source};
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let src = t.join("src");
    fs::create_dir_all(&src).unwrap();
    let (rows, big_row, small_row) = (600u64, 20_000u64, 3000u64);
    npy_rows(&src.join("x.npy"), rows, big_row);
    npy_rows(&src.join("y.npy"), rows, small_row);
    // No background staging: y.npy stays unstaged until it is read.
    let m = Mount::new(t, &src, &["--stage-hinted"]);
    let (x, y) = (m.mnt.join("x.npy"), m.mnt.join("y.npy"));
    let config = |direct| LoaderConfig {
        batch_size: 64,
        shuffle: true,
        seed: 3,
        direct,
        ..LoaderConfig::default()
    };
    let loader = |direct| {
        let sources = vec![Source::npy(&x).unwrap(), Source::npy(&y).unwrap()];
        Loader::new(Arc::new(CpuDevice::new()), sources, config(direct)).unwrap()
    };
    // Staged by reading it, then verified on the first refused direct open.
    let deadline = Instant::now() + Duration::from_secs(60);
    let l = loop {
        let _ = fs::read(&x).unwrap();
        let l = loader(true);
        if l.direct_status()[0].1.is_none() {
            break l;
        }
        assert!(
            Instant::now() < deadline,
            "never direct: {:?}",
            l.direct_status()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let status = l.direct_status();
    assert_eq!(status[0].0, x);
    assert_eq!(status[1].1.as_deref(), Some("not staged yet"));
    let row = |r: u64, rb: u64| (0..rb).map(move |i| ((r * 7 + i) % 251) as u8);
    let order = l.order(0);
    let mut seen = 0;
    for (i, batch) in l.epoch(0).unwrap().enumerate() {
        let batch = batch.unwrap();
        assert_eq!(
            batch.rows(),
            &order[i * 64..((i + 1) * 64).min(order.len())]
        );
        for (p, rb) in [(0, big_row), (1, small_row)] {
            let want: Vec<u8> = batch.rows().iter().flat_map(|&r| row(r, rb)).collect();
            assert!(batch.host_part(p) == want.as_slice(), "batch {i} part {p}");
        }
        seen += batch.rows().len();
    }
    assert_eq!(seen, rows as usize);
    let s = m.stats();
    assert!(s["direct_opens"].as_u64().unwrap() >= 1, "{s}");
    // Batches outlive their loader: so does the pin of the copy their readers read.
    let mut e = l.epoch(1).unwrap();
    let b = e.next_batch().unwrap().unwrap();
    drop(l);
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(m.stats()["direct_pins"], 1);
    drop(b);
    drop(e);
    m.wait_stats_now("the pin released with the loader's last reader", |s| {
        s["direct_pins"] == 0
    });
    // Once read (staged), the small file is direct too: a copy of its own, unpinned.
    let _ = fs::read(&y).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let l = loader(true);
        if l.direct_status().iter().all(|(_, why)| why.is_none()) {
            let (e, b) = (
                l.epoch(0).unwrap().count(),
                m.stats()["direct_pins"].clone(),
            );
            assert!(e > 0);
            assert_eq!(b, 1, "only the large file is pinned");
            break;
        }
        assert!(Instant::now() < deadline, "{:?}", l.direct_status());
        std::thread::sleep(Duration::from_millis(100));
    }
    // The counters now (stats_now), not a rendering of the stats file kept while it is read.
    let before = m.stats_now()["direct_opens"].clone();
    let off = loader(false);
    assert!(off.direct_status().is_empty());
    assert_eq!(m.stats_now()["direct_opens"], before);
}

/// Every case of `tests/direct/libc_cases.c` (the cases list), as `stagefs run` gives them.
const LIBC_CASES: [&str; 17] = [
    "warm",
    "errno",
    "o_path",
    "o_directory",
    "o_nofollow",
    "writes",
    "relative_openat",
    "fchdir",
    "openat2",
    "dup",
    "close_range",
    "threads",
    "fd_limit",
    "signal",
    "mmap",
    "fork_exec",
    "vfork_spawn",
];

/// The preload library as a libc citizen, as a normal user under `stagefs run`: errno kept,
/// `O_PATH`, `O_DIRECTORY`, `O_NOFOLLOW`, writes and `O_CREAT` (the kernel's own answer, never
/// the cache), relative `openat` on a directory descriptor of the mount, `fchdir`, `openat2`,
/// the `dup` family, `close_range`, threads racing, the descriptor limit, a signal handler that
/// opens, `mmap`, `fork`/`exec`, `vfork`/`posix_spawn`: each case compared with the source's
/// bytes or a raw system call's answer (tests/direct/libc_cases.c).
fn preload_keeps_libc_semantics_case_by_case() {
    let uid = stagefs_test_support::uid_of("stagefs-test").unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let src = t.join("src");
    fs::create_dir_all(src.join("d")).unwrap();
    fs::write(src.join("big.bin"), pattern(7, 12 * MB + 99)).unwrap();
    fs::write(src.join("small.bin"), pattern(8, 100_000)).unwrap();
    fs::write(src.join("d/f.bin"), pattern(9, 50_000)).unwrap();
    std::os::unix::fs::symlink("big.bin", src.join("link.bin")).unwrap();
    let c = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/direct/libc_cases.c");
    let o = Command::new("cc")
        .args(["-O2", "-pthread", "-o"])
        .arg(t.join("libc_cases"))
        .arg(&c)
        .output()
        .expect("cc is needed for this test");
    assert!(o.status.success(), "cc: {}", text(&o));
    let bin = install(&t.join("bin"), true);
    give_to(uid, t);
    let (mnt, cache) = (t.join("mnt"), t.join("cache"));
    let spec = format!("{}:{}:{}", src.display(), mnt.display(), cache.display());
    let (m, s) = (mnt.display(), src.display());
    let o = as_user(uid)
        .arg("timeout")
        .arg("300")
        .arg(&bin)
        .args(["run", "--mount", &spec, "--", "sh", "-c"])
        .arg(format!(
            "cat {m}/big.bin {m}/small.bin {m}/d/f.bin > /dev/null && ./libc_cases {m} {s} all"
        ))
        .current_dir(t)
        .env("HOME", t)
        .env_remove("LD_PRELOAD")
        .env_remove("STAGEFS_DIRECT")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    for case in LIBC_CASES {
        assert!(
            out.lines().any(|l| l == format!("ok {case}")),
            "case {case}: {}",
            text(&o)
        );
    }
    assert!(o.status.success(), "{}", text(&o));
}

fn main() -> std::process::ExitCode {
    stagefs_test_support::run(vec![
        test!(
            c_program_under_stagefs_run_reads_staged_files_direct_as_a_normal_user,
            Need::Fuse,
            Need::Root,
            Need::Accounts,
            Need::UserFuse
        ),
        test!(
            preload_keeps_libc_semantics_case_by_case,
            Need::Fuse,
            Need::Root,
            Need::Accounts,
            Need::UserFuse
        ),
        test!(
            python_threads_fork_and_spawn_workers_read_direct,
            Need::Fuse
        ),
        test!(
            killed_daemon_under_a_preloaded_program_hangs_nothing,
            Need::Fuse
        ),
        test!(
            loader_reads_staged_npy_direct_and_falls_back_per_file_with_a_reason,
            Need::Fuse
        ),
    ])
}
