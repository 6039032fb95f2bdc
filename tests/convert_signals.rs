//! `stagefs convert` stopped by a signal leaves no hidden temporary in OUT.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Every file under `dir` whose name ends with `.stagefs-tmp`.
fn temporaries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(temporaries(&p));
        } else if p.to_string_lossy().ends_with(".stagefs-tmp") {
            out.push(p);
        }
    }
    out
}

/// A PNG of `side`² with a pattern that compresses well (fast to write, slow to resize).
fn write_png(path: &Path, side: u32, seed: u32) {
    let file = std::fs::File::create(path).expect("create");
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), side, side);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header().expect("header");
    let data: Vec<u8> = (0..side * side * 3)
        .map(|i| ((i / 3 / side + seed) % 251) as u8)
        .collect();
    w.write_image_data(&data).expect("data");
}

#[test]
fn convert_stopped_by_sigterm_leaves_no_temporary_in_out() {
    let tmp = tempfile::tempdir().expect("tmp");
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("class")).expect("mkdir");
    for i in 0..24 {
        write_png(&src.join("class").join(format!("{i:02}.png")), 1500, i);
    }
    let out = tmp.path().join("out");
    let mut child = Command::new(env!("CARGO_BIN_EXE_stagefs"))
        .args(["convert"])
        .arg(&src)
        .arg(&out)
        .args(["--to", "npy", "--image-size", "512", "-j", "1", "-q"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    // Wait until a temporary exists: the conversion is then mid-file.
    let start = Instant::now();
    loop {
        if !temporaries(&out).is_empty() {
            break;
        }
        if let Some(status) = child.try_wait().expect("wait") {
            panic!("convert ended ({status}) before a temporary was seen: make the input larger");
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no temporary appeared"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let pid = i32::try_from(child.id()).expect("pid");
    // SAFETY: kill with a valid signal on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("convert did not exit within 60 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let left = temporaries(&out);
    assert!(left.is_empty(), "temporaries left in OUT: {left:?}");
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}");
}
