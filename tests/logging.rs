//! Log output written to files carries no terminal colour codes (a regression: the mount's
//! `CACHE/stagefs.log` held ANSI escapes). Every subcommand logs through one set-up
//! (`src/cli/logging.rs`); `convert` with a corrupt image is a quick way to make it log.
#![allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)

use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_stagefs");

#[test]
fn log_file_has_no_ansi_colour_codes() {
    let t = tempfile::tempdir().unwrap();
    let (src, out) = (t.path().join("src"), t.path().join("out"));
    std::fs::create_dir_all(&src).unwrap();
    // PNG magic, then garbage: a bad input the views warn about.
    std::fs::write(src.join("bad.png"), b"\x89PNG\r\n\x1a\nnot really").unwrap();
    let log = std::fs::File::create(t.path().join("log")).unwrap();
    let status = Command::new(BIN)
        .args(["convert"])
        .arg(&src)
        .arg(&out)
        .args(["--to", "npy"])
        .env_remove("NO_COLOR")
        .stdout(Stdio::null())
        .stderr(log)
        .status()
        .unwrap();
    let text = std::fs::read(t.path().join("log")).unwrap();
    let shown = String::from_utf8_lossy(&text);
    assert!(
        shown.contains("WARN"),
        "nothing was logged ({status}): {shown}"
    );
    assert!(shown.contains("bad.png"), "{shown}");
    assert!(
        !text.contains(&0x1b),
        "escape codes in a log file: {:?}",
        shown
    );
}
