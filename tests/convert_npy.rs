//! `stagefs convert --to npy` against the views it is built from: random-offset reads of
//! `images.npy` from many threads (what the mount does) equal the converted file, a random
//! slot read by its render unit decodes that one image and equals the converted slot, every
//! size the views announce up front is the size written, and bad directories are skipped and
//! listed instead of failing the whole tree.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use stagefs_views::{ByteSource, DirSource, SourceEntry, View, ViewKind, ViewOptions, ViewSet};

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
            "--all-levels",
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

/// A [`ByteSource`] over a directory that counts file reads per path and can refuse to list
/// chosen directories (as an unreadable directory of another user does).
struct Probe {
    inner: DirSource,
    reads: Mutex<HashMap<PathBuf, usize>>,
    refuse: Vec<PathBuf>,
}

impl ByteSource for Probe {
    fn len(&self, rel: &Path) -> io::Result<u64> {
        self.inner.len(rel)
    }
    fn read_at(&self, rel: &Path, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        if self.refuse.iter().any(|r| r == rel) {
            return Err(io::Error::from_raw_os_error(13)); // EACCES
        }
        if offset == 0 {
            if let Ok(mut reads) = self.reads.lock() {
                *reads.entry(rel.to_path_buf()).or_default() += 1;
            }
        }
        self.inner.read_at(rel, offset, buf)
    }
    fn list_dir(&self, rel: &Path) -> io::Result<Vec<SourceEntry>> {
        if self.refuse.iter().any(|r| r == rel) {
            return Err(io::Error::from_raw_os_error(13)); // EACCES
        }
        self.inner.list_dir(rel)
    }
}

fn probe(src: &Path, refuse: &[&str]) -> Arc<Probe> {
    Arc::new(Probe {
        inner: DirSource::new(src),
        reads: Mutex::default(),
        refuse: refuse.iter().map(PathBuf::from).collect(),
    })
}

#[test]
fn a_random_slot_read_by_render_unit_decodes_one_image_and_equals_convert() {
    let tmp = tempfile::tempdir().unwrap();
    let src = dataset(tmp.path()).unwrap();
    let out = tmp.path().join("out");
    let status = Command::new(env!("CARGO_BIN_EXE_stagefs"))
        .args(["convert", src.to_str().unwrap(), out.to_str().unwrap()])
        .args(["--to", "npy", "--image-size", "24", "--allow-bad", "-q"])
        .status()
        .unwrap();
    assert!(status.success());
    let expected = std::fs::read(out.join("images.npy")).unwrap();
    let opts = ViewOptions {
        image_size: 24,
        ..ViewOptions::default()
    };
    let slot = 24 * 24 * 3;
    let mut state = 0x1234_5678_9abc_def0u64;
    for _ in 0..12 {
        // A fresh view each time: nothing cached from an earlier read.
        let src_probe = probe(&src, &[]);
        let set = ViewSet::new(src_probe.clone(), opts.clone()).unwrap();
        let view = set.open(Path::new("images.npy")).unwrap();
        let header = view.render_unit(0);
        assert_eq!(header.start, 0);
        assert_eq!(view.render_unit(header.end - 1), header);
        let n = (view.len() - header.end) / slot;
        let i = next(&mut state) % n;
        let inside = header.end + i * slot + next(&mut state) % slot;
        let unit = view.render_unit(inside);
        assert_eq!(unit, header.end + i * slot..header.end + (i + 1) * slot);
        let mut buf = vec![0u8; slot as usize];
        assert_eq!(view.read_at(unit.start, &mut buf).unwrap(), buf.len());
        assert!(
            buf[..] == expected[unit.start as usize..unit.end as usize],
            "slot {i}"
        );
        let reads = src_probe.reads.lock().unwrap();
        assert_eq!(reads.len(), 1, "slot {i} read {reads:?}");
    }
    // Past the end: an empty unit.
    let set = ViewSet::new(Arc::new(DirSource::new(&src)), opts).unwrap();
    let view = set.open(Path::new("images.npy")).unwrap();
    assert!(view.render_unit(view.len()).is_empty());
}

#[test]
fn unreadable_directory_is_skipped_and_reported_not_fatal_for_the_tree() {
    let tmp = tempfile::tempdir().unwrap();
    let src = dataset(tmp.path()).unwrap();
    let bad: Arc<Mutex<Vec<PathBuf>>> = Arc::default();
    let sink = bad.clone();
    let opts = ViewOptions {
        image_size: 16,
        on_bad: Some(Arc::new(move |p: &Path, _: &str| {
            sink.lock().unwrap().push(p.to_path_buf())
        })),
        ..ViewOptions::default()
    };
    let set = ViewSet::new(probe(&src, &["bee"]), opts).unwrap();
    // The other classes are still there; the unreadable one is reported.
    let names: Vec<OsString> = set
        .read_dir(Path::new(""))
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(names.contains(&OsString::from("ant")) && names.contains(&OsString::from("cow")));
    assert!(!names.contains(&OsString::from("bee")));
    assert_eq!(*bad.lock().unwrap(), vec![PathBuf::from("bee")]);
    assert_eq!(
        set.stat(Path::new("images.npy")).unwrap(),
        ViewKind::File(stagefs_views::image::images_len(12, 16))
    );
}

#[test]
fn view_paths_know_the_source_path_they_derive_from() {
    let tmp = tempfile::tempdir().unwrap();
    let src = dataset(tmp.path()).unwrap();
    std::fs::write(src.join("ant").join("t.csv"), "a,b\n1,2\n").unwrap();
    let set = ViewSet::new(Arc::new(DirSource::new(&src)), ViewOptions::default()).unwrap();
    let of = |p: &str| set.source_of(Path::new(p));
    assert_eq!(of("images.npy"), Some(PathBuf::new()));
    assert_eq!(of("ant/labels.npy"), Some(PathBuf::from("ant")));
    assert_eq!(of("ant"), Some(PathBuf::from("ant")));
    assert_eq!(of("ant/t.csv"), Some(PathBuf::from("ant/t.csv")));
    assert_eq!(of("ant/t.csv/a.npy"), Some(PathBuf::from("ant/t.csv")));
    assert_eq!(of("nope"), None);
}

#[test]
fn unreadable_image_file_is_a_reported_zero_slot_not_a_failed_read() {
    let tmp = tempfile::tempdir().unwrap();
    let src = dataset(tmp.path()).unwrap();
    let bad: Arc<Mutex<Vec<PathBuf>>> = Arc::default();
    let sink = bad.clone();
    let opts = ViewOptions {
        image_size: 16,
        on_bad: Some(Arc::new(move |p: &Path, _: &str| {
            sink.lock().unwrap().push(p.to_path_buf())
        })),
        ..ViewOptions::default()
    };
    let set = ViewSet::new(probe(&src, &["cow/02.png"]), opts).unwrap();
    let view = set.open(Path::new("cow/images.npy")).unwrap();
    let mut all = vec![0u8; view.len() as usize];
    assert_eq!(view.read_at(0, &mut all).unwrap(), all.len());
    let unit = view.render_unit(view.len() - 1);
    let slot = (unit.end - unit.start) as usize;
    let header = view.render_unit(0).end as usize;
    let slots: Vec<&[u8]> = all[header..].chunks(slot).collect();
    assert!(slots[2].iter().all(|&b| b == 0));
    assert!(slots[1].iter().any(|&b| b != 0) && slots[3].iter().any(|&b| b != 0));
    assert_eq!(*bad.lock().unwrap(), vec![PathBuf::from("cow/02.png")]);
}
