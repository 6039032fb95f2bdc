//! `stagefs run`: the command's exit status is returned; SIGTERM and SIGUSR1 are forwarded and
//! cause syncs (a final one before exit); mounts are gone afterwards.
#![allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use stagefs_test_support::{test, Need};

const BIN: &str = env!("CARGO_BIN_EXE_stagefs");

fn run_cmd(sync: &str, extra: &[&str], script: &str) -> Command {
    let mut c = Command::new(BIN);
    c.args(["run", "--sync", sync])
        .args(extra)
        .args(["--", "bash", "-c", script]);
    c
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn wait_for(path: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, sig) };
}

fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf, String) {
    let t = tempfile::tempdir().unwrap();
    let (out, home) = (t.path().join("scratch/out"), t.path().join("bigdata/run"));
    let spec = format!("{}:{}", out.display(), home.display());
    (t, out, home, spec)
}

fn exit_status_is_returned_and_outputs_synced() {
    let (_t, out, home, spec) = dirs();
    let script = format!("echo result > {}/r.txt; exit 7", out.display());
    let o = run_cmd(&spec, &[], &script).output().unwrap();
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(home.join("r.txt")).unwrap(),
        "result\n"
    );
    assert!(
        stderr(&o).contains("are in"),
        "says where outputs went: {}",
        stderr(&o)
    );

    let o = run_cmd(&spec, &[], "kill -KILL $$").output().unwrap();
    assert_eq!(o.status.code(), Some(137), "128 + SIGKILL: {}", stderr(&o));

    let o = Command::new(BIN)
        .args(["run", "--", "/nonexistent/cmd"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(127), "{}", stderr(&o));
}

fn periodic_sync_runs_while_the_command_runs() {
    let (_t, out, home, spec) = dirs();
    let flag = out.join("../synced-seen");
    let script = format!(
        "echo a > {o}/a; while [ ! -e {h}/a ]; do sleep 0.05; done; touch {f}",
        o = out.display(),
        h = home.display(),
        f = flag.display()
    );
    let o = run_cmd(&spec, &["--every", "200ms"], &script)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(flag.exists());
    assert!(stderr(&o).contains("periodic sync"), "{}", stderr(&o));
}

fn sigterm_forwards_then_final_sync_and_child_status() {
    let (_t, out, home, spec) = dirs();
    let script = format!(
        "trap 'echo saved > {o}/on_term.txt; exit 3' TERM; echo x > {o}/ready; \
         while true; do sleep 0.05; done",
        o = out.display()
    );
    let child = run_cmd(&spec, &["--every", "0"], &script)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&out.join("ready"), "the command to start");
    signal(&child, libc::SIGTERM);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    // Written by the command's TERM handler, so only a sync after its exit can have copied it.
    assert_eq!(
        std::fs::read_to_string(home.join("on_term.txt")).unwrap(),
        "saved\n"
    );
}

fn sigterm_kills_a_command_that_ignores_it_after_the_grace() {
    let (_t, out, home, spec) = dirs();
    let script = format!(
        "trap '' TERM; echo x > {o}/ready; while true; do sleep 0.05; done",
        o = out.display()
    );
    let child = run_cmd(&spec, &["--every", "0", "--grace", "300ms"], &script)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&out.join("ready"), "the command to start");
    signal(&child, libc::SIGTERM);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(128 + libc::SIGTERM), "{}", stderr(&o));
    assert!(
        home.join("ready").exists(),
        "final sync ran: {}",
        stderr(&o)
    );
}

fn sigusr1_is_forwarded_syncs_now_and_the_command_keeps_running() {
    let (_t, out, home, spec) = dirs();
    let script = format!(
        "trap 'echo ckpt > {o}/on_usr1.txt' USR1; trap 'exit 0' TERM; echo x > {o}/before; \
         echo x > {o}/ready; while true; do sleep 0.05; done",
        o = out.display()
    );
    // No periodic sync: only the SIGUSR1 sync can bring `before` home while it runs.
    let mut child = run_cmd(&spec, &["--every", "0"], &script)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&out.join("ready"), "the command to start");
    signal(&child, libc::SIGUSR1);
    wait_for(&home.join("before"), "the SIGUSR1 sync");
    wait_for(
        &out.join("on_usr1.txt"),
        "the command's USR1 handler (forwarding)",
    );
    assert!(
        child.try_wait().unwrap().is_none(),
        "run must keep going after SIGUSR1"
    );
    signal(&child, libc::SIGTERM);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("SIGUSR1"), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(home.join("on_usr1.txt")).unwrap(),
        "ckpt\n"
    );
}

fn is_mounted(mnt: &Path) -> bool {
    let mnt = std::fs::canonicalize(mnt).unwrap_or_else(|_| mnt.to_path_buf());
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(1) == Some(&*mnt.to_string_lossy()))
}

fn mount_serves_the_command_and_is_gone_afterwards() {
    let (t, out, home, spec) = dirs();
    let (data, mnt, cache) = (
        t.path().join("bigdata/processed"),
        t.path().join("scratch/data"),
        t.path().join("scratch/cache"),
    );
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("train.csv"), "a,b\n1,2\n").unwrap();
    let mount = format!("{}:{}:{}", data.display(), mnt.display(), cache.display());
    let script = format!(
        "cp {m}/train.csv {o}/seen.csv && grep -q {m} /proc/self/mounts",
        m = mnt.display(),
        o = out.display()
    );
    let o = Command::new(BIN)
        .args(["run", "--mount", &mount, "--sync", &spec, "--"])
        .args(["bash", "-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(home.join("seen.csv")).unwrap(),
        "a,b\n1,2\n"
    );
    assert!(!is_mounted(&mnt), "mount still present after run");
}

/// A command that succeeds but whose outputs could not all be synced must not look successful:
/// a job chained with `--dependency=afterok` would start on missing outputs.
fn failed_final_sync_turns_success_into_exit_1() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("o");
    let home = t.path().join("h");
    // As root nothing is denied: make the path of one output inside the trees exceed PATH_MAX
    // (21 directories of 200 bytes, made one `cd` at a time), which no path beneath a root can
    // name. (Only the part below DST's root counts: DST is reached beneath its descriptor.)
    let seg = "d".repeat(200);
    let spec = format!("{}:{}", out.display(), home.display());
    let script = format!(
        "echo ok > {o}/fine && cd {o} && for i in $(seq 21); do mkdir {seg} && cd {seg}; done \
         && echo x > f",
        o = out.display()
    );
    let o = run_cmd(&spec, &["--every", "0"], &script).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("FAILED"), "{}", stderr(&o));
    assert!(stderr(&o).contains("final sync failed"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(home.join("fine")).unwrap(), "ok\n");
}

fn main() -> std::process::ExitCode {
    stagefs_test_support::run(vec![
        test!(exit_status_is_returned_and_outputs_synced),
        test!(periodic_sync_runs_while_the_command_runs),
        test!(sigterm_forwards_then_final_sync_and_child_status),
        test!(sigterm_kills_a_command_that_ignores_it_after_the_grace),
        test!(sigusr1_is_forwarded_syncs_now_and_the_command_keeps_running),
        test!(mount_serves_the_command_and_is_gone_afterwards, Need::Fuse),
        test!(failed_final_sync_turns_success_into_exit_1),
    ])
}
