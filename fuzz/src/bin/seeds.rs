//! Writes the seed corpora (`corpus/<target>/`): small valid inputs of every kind the targets
//! parse, for libFuzzer to mutate. Generated, never committed (the project keeps no test data).
//!
//! Usage: `seeds DIR` (fuzz/run.sh calls it with fuzz/corpus).

// Linked for the coverage callbacks the instrumented build calls (this binary has its own main).
extern crate libfuzzer_sys;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{ArrayRef, BooleanArray, Float32Array, Float64Array, Int32Array, Int64Array};
use arrow::array::{RecordBatch, StringArray, UInt8Array};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use stagefs_npy::{DType, NpyHeader};

fn put(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), bytes)
}

fn npy(dir: &Path) -> std::io::Result<()> {
    let shapes: [&[u64]; 5] = [&[], &[0], &[7], &[3, 224, 224, 3], &[1 << 40, 2]];
    for (i, shape) in shapes.iter().enumerate() {
        for (j, dtype) in [DType::Bool, DType::U8, DType::I64, DType::F16, DType::F64]
            .into_iter()
            .enumerate()
        {
            let h = NpyHeader::new(dtype, shape.to_vec());
            put(dir, &format!("h{i}_{j}.npy"), &h.encode())?;
        }
    }
    // Version 2.0 (4-byte header length), as NumPy writes for long headers.
    let dict = b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
    let mut v2 = b"\x93NUMPY\x02\x00".to_vec();
    v2.extend_from_slice(&(dict.len() as u32 + 1).to_le_bytes());
    v2.extend_from_slice(dict);
    v2.push(b'\n');
    put(dir, "v2.npy", &v2)
}

/// A small gradient image of `w`×`h` with `channels` channels (1, 2, 3 or 4).
fn pixels(w: u32, h: u32, channels: u32, depth16: bool) -> Vec<u8> {
    let per = if depth16 { 2 } else { 1 };
    let mut v = Vec::new();
    for y in 0..h {
        for x in 0..w {
            for c in 0..channels {
                let val = ((x * 37 + y * 11 + c * 70) % 256) as u8;
                v.extend(std::iter::repeat_n(val, per));
            }
        }
    }
    v
}

fn png_file(w: u32, h: u32, color: png::ColorType, depth: png::BitDepth) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, w, h);
        enc.set_color(color);
        enc.set_depth(depth);
        let channels = match color {
            png::ColorType::Grayscale | png::ColorType::Indexed => 1,
            png::ColorType::GrayscaleAlpha => 2,
            png::ColorType::Rgb => 3,
            png::ColorType::Rgba => 4,
        };
        if color == png::ColorType::Indexed {
            enc.set_palette(
                (0..=255u8)
                    .flat_map(|i| [i, 255 - i, i / 2])
                    .collect::<Vec<_>>(),
            );
        }
        let data = match depth {
            png::BitDepth::Sixteen => pixels(w, h, channels, true),
            png::BitDepth::Eight => pixels(w, h, channels, false),
            // Sub-byte depths: rows padded to whole bytes.
            d => {
                let bits = d as u32;
                let row = (w * bits).div_ceil(8) as usize;
                (0..row * h as usize)
                    .map(|i| (i * 73 % 256) as u8)
                    .collect()
            }
        };
        let Ok(mut writer) = enc.write_header() else {
            return out;
        };
        let _ = writer.write_image_data(&data);
    }
    out
}

fn images(dir: &Path) -> std::io::Result<()> {
    use png::{BitDepth as B, ColorType as C};
    let kinds = [
        (C::Rgb, B::Eight),
        (C::Rgba, B::Eight),
        (C::Grayscale, B::Eight),
        (C::Grayscale, B::One),
        (C::GrayscaleAlpha, B::Eight),
        (C::Indexed, B::Eight),
        (C::Indexed, B::Four),
        (C::Rgb, B::Sixteen),
    ];
    for (i, (color, depth)) in kinds.into_iter().enumerate() {
        for (w, h) in [(5, 3), (17, 9), (1, 20)] {
            put(
                dir,
                &format!("p{i}_{w}x{h}.png"),
                &png_file(w, h, color, depth),
            )?;
        }
    }
    for (i, (w, h)) in [(8u16, 8u16), (19, 7), (3, 33)].into_iter().enumerate() {
        for (k, progressive) in [false, true].into_iter().enumerate() {
            for (q, (ct, channels)) in [
                (jpeg_encoder::ColorType::Rgb, 3u32),
                (jpeg_encoder::ColorType::Luma, 1),
                (jpeg_encoder::ColorType::Cmyk, 4),
            ]
            .into_iter()
            .enumerate()
            {
                let mut out = Vec::new();
                let mut enc = jpeg_encoder::Encoder::new(&mut out, 60);
                enc.set_progressive(progressive);
                let data = pixels(u32::from(w), u32::from(h), channels, false);
                if enc.encode(&data, w, h, ct).is_ok() {
                    put(dir, &format!("j{i}_{k}_{q}.jpg"), &out)?;
                }
            }
        }
    }
    Ok(())
}

fn batch(rows: usize) -> RecordBatch {
    let r = rows as i64;
    let cols: Vec<(&str, ArrayRef)> = vec![
        (
            "i32",
            Arc::new(Int32Array::from_iter((0..r).map(|i| Some(i as i32 - 2)))),
        ),
        (
            "i64_nulls",
            Arc::new(Int64Array::from_iter(
                (0..r).map(|i| (i % 3 != 0).then_some(i * 1000)),
            )),
        ),
        (
            "f32",
            Arc::new(Float32Array::from_iter_values(
                (0..r).map(|i| i as f32 / 3.0),
            )),
        ),
        (
            "f64",
            Arc::new(Float64Array::from_iter(
                (0..r).map(|i| (i % 4 != 1).then_some(i as f64)),
            )),
        ),
        (
            "flag",
            Arc::new(BooleanArray::from_iter((0..r).map(|i| Some(i % 2 == 0)))),
        ),
        (
            "u8",
            Arc::new(UInt8Array::from_iter_values((0..r).map(|i| i as u8))),
        ),
        (
            "name",
            Arc::new(StringArray::from_iter_values(
                (0..r).map(|i| format!("n{i}")),
            )),
        ),
    ];
    RecordBatch::try_from_iter(cols).expect("valid batch")
}

fn parquet_file(rows: usize, group: usize, codec: Compression, dict: bool) -> Vec<u8> {
    let props = WriterProperties::builder()
        .set_compression(codec)
        .set_max_row_group_row_count(Some(group))
        .set_dictionary_enabled(dict)
        .build();
    let b = batch(rows);
    let mut out = Vec::new();
    let mut w = ArrowWriter::try_new(&mut out, b.schema(), Some(props)).expect("writer");
    w.write(&b).expect("write");
    w.close().expect("close");
    out
}

fn tables(pq: &Path, csv: &Path, clean: &Path) -> std::io::Result<()> {
    let zstd = Compression::ZSTD(ZstdLevel::default());
    for (i, (rows, group, codec, dict)) in [
        (3, 1024, Compression::UNCOMPRESSED, false),
        (10, 4, Compression::SNAPPY, true),
        (7, 2, zstd, false),
        (0, 1024, Compression::UNCOMPRESSED, false),
    ]
    .into_iter()
    .enumerate()
    {
        put(
            pq,
            &format!("t{i}.parquet"),
            &parquet_file(rows, group, codec, dict),
        )?;
    }
    let texts: [&[u8]; 7] = [
        b"a,b,c\n1,2.5,x\n3,,y\n-4,1e3,z\n",
        b"flag,n\ntrue,1\nfalse,2\n,3\n",
        b"id,text\n1,\"quoted, with comma\"\n2,\"multi\nline\"\n3,\"esc \"\"q\"\"\"\n",
        b"x\r\n1\r\n2\r\n",
        b"a,b\n1,2\n3\n4,5,6\n",
        b"only_header\n",
        b"f,g\nnan,inf\n-0.0,1.5\n9223372036854775807,-9223372036854775808\n",
    ];
    for (i, t) in texts.iter().enumerate() {
        put(csv, &format!("c{i}.csv"), t)?;
        put(clean, &format!("c{i}.csv"), t)?;
    }
    Ok(())
}

/// Cache logs written by the real store: a few entries (small, multi-block, own-file), blocks,
/// a drop, a rebind; and a torn one.
fn cache_index(out: &Path) -> std::io::Result<()> {
    use stagefs_prefetch::{CacheStore, KeyKind, Stats, StoreConfig, Version};
    std::fs::create_dir_all(out)?;
    let tmp = std::env::temp_dir().join(format!("stagefs-seed-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let cfg = StoreConfig {
        dir: tmp.clone(),
        capacity: 64 << 20,
        direct_reads: false,
    };
    let (store, _) = CacheStore::open(&cfg, std::sync::Arc::new(Stats::default()))
        .map_err(std::io::Error::other)?;
    let v = |size| Version {
        size,
        mtime_ns: 1,
        ctime_ns: 1,
        ino: 2,
    };
    let a = store.create(KeyKind::Raw, b"train/n0/a.jpg", v(3000), 1, false, 5);
    store.insert(a, 0, &[7u8; 3000]);
    let b = store.create(KeyKind::Raw, b"big.bin", v(3 << 20), 3, true, 6);
    store.insert(b, 1, &vec![9u8; 1 << 20]);
    let c = store.create(KeyKind::View, b"train/images.npy", v(400_000), 3, false, 0);
    store.insert(c, 0, &[1u8; 128]);
    store.forget(a);
    store.bind(b, 9);
    store.flush()?;
    let log = std::fs::read(tmp.join("v2/cache.log"))?;
    put(out, "cache.log", &log)?;
    put(out, "torn.log", &log[..log.len().saturating_sub(7)])?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}

/// The Parquet seeds, and dictionary bombs (honest and lying) for the page-bound target.
fn parquet_pages(tables: &std::path::Path, out: &std::path::Path) -> std::io::Result<()> {
    use stagefs_parquet_bounds::testing::{dictionary_bomb, Values};
    std::fs::create_dir_all(out)?;
    for entry in std::fs::read_dir(tables)? {
        let entry = entry?;
        std::fs::copy(entry.path(), out.join(entry.file_name()))?;
    }
    put(
        out,
        "honest.parquet",
        &dictionary_bomb(2, Values::Int64, 16, None),
    )?;
    put(
        out,
        "honest_binary.parquet",
        &dictionary_bomb(2, Values::Binary, 10, None),
    )?;
    put(
        out,
        "dict_bomb.parquet",
        &dictionary_bomb(3, Values::Int64, (2 << 30) - 1, None),
    )?;
    put(
        out,
        "binary_bomb.parquet",
        &dictionary_bomb(2, Values::Binary, 200 << 20, None),
    )?;
    put(
        out,
        "page_bomb.parquet",
        &dictionary_bomb(1, Values::Int64, 16, Some(1 << 30)),
    )?;
    Ok(())
}

/// Control-socket request lines: every kind, bad paths, a deep array, an over-long line.
fn protocol_request(out: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(out)?;
    let lines: [(&str, Vec<u8>); 9] = [
        ("hint", br#"{"path":"a/b.npy","ranges":[[0,4096],[8192,10]]}"#.to_vec()),
        ("scope", br#"{"op":"hint","path":"x","scope":3,"ranges":[[0,1]]}"#.to_vec()),
        ("open", br#"{"op":"direct_open","path":"d/e f.bin"}"#.to_vec()),
        ("close", br#"{"op":"direct_close","pin":17}"#.to_vec()),
        ("table", br#"{"op":"direct_table"}"#.to_vec()),
        ("stats", br#"{"op":"stats_now"}"#.to_vec()),
        ("dotdot", br#"{"op":"direct_open","path":"a/../../etc/passwd"}"#.to_vec()),
        ("deep", format!("{}{}", "[".repeat(200), "]".repeat(200)).into_bytes()),
        ("long", vec![b' '; 65 << 10]),
    ];
    for (name, line) in lines {
        put(out, &format!("{name}.json"), &line)?;
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let root = PathBuf::from(
        std::env::args_os()
            .nth(1)
            .unwrap_or_else(|| "corpus".into()),
    );
    npy(&root.join("npy_header"))?;
    images(&root.join("image_render"))?;
    tables(
        &root.join("table_parquet"),
        &root.join("table_csv"),
        &root.join("clean_csv"),
    )?;
    cache_index(&root.join("cache_index"))?;
    parquet_pages(&root.join("table_parquet"), &root.join("parquet_pages"))?;
    protocol_request(&root.join("protocol_request"))?;
    println!("seed corpora written under {}", root.display());
    Ok(())
}
