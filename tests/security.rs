//! Regression tests for the cache-directory findings of the hardening audit, as two real
//! unprivileged users: `stagefs-test` (the victim, who mounts) and `stagefs-test2` (another user
//! on the same node, who tries to read or steer the victim's cache). Needs root (to switch users)
//! and both accounts (`.ci/run` creates them); skipped with a visible line otherwise.
#![allow(missing_docs, clippy::unwrap_used)]

mod common;

use stagefs_test_support::{test, Need};

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::BIN;

const VICTIM: &str = "stagefs-test";
const OTHER: &str = "stagefs-test2";

fn uid_of(user: &str) -> Option<u32> {
    let out = Command::new("id").arg("-u").arg(user).output().ok()?;
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

/// The two accounts (the harness runs these tests only where they exist).
fn users() -> (u32, u32) {
    (uid_of(VICTIM).unwrap(), uid_of(OTHER).unwrap())
}

/// `cmd args...` as `uid` (its own group, no supplementary groups, umask 000 so that only
/// stagefs's own modes protect its files).
fn as_user(uid: u32, envs: &[(&str, &Path)], cmd: &str, args: &[&str]) -> Output {
    let script = String::from("umask 000; exec \"$@\"");
    let mut c = Command::new("setpriv");
    c.args([
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".into(),
        "sh".into(),
        "-c".into(),
        script,
        "sh".into(),
        cmd.into(),
    ])
    .args(args)
    .env_remove("SLURM_TMPDIR")
    .env_remove("TMPDIR");
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A world-writable sticky directory like /tmp, plus a dataset and a mountpoint of the victim.
struct Node {
    _tmp: tempfile::TempDir,
    shared: PathBuf,
    home: PathBuf,
}

fn node(victim: u32) -> Node {
    let tmp = tempfile::tempdir().unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let shared = tmp.path().join("tmp");
    fs::create_dir(&shared).unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
    let home = tmp.path().join("home");
    fs::create_dir_all(home.join("src/d")).unwrap();
    fs::create_dir_all(home.join("mnt")).unwrap();
    fs::write(home.join("src/d/data.bin"), common::pattern(7, 300_000)).unwrap();
    fs::write(home.join(".bashrc"), b"# the victim's dotfile\n").unwrap();
    for p in ["", "src", "src/d", "src/d/data.bin", "mnt", ".bashrc"] {
        std::os::unix::fs::chown(home.join(p), Some(victim), Some(victim)).unwrap();
    }
    fs::set_permissions(&home, fs::Permissions::from_mode(0o755)).unwrap();
    Node {
        _tmp: tmp,
        shared,
        home,
    }
}

/// Another user plants a cache directory (mode 0777) full of symlinks into the victim's files.
fn plant(other: u32, dir: &Path, victim_file: &Path) {
    fs::create_dir_all(dir.join("v1/00")).unwrap();
    for name in [".stagefs-write-test", "stagefs.log"] {
        std::os::unix::fs::symlink(victim_file, dir.join(name)).unwrap();
    }
    std::os::unix::fs::symlink(victim_file, dir.join("v1/00/0000000000000000.data")).unwrap();
    for p in [dir.to_path_buf(), dir.join("v1"), dir.join("v1/00")] {
        fs::set_permissions(&p, fs::Permissions::from_mode(0o777)).unwrap();
        std::os::unix::fs::chown(&p, Some(other), Some(other)).unwrap();
    }
}

fn cache_dir_owned_by_other_user_is_refused() {
    let (victim, other) = users();
    let n = node(victim);
    let planted = n.shared.join("cache");
    plant(other, &planted, &n.home.join(".bashrc"));
    let (src, mnt) = (n.home.join("src"), n.home.join("mnt"));
    let out = as_user(
        victim,
        &[],
        BIN,
        &[
            "mount",
            src.to_str().unwrap(),
            mnt.to_str().unwrap(),
            "--cache",
            planted.to_str().unwrap(),
        ],
    );
    let msg = text(&out);
    assert!(!out.status.success(), "mounted on a planted cache: {msg}");
    assert!(msg.contains("not by you"), "message says why: {msg}");
    assert_eq!(
        fs::read(n.home.join(".bashrc")).unwrap(),
        b"# the victim's dotfile\n",
        "the victim's file was written through a planted symlink"
    );
}

fn run_default_cache_ignores_a_planted_predictable_dir() {
    let (victim, other) = users();
    let n = node(victim);
    // The default cache name of earlier versions: TMPDIR/stagefs-cache-<hash of SRC> (planted for any hash: every
    // name the victim could pick in the shared dir directly is refused or unused anyway).
    let src = n.home.join("src");
    let mnt = n.home.join("mnt");
    let spec = format!("{}:{}", src.display(), mnt.display());
    let read = format!(
        "cmp {}/d/data.bin {}/d/data.bin",
        src.display(),
        mnt.display()
    );
    let out = as_user(
        victim,
        &[("TMPDIR", &n.shared)],
        BIN,
        &["run", "--mount", &spec, "--", "sh", "-c", &read],
    );
    assert!(out.status.success(), "run failed: {}", text(&out));
    // The cache went into a private per-user directory, 0700, owned by the victim.
    let private = n.shared.join(format!("stagefs-{victim}"));
    let m = fs::symlink_metadata(&private).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o777), (victim, 0o700));
    // And every file the cache made is private whatever the umask (000 here).
    let mut stack = vec![private.clone()];
    let mut seen = 0;
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let m = fs::symlink_metadata(e.path()).unwrap();
            let want = if m.is_dir() { 0o700 } else { 0o600 };
            assert_eq!(m.mode() & 0o777, want, "mode of {}", e.path().display());
            assert_eq!(m.uid(), victim);
            if m.is_dir() {
                stack.push(e.path());
            }
            seen += 1;
        }
    }
    assert!(seen > 2, "the cache holds files");
    // If the other user squats the per-user directory, the victim is refused, clearly.
    let n2 = node(victim);
    let squat = n2.shared.join(format!("stagefs-{victim}"));
    plant(other, &squat, &n2.home.join(".bashrc"));
    let spec = format!(
        "{}:{}",
        n2.home.join("src").display(),
        n2.home.join("mnt").display()
    );
    let out = as_user(
        victim,
        &[("TMPDIR", &n2.shared)],
        BIN,
        &["run", "--mount", &spec, "--", "true"],
    );
    assert!(!out.status.success());
    assert!(text(&out).contains("not by you"), "{}", text(&out));
    assert_eq!(
        fs::read(n2.home.join(".bashrc")).unwrap(),
        b"# the victim's dotfile\n"
    );
}

/// A 4×4 grey PNG.
fn png4() -> Vec<u8> {
    let mut out = Vec::new();
    let mut e = png::Encoder::new(&mut out, 4, 4);
    e.set_color(png::ColorType::Grayscale);
    e.write_header()
        .unwrap()
        .write_image_data(&[9u8; 16])
        .unwrap();
    out
}

/// Hardening round three: on a mount with `--allow-other`, a second user who could read
/// neither `imgs/pub/private.png` (0600) nor list `imgs/secret/` (0700) got their pixels
/// through `.npy/imgs/images.npy`, and `files.txt` named `secret/topsecret-name.png`. Now an
/// image folder's view files are readable by a class only if every image and directory under
/// the folder is; tables are re-checked here as the other user too.
fn regression_image_views_leaked_under_allow_other_to_another_user() {
    let (victim, other) = users();
    let tmp = tempfile::tempdir().unwrap();
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let src = tmp.path().join("src");
    let entries: [(&str, u32); 12] = [
        ("", 0o755),
        ("imgs", 0o755),
        ("imgs/pub", 0o755),
        ("imgs/pub/ok.png", 0o644),
        ("imgs/pub/private.png", 0o600),
        ("imgs/secret", 0o700),
        ("imgs/secret/topsecret-name.png", 0o644),
        ("open", 0o755),
        ("open/a", 0o755),
        ("open/a/1.png", 0o644),
        ("private.csv", 0o600),
        ("public.csv", 0o644),
    ];
    for (p, mode) in entries {
        let path = src.join(p);
        if p.ends_with(".png") {
            fs::write(&path, png4()).unwrap();
        } else if p.ends_with(".csv") {
            fs::write(&path, b"x,y\n1,2\n3,4\n").unwrap();
        } else {
            fs::create_dir_all(&path).unwrap();
        }
        std::os::unix::fs::chown(&path, Some(victim), Some(victim)).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
    }
    // Root mounts (no user_allow_other needed); the kernel checks each reader against the
    // modes stagefs reports (default_permissions).
    fs::create_dir(tmp.path().join("mnt")).unwrap();
    fs::set_permissions(tmp.path().join("mnt"), fs::Permissions::from_mode(0o755)).unwrap();
    let mut m = common::Mount::new(tmp.path(), &src, &["--allow-other"]);
    let read_as = |uid: u32, rel: &str| {
        let out = as_user(uid, &[], "cat", &[m.mnt.join(rel).to_str().unwrap()]);
        (out.status.success(), text(&out))
    };
    for f in ["images.npy", "labels.npy", "files.txt", "classes.txt"] {
        let (ok, said) = read_as(other, &format!(".npy/imgs/{f}"));
        assert!(!ok, "the other user read .npy/imgs/{f}: {said}");
        assert!(said.contains("Permission denied"), "{said}");
        assert!(!said.contains("topsecret"), "{said}");
        let (ok, said) = read_as(victim, &format!(".npy/imgs/{f}"));
        assert!(ok, "the owner may read .npy/imgs/{f}: {said}");
        let (ok, said) = read_as(other, &format!(".npy/open/{f}"));
        assert!(ok, "a folder everyone may read: {f}: {said}");
    }
    let (_, names) = read_as(victim, ".npy/imgs/files.txt");
    assert!(names.contains("topsecret-name.png"), "{names}");
    // Tables: a 0600 table's columns are the owner's; a 0644 table's are everyone's.
    let (ok, said) = read_as(other, ".npy/private.csv/x.npy");
    assert!(!ok && said.contains("Permission denied"), "{said}");
    assert!(read_as(victim, ".npy/private.csv/x.npy").0);
    let (ok, said) = read_as(other, ".npy/public.csv/x.npy");
    assert!(ok, "{said}");
    m.umount();
}

fn main() -> std::process::ExitCode {
    stagefs_test_support::run(vec![
        test!(
            regression_image_views_leaked_under_allow_other_to_another_user,
            Need::Root,
            Need::Fuse,
            Need::Accounts
        ),
        test!(
            cache_dir_owned_by_other_user_is_refused,
            Need::Root,
            Need::Fuse,
            Need::Accounts
        ),
        test!(
            run_default_cache_ignores_a_planted_predictable_dir,
            Need::Root,
            Need::Fuse,
            Need::Accounts
        ),
    ])
}
