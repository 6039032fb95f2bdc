//! `stagefs index`: the file it writes is one `Snapshot::load` accepts and that matches the
//! tree; the default name; `--check`; skipped entries named with exit status 1.
#![allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)

use stagefs_test_support::{test, Need};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output};

use stagefs_fs::snapshot::{Snapshot, SnapshotError};

const BIN: &str = env!("CARGO_BIN_EXE_stagefs");

fn index(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(BIN).arg("index").args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn make_dataset(root: &Path) {
    for class in ["cat", "dog"] {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for i in 0..25 {
            std::fs::write(root.join(format!("{class}/{i:03}.jpg")), vec![1u8; i]).unwrap();
        }
    }
    std::os::unix::fs::symlink("cat/000.jpg", root.join("first")).unwrap();
}

fn index_writes_a_file_that_load_accepts_beside_source_by_default() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("imagenet");
    make_dataset(&src);
    let o = index(&[src.as_os_str()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("54 entries"), "{}", text(&o));
    let file = tmp.path().join("imagenet.stagefs-index");
    assert_eq!(std::fs::metadata(&file).unwrap().mode() & 0o777, 0o600);
    let snap = Snapshot::load(&file).unwrap();
    assert_eq!(snap.source_root(), std::fs::canonicalize(&src).unwrap());
    let id = snap.resolve(Path::new("dog/024.jpg")).unwrap().unwrap();
    assert_eq!(snap.attr(id).unwrap().size, 24);
    let link = snap.resolve(Path::new("first")).unwrap().unwrap();
    assert_eq!(snap.link_target(link).unwrap(), b"cat/000.jpg");
    let mut n = 0;
    snap.walk(|_, _| n += 1);
    assert_eq!(n, 1 + 2 + 50 + 1);

    // -o, and --check of what it wrote.
    let other = tmp.path().join("elsewhere.idx");
    let o = index(&[
        src.as_os_str(),
        "-o".as_ref(),
        other.as_os_str(),
        "-q".as_ref(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(o.stderr.is_empty(), "quiet: {}", text(&o));
    let o = index(&["--check".as_ref(), other.as_os_str()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("a valid stagefs index of"),
        "{}",
        text(&o)
    );
    assert!(text(&o).contains("54 entries"), "{}", text(&o));
}

fn check_rejects_a_damaged_index_and_index_rejects_a_file_source() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("ds");
    make_dataset(&src);
    let file = tmp.path().join("ds.idx");
    assert!(index(&[src.as_os_str(), "-o".as_ref(), file.as_os_str()])
        .status
        .success());
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let o = index(&["--check".as_ref(), file.as_os_str()]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("not a usable stagefs index"),
        "{}",
        text(&o)
    );
    assert!(matches!(
        Snapshot::load(&file),
        Err(SnapshotError::Corrupt { .. })
    ));
    let o = index(&[src.join("cat/001.jpg").as_os_str()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("not a directory"), "{}", text(&o));
}

fn uid_of(user: &str) -> Option<u32> {
    let out = Command::new("id").arg("-u").arg(user).output().ok()?;
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

fn unreadable_directory_is_named_and_the_index_still_written() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    // Root reads everything: run as the unprivileged test account instead.
    let user = if root {
        Some(uid_of("stagefs-test").unwrap())
    } else {
        None
    };
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), PermissionsExt::from_mode(0o755)).unwrap();
    let src = tmp.path().join("ds");
    make_dataset(&src);
    let locked = src.join("locked");
    std::fs::create_dir(&locked).unwrap();
    std::fs::write(locked.join("secret"), b"s").unwrap();
    std::fs::set_permissions(&locked, PermissionsExt::from_mode(0o000)).unwrap();
    let out_dir = tmp.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    if let Some(uid) = user {
        std::os::unix::fs::chown(&out_dir, Some(uid), Some(uid)).unwrap();
    }
    let file = out_dir.join("ds.idx");
    let mut c = match user {
        Some(uid) => {
            let mut c = Command::new("setpriv");
            c.args([
                format!("--reuid={uid}"),
                format!("--regid={uid}"),
                "--clear-groups".into(),
                BIN.into(),
            ]);
            c
        }
        None => Command::new(BIN),
    };
    let o = c
        .arg("index")
        .arg(&src)
        .arg("-o")
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("skipped"), "{}", text(&o));
    assert!(text(&o).contains("locked"), "{}", text(&o));
    let snap = Snapshot::load(&file).unwrap();
    let locked = snap.resolve(Path::new("locked")).unwrap().unwrap();
    match snap.lookup(locked, "secret".as_ref()) {
        Err(e @ SnapshotError::Unlisted { .. }) => {
            assert_eq!(stagefs_fs::FsError::from(e).errno(), libc::EACCES)
        }
        other => panic!("{other:?}"),
    }
    assert!(snap.resolve(Path::new("dog/000.jpg")).unwrap().is_some());
}

fn main() -> std::process::ExitCode {
    stagefs_test_support::run(vec![
        test!(index_writes_a_file_that_load_accepts_beside_source_by_default),
        test!(check_rejects_a_damaged_index_and_index_rejects_a_file_source),
        test!(
            unreadable_directory_is_named_and_the_index_still_written,
            Need::Accounts
        ),
    ])
}
