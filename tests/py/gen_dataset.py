"""Generates the sample dataset of the tensor-view tests, deterministically, into a directory.

    python3 tests/py/gen_dataset.py DIR

Layout (all under DIR):
    tables/numbers.parquet      5 row groups x 1000 rows: int64, int32, int8, uint8, float32 with
                                NaN and nulls, float64, bool, int64 with nulls, a string column
    tables/nostats.parquet      same shape, written without statistics (null counts by scan)
    tables/data.csv             70 000 rows (two CSV blocks): int, float, bool, text, int with gaps
    broken/truncated.parquet    a Parquet file cut in half (must read as EIO / be listed as bad)
    images/train/<class>/...    ImageFolder with classes cat, dog, zebra; nested subdirectories;
                                baseline, progressive, grayscale and CMYK JPEGs; RGB, RGBA,
                                paletted, grayscale and 16-bit PNGs; cat/corrupt.jpg is corrupt
    images/flat/*.jpg           images directly in a folder (one class, label 0)
    notes/readme.txt            nothing viewable (must not appear under .npy/)

Other tests import `generate(dir)`; it returns a dict of the interesting paths;
`make_damaged(dir)` writes JPEGs and PNGs damaged in known ways (for the strictness tests) and
`png_bomb` / `jpeg_bomb` write small files that claim huge images (for the memory tests).
"""

import io
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

SEED = 1234


def photo(rng, w, h):
    """A smooth, photo-like RGB array (gradients, blobs, mild noise) of size h x w."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        a, b, f1, f2, p = rng.uniform(0.2, 1.0, 5)
        img[..., c] = 127 + 60 * np.sin(x / w * 6 * f1 + p * 6) * np.cos(y / h * 5 * f2 + c) + 40 * (a * x / w - b * y / h)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(5, max(6, min(w, h) / 3))
        col = rng.uniform(0, 255, 3)
        mask = ((x - cx) ** 2 + (y - cy) ** 2) < r * r
        img[mask] = 0.5 * img[mask] + 0.5 * col
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _save(img, path, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    img.save(path, **kw)


def make_tables(root, rng):
    n = 5000
    nan_f32 = rng.normal(size=n).astype(np.float32)
    nan_f32[::17] = np.nan
    mask_f32 = np.zeros(n, bool)
    mask_f32[5::23] = True
    int_nulls = rng.integers(-1000, 1000, n)
    mask_int = np.zeros(n, bool)
    mask_int[3::31] = True
    table = pa.table({
        "id": pa.array(np.arange(n, dtype=np.int64)),
        "i32": pa.array(rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int32)),
        "i8": pa.array(rng.integers(-128, 127, n, dtype=np.int8)),
        "u8": pa.array(rng.integers(0, 255, n, dtype=np.uint8)),
        "f32": pa.array(nan_f32, mask=mask_f32),
        "f64": pa.array(rng.normal(size=n) * 1e6),
        "flag": pa.array(rng.integers(0, 2, n).astype(bool)),
        "count": pa.array(int_nulls, mask=mask_int),
        "name": pa.array([f"row{i}" for i in range(n)]),
        "a/b": pa.array(np.ones(n, np.int16)),
    })
    os.makedirs(os.path.join(root, "tables"), exist_ok=True)
    pq.write_table(table, os.path.join(root, "tables", "numbers.parquet"), row_group_size=1000)
    pq.write_table(table, os.path.join(root, "tables", "nostats.parquet"), row_group_size=1500,
                   write_statistics=False, compression="zstd")

    m = 70_000
    ints = rng.integers(-10**9, 10**9, m)
    floats = rng.normal(size=m)
    bools = rng.integers(0, 2, m).astype(bool)
    gaps = rng.integers(0, 100, m)
    with open(os.path.join(root, "tables", "data.csv"), "w") as f:
        f.write("k,x,ok,label,gappy\n")
        for i in range(m):
            g = "" if i % 7 == 3 else str(gaps[i])
            f.write(f"{ints[i]},{float(floats[i])!r},{'true' if bools[i] else 'false'},t{i % 13},{g}\n")

    os.makedirs(os.path.join(root, "broken"), exist_ok=True)
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=1000)
    data = buf.getvalue()
    with open(os.path.join(root, "broken", "truncated.parquet"), "wb") as f:
        f.write(data[: len(data) // 2])


def make_images(root, rng):
    out = {}
    base = os.path.join(root, "images", "train")
    sizes = lambda: (int(rng.integers(40, 160)), int(rng.integers(40, 160)))  # noqa: E731
    # cat: baseline + progressive JPEGs, and a corrupt one.
    for i in range(4):
        w, h = sizes()
        _save(Image.fromarray(photo(rng, w, h)), f"{base}/cat/c{i}.jpg", quality=90)
    w, h = sizes()
    _save(Image.fromarray(photo(rng, w, h)), f"{base}/cat/prog.jpg", quality=85, progressive=True)
    w, h = sizes()
    _save(Image.fromarray(photo(rng, w, h)).convert("L"), f"{base}/cat/gray.jpg", quality=90)
    w, h = sizes()
    _save(Image.fromarray(photo(rng, w, h)).convert("CMYK"), f"{base}/cat/cmyk.jpg", quality=95)
    good = io.BytesIO()
    Image.fromarray(photo(rng, 64, 48)).save(good, format="JPEG")
    bad = bytearray(good.getvalue())
    bad[20:400] = rng.integers(0, 256, 380, dtype=np.uint8).tobytes()
    with open(f"{base}/cat/corrupt.jpg", "wb") as f:
        f.write(bytes(bad))
    out["corrupt_jpeg"] = f"{base}/cat/corrupt.jpg"
    # dog: PNG flavours, nested directories with names that sort differently by path and by walk.
    w, h = sizes()
    _save(Image.fromarray(photo(rng, w, h)), f"{base}/dog/rgb.png")
    rgba = np.dstack([photo(rng, 90, 70), rng.integers(0, 256, (70, 90), dtype=np.uint8)])
    _save(Image.fromarray(rgba, "RGBA"), f"{base}/dog/alpha.png")
    w, h = sizes()
    _save(Image.fromarray(photo(rng, w, h)).convert("P", palette=Image.ADAPTIVE, colors=64), f"{base}/dog/a/pal.png")
    w, h = sizes()
    _save(Image.fromarray(photo(rng, w, h)).convert("L"), f"{base}/dog/a-b/gray.png")
    w, h = sizes()
    _save(Image.fromarray(photo(rng, w, h)), f"{base}/dog/a/b/deep.JPG", quality=90)
    rgb16 = (photo(rng, 80, 60).astype(np.uint16) * 257).byteswap()
    # Pillow cannot write 16-bit RGB PNGs; write the bytes with zlib directly.
    _write_png16(f"{base}/dog/rgb16.png", rgb16)
    out["png16"] = f"{base}/dog/rgb16.png"
    # zebra: plain JPEGs (and a text file that is ignored).
    for i in range(3):
        w, h = sizes()
        _save(Image.fromarray(photo(rng, w, h)), f"{base}/zebra/z{i}.jpeg", quality=75)
    with open(f"{base}/zebra/notes.txt", "w") as f:
        f.write("not an image\n")
    # A flat folder: images directly inside, one class.
    for i in range(3):
        w, h = sizes()
        _save(Image.fromarray(photo(rng, w, h)), f"{root}/images/flat/f{i}.jpg", quality=92)
    os.makedirs(f"{root}/notes", exist_ok=True)
    with open(f"{root}/notes/readme.txt", "w") as f:
        f.write("nothing viewable here\n")
    return out


def _write_png16(path, big_endian_rgb16):
    import struct
    import zlib

    h, w, _ = big_endian_rgb16.shape
    raw = b"".join(b"\x00" + big_endian_rgb16[r].tobytes() for r in range(h))

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(png)


def _encode(arr, fmt, **kw):
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _flip(data, frac, start, n=3, xor=0x55):
    """`data` with `n` bytes flipped at fraction `frac` of the way from `start` to the end."""
    d = bytearray(data)
    p = start + 20 + int((len(d) - start - 40) * frac)
    for k in range(n):
        d[p + k] ^= xor
    return bytes(d)


def _png_chunk_offset(data, kind):
    i = data.index(kind)
    return i - 4, int.from_bytes(data[i - 4:i], "big")


# Damage that Pillow accepts but stagefs flags on purpose (docs/views.md#damaged-inputs): corrupt JPEG
# entropy data (Pillow returns grey or garbled blocks without an error) and a bad IDAT CRC
# (Pillow does not check it).
STRICTER_THAN_PILLOW = {"jpeg-entropy-flip", "jpeg-eoi-mid", "png-idat-crc"}


def make_damaged(root):
    """Writes damaged (and a few intact) images into `root`; returns {file name: category}."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(99)
    out = {}

    def put(name, category, data):
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
        out[name] = category

    flavours = {"base": dict(quality=90), "prog": dict(quality=90, progressive=True),
                "444": dict(quality=90, subsampling=0)}
    for tag, kw in flavours.items():
        d = _encode(photo(rng, 200, 150), "JPEG", **kw)
        sos = d.index(b"\xff\xda")
        put(f"{tag}-ok.jpg", "intact", d)
        for frac in (0.1, 0.5, 0.9, 0.995):
            put(f"{tag}-cut{int(frac * 1000):03d}.jpg", "jpeg-truncated", d[: sos + int((len(d) - sos) * frac)])
        put(f"{tag}-noeoi.jpg", "jpeg-no-eoi", d[:-2])
        for frac in (0.2, 0.5, 0.8):
            put(f"{tag}-flip{int(frac * 100):02d}.jpg", "jpeg-entropy-flip", _flip(d, frac, sos))
        mid = bytearray(d)
        p = sos + (len(d) - sos) // 2
        mid[p:p + 2] = b"\xff\xd9"
        put(f"{tag}-eoimid.jpg", "jpeg-eoi-mid", bytes(mid))
        put(f"{tag}-trailing.jpg", "jpeg-trailing-data", d + b"\0junk after EOI" * 10)
        put(f"{tag}-padded.jpg", "jpeg-extraneous-before-eoi", d[:-2] + b"\x00" * 16 + b"\xff\xd9")
    hdr = bytearray(_encode(photo(rng, 64, 48), "JPEG"))
    hdr[20:400] = rng.integers(0, 256, 380, dtype=np.uint8).tobytes()
    put("header-garbage.jpg", "jpeg-header-garbage", bytes(hdr))
    for mode, tag in (("RGB", "rgb"), ("L", "gray")):
        arr = photo(rng, 180, 120)
        d = _encode(arr if mode == "RGB" else np.asarray(Image.fromarray(arr).convert("L")), "PNG")
        put(f"png-{tag}-ok.png", "intact", d)
        i, n = _png_chunk_offset(d, b"IDAT")
        put(f"png-{tag}-cut.png", "png-truncated", d[: i + 8 + n // 2])
        bad = bytearray(d)
        bad[i + 8 + n] ^= 1
        put(f"png-{tag}-idatcrc.png", "png-idat-crc", bytes(bad))
        bad = bytearray(d)
        bad[8 + 8 + 13] ^= 1
        put(f"png-{tag}-ihdrcrc.png", "png-ihdr-crc", bytes(bad))
        bad = bytearray(d)
        bad[i + 8 + n // 2] ^= 0x55
        put(f"png-{tag}-flip.png", "png-idat-flip", bytes(bad))
        put(f"png-{tag}-noiend.png", "png-no-iend", d[:-12])
    return out


def png_bomb(path, w, h):
    """An RGB PNG of w x h black pixels, compressed row by row (a few hundred KB per 100 Mpx)."""
    import struct
    import zlib

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

    comp = zlib.compressobj(9)
    row = b"\x00" * (1 + 3 * w)
    parts = [comp.compress(row) for _ in range(h)]
    parts.append(comp.flush())
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b""))


def jpeg_bomb(path, w, h):
    """A JPEG header claiming w x h (baseline, 4:2:0) with no entropy data: a few hundred bytes."""
    d = bytearray(_encode(np.zeros((16, 16, 3), np.uint8), "JPEG", quality=50))
    sof = d.index(b"\xff\xc0")
    d[sof + 5:sof + 7] = h.to_bytes(2, "big")
    d[sof + 7:sof + 9] = w.to_bytes(2, "big")
    sos = d.index(b"\xff\xda")
    length = int.from_bytes(d[sos + 2:sos + 4], "big")
    with open(path, "wb") as f:
        f.write(bytes(d[: sos + 2 + length]) + b"\xff\xd9")


def generate(root):
    """Writes the dataset under `root`; returns a dict of notable paths."""
    rng = np.random.default_rng(SEED)
    make_tables(root, rng)
    out = make_images(root, rng)
    out["truncated_parquet"] = os.path.join(root, "broken", "truncated.parquet")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(generate(sys.argv[1]))
