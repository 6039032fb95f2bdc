//! `stagefs convert --to npy` against the views it is built from: random-offset reads of
//! `images.npy` from many threads (what the mount does) equal the converted file, and every
//! size the views announce up front is the size written.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use stagefs_views::{DirSource, View, ViewKind, ViewOptions, ViewSet};

type Res = Result<(), Box<dyn std::error::Error>>;

/// A deterministic RGB PNG of `w`×`h` with a pattern depending on `seed`.
fn write_png(path: &Path, w: u32, h: u32, seed: u32) -> Res {
    std::fs::create_dir_all(path.parent().ok_or("no parent")?)?;
    let file = std::fs::File::create(path)?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc.write_header()?;
    let mut data = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            data.push((x * 255 / w) as u8 ^ seed as u8);
            data.push((y * 255 / h) as u8);
            data.push(((x + y + seed * 7) % 256) as u8);
        }
    }
    writer.write_image_data(&data)?;
    Ok(())
}

fn dataset(dir: &Path) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let src = dir.join("src");
    for (i, class) in ["ant", "bee", "cow"].iter().enumerate() {
        for j in 0..6u32 {
            let (w, h) = (40 + 13 * j + i as u32 * 5, 90 - 7 * j);
            write_png(
                &src.join(class).join(format!("{j:02}.png")),
                w,
                h,
                j + 10 * i as u32,
            )?;
        }
    }
    std::fs::write(
        src.join("bee").join("zz_bad.png"),
        b"\x89PNG\r\n\x1a\nnot really",
    )?;
    Ok(src)
}

/// xorshift64*: deterministic offsets without a dependency on a particular rand API.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

#[test]
fn random_offset_reads_from_many_threads_equal_the_converted_file() {
    let tmp = tempfile::tempdir().unwrap();
    let src = dataset(tmp.path()).unwrap();
    let out = tmp.path().join("out");
    let status = Command::new(env!("CARGO_BIN_EXE_stagefs"))
        .args([
            "convert",
            src.to_str().unwrap(),
            out.to_str().unwrap(),
            "--to",
            "npy",
        ])
        .args(["--image-size", "40", "--allow-bad", "-q"])
        .status()
        .unwrap();
    assert!(status.success());
    let expected = Arc::new(std::fs::read(out.join("images.npy")).unwrap());

    let opts = ViewOptions {
        image_size: 40,
        ..ViewOptions::default()
    };
    let set = ViewSet::new(Arc::new(DirSource::new(&src)), opts).unwrap();
    assert_eq!(
        set.stat(Path::new("images.npy")).unwrap(),
        ViewKind::File(expected.len() as u64)
    );
    let view: Arc<dyn View> = set.open(Path::new("images.npy")).unwrap();
    assert_eq!(view.len(), expected.len() as u64);

    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let view = view.clone();
            let expected = expected.clone();
            std::thread::spawn(move || {
                let mut state = 0x9E37_79B9_7F4A_7C15 ^ (t + 1);
                for _ in 0..150 {
                    let off = next(&mut state) % (expected.len() as u64 + 100);
                    let len = (next(&mut state) % 20_000) as usize;
                    let mut buf = vec![0xAAu8; len];
                    let n = view.read_at(off, &mut buf).unwrap();
                    let start = (off as usize).min(expected.len());
                    let end = (start + len).min(expected.len());
                    assert_eq!(n, end - start, "length at offset {off}");
                    assert!(
                        buf[..n] == expected[start..end],
                        "bytes differ at offset {off} len {len}"
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn announced_sizes_equal_written_sizes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = dataset(tmp.path()).unwrap();
    let out = tmp.path().join("out");
    let p = Command::new(env!("CARGO_BIN_EXE_stagefs"))
        .args([
            "convert",
            src.to_str().unwrap(),
            out.to_str().unwrap(),
            "--to",
            "npy",
            "-q",
        ])
        .output()
        .unwrap();
    // One corrupt PNG and no --allow-bad: exit status 1, the file is named.
    assert_eq!(p.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&p.stderr).contains("zz_bad.png"));

    let set = ViewSet::new(Arc::new(DirSource::new(&src)), ViewOptions::default()).unwrap();
    let mut stack = vec![PathBuf::new()];
    let mut files = 0;
    while let Some(dir) = stack.pop() {
        for e in set.read_dir(&dir).unwrap() {
            let rel = dir.join(&e.name);
            match e.kind {
                ViewKind::Dir => stack.push(rel),
                ViewKind::File(len) => {
                    assert_eq!(
                        std::fs::metadata(out.join(&rel)).unwrap().len(),
                        len,
                        "{}",
                        rel.display()
                    );
                    files += 1;
                }
            }
        }
    }
    // Root and three class folders, four files each.
    assert_eq!(files, 16);
}
