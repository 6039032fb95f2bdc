"""Tensor views (`stagefs convert --to npy`): every file opens with numpy's mmap, tables equal
what pyarrow reads, image folders follow torchvision's ImageFolder and match Pillow's
resize + center crop within a stated tolerance, bad inputs behave as the contract says.

The dataset comes from gen_dataset.py (deterministic). The mount serves the same bytes
(ViewSet::open is shared); mount-vs-convert `cmp` tests live with the mount.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
import gen_dataset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("STAGEFS_BIN", os.path.join(ROOT, "target", "debug", "stagefs"))
IMG_EXT = (".jpg", ".jpeg", ".png")

# Pixel tolerance vs Pillow (decode, convert("RGB"), resize(BILINEAR) to the torchvision size,
# center crop), measured on the generated images: PNGs match to 1 level (the resampling
# reproduces Pillow's fixed-point filter); JPEGs differ by at most 4 levels, mean < 0.5, from
# the IDCT/upsampling of zune-jpeg vs Pillow's libjpeg-turbo. The bounds leave a small margin.
MAX_ABS_DIFF_PNG = 1
MAX_ABS_DIFF_JPEG = 6
MEAN_ABS_DIFF = 0.75


def run(*args, check=True):
    p = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"stagefs {args} exited {p.returncode}\nstdout:{p.stdout}\nstderr:{p.stderr}")
    return p


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    info = gen_dataset.generate(str(src))
    out = tmp_path_factory.mktemp("out")
    proc = run("convert", src, out, "--to", "npy", "--allow-bad", "-q")
    return src, out, info, proc


def npy_files(out):
    for dirpath, _, files in os.walk(out):
        for f in files:
            if f.endswith(".npy"):
                yield os.path.join(dirpath, f)


def test_every_view_opens_with_mmap_and_has_exact_size(dataset):
    _, out, _, _ = dataset
    files = list(npy_files(out))
    assert len(files) > 10
    for f in files:
        arr = np.load(f, mmap_mode="r")
        with open(f, "rb") as fh:
            head = fh.read(10)
        header_len = 10 + int.from_bytes(head[8:10], "little")
        assert header_len % 64 == 0, f
        assert head[6:8] == b"\x01\x00", f  # format 1.0
        assert os.path.getsize(f) == header_len + arr.nbytes, f
        assert arr.flags.c_contiguous


def test_tree_mirrors_viewable_directories_only(dataset):
    _, out, _, _ = dataset
    assert sorted(os.listdir(out)) == sorted(
        ["broken", "images", "tables", "images.npy", "labels.npy", "classes.txt", "files.txt"])
    assert not os.path.exists(out / "notes")
    assert os.listdir(out / "broken") == []  # the truncated table is listed as bad, not written
    assert sorted(os.listdir(out / "tables")) == ["data.csv", "nostats.parquet", "numbers.parquet"]
    assert not any(f.startswith(".") for _, _, fs in os.walk(out) for f in fs), "temporary files left"


@pytest.mark.parametrize("name", ["numbers.parquet", "nostats.parquet"])
def test_parquet_columns_equal_pyarrow(dataset, name):
    src, out, _, _ = dataset
    table = pq.read_table(src / "tables" / name)
    d = out / "tables" / name
    schema = json.loads((d / "schema.json").read_text())
    assert schema["rows"] == table.num_rows
    by_name = {c["name"]: c for c in schema["columns"]}
    assert "skipped" in by_name["name"] and "file" not in by_name["name"]
    assert by_name["a/b"]["file"] == "a_b.npy"
    expected_dtype = {"id": "int64", "i32": "int32", "i8": "int8", "u8": "uint8", "f32": "float32",
                      "f64": "float64", "flag": "bool", "count": "float64", "a/b": "int16"}
    feats = []
    for col, dtype in expected_dtype.items():
        arr = np.load(d / by_name[col]["file"], mmap_mode="r")
        assert str(arr.dtype) == dtype, col
        ref = table.column(col).to_numpy()
        if dtype.startswith("float"):
            ref = np.asarray(ref, dtype=dtype)
            np.testing.assert_array_equal(np.isnan(arr), np.isnan(ref), err_msg=col)
        np.testing.assert_array_equal(arr, ref, err_msg=col)
        feats.append(np.asarray(ref, dtype=np.float32))
    features = np.load(d / "features.npy", mmap_mode="r")
    assert features.dtype == np.float32 and features.shape == (table.num_rows, len(feats))
    assert schema["features"]["columns"] == list(expected_dtype)
    np.testing.assert_array_equal(features, np.stack(feats, axis=1))


def test_csv_columns_equal_pyarrow(dataset):
    src, out, _, _ = dataset
    table = pacsv.read_csv(src / "tables" / "data.csv")
    d = out / "tables" / "data.csv"
    schema = json.loads((d / "schema.json").read_text())
    assert schema["rows"] == table.num_rows == 70_000
    expected = {"k": "int64", "x": "float64", "ok": "bool", "gappy": "float64"}
    for col, dtype in expected.items():
        arr = np.load(d / f"{col}.npy", mmap_mode="r")
        assert str(arr.dtype) == dtype
        ref = np.asarray(table.column(col).to_numpy(zero_copy_only=False), dtype=dtype)
        np.testing.assert_array_equal(arr, ref, err_msg=col)
    assert not (d / "label.npy").exists()
    features = np.load(d / "features.npy")
    assert features.shape == (70_000, 4)
    np.testing.assert_array_equal(features[:, 3], np.load(d / "gappy.npy").astype(np.float32))


def image_folder(d):
    """torchvision.datasets.ImageFolder's classes and samples (make_dataset), for JPEG/PNG."""
    def has_images(p):
        return any(f.lower().endswith(IMG_EXT) for _, _, fs in os.walk(p) for f in fs)
    classes = sorted(e.name for e in os.scandir(d) if e.is_dir() and has_images(e.path))
    samples = []
    if not classes:
        files = sorted(f for f in os.listdir(d) if f.lower().endswith(IMG_EXT) and os.path.isfile(os.path.join(d, f)))
        return [os.path.basename(d)], [(f, 0) for f in files]
    for label, c in enumerate(classes):
        for root, _, fnames in sorted(os.walk(os.path.join(d, c))):
            for f in sorted(fnames):
                if f.lower().endswith(IMG_EXT):
                    samples.append((os.path.relpath(os.path.join(root, f), d), label))
    return classes, samples


def pillow_reference(path, size):
    img = Image.open(path).convert("RGB")
    w, h = img.size
    if w <= h:
        nw, nh = size, int(size * h / w)
    else:
        nw, nh = int(size * w / h), size
    img = img.resize((nw, nh), Image.BILINEAR)
    left, top = int(round((nw - size) / 2.0)), int(round((nh - size) / 2.0))
    return np.asarray(img.crop((left, top, left + size, top + size)))


@pytest.mark.parametrize("folder", ["images/train", "images/train/dog", "images/flat", "."])
def test_image_folder_order_labels_and_shape(dataset, folder):
    src, out, _, _ = dataset
    classes, samples = image_folder(str(src / folder))
    d = out / folder
    assert (d / "classes.txt").read_text().splitlines() == classes
    assert (d / "files.txt").read_text().splitlines() == [p for p, _ in samples]
    labels = np.load(d / "labels.npy", mmap_mode="r")
    assert labels.dtype == np.int64
    assert labels.tolist() == [label for _, label in samples]
    images = np.load(d / "images.npy", mmap_mode="r")
    assert images.dtype == np.uint8 and images.shape == (len(samples), 224, 224, 3)


def test_pixels_match_pillow_within_tolerance(dataset):
    src, out, info, _ = dataset
    d = out / "images" / "train"
    images = np.load(d / "images.npy", mmap_mode="r")
    files = (d / "files.txt").read_text().splitlines()
    worst = []
    for i, rel in enumerate(files):
        path = src / "images" / "train" / rel
        if str(path) == info["corrupt_jpeg"]:
            continue
        ref = pillow_reference(path, 224).astype(int)
        diff = np.abs(images[i].astype(int) - ref)
        worst.append((diff.max(), diff.mean(), rel))
        bound = MAX_ABS_DIFF_PNG if rel.lower().endswith(".png") else MAX_ABS_DIFF_JPEG
        assert diff.max() <= bound and diff.mean() <= MEAN_ABS_DIFF, (rel, diff.max(), diff.mean())
    print("max/mean abs diff vs Pillow:", sorted(worst, reverse=True)[:5])
    assert len(worst) >= 15


def test_corrupt_jpeg_reads_as_zeros_and_is_listed(dataset):
    src, out, info, proc = dataset
    with pytest.raises(OSError):
        Image.open(info["corrupt_jpeg"]).load()
    d = out / "images" / "train"
    files = (d / "files.txt").read_text().splitlines()
    i = files.index("cat/corrupt.jpg")
    images = np.load(d / "images.npy", mmap_mode="r")
    assert not images[i].any()
    assert images[i - 1].any() and images[i + 1].any()
    assert "corrupt.jpg" in proc.stderr and "truncated.parquet" in proc.stderr


def test_bad_inputs_fail_the_run_without_allow_bad(dataset, tmp_path):
    src, _, _, _ = dataset
    p = run("convert", src, tmp_path / "o", "--to", "npy", "-q", "-j", "2", check=False)
    assert p.returncode == 1
    assert "corrupt.jpg" in p.stderr and "truncated.parquet" in p.stderr and "--allow-bad" in p.stderr


def test_clean_dataset_exits_zero_and_image_size_is_honoured(tmp_path):
    src = tmp_path / "src" / "pets" / "cat"
    src.mkdir(parents=True)
    rng = np.random.default_rng(7)
    Image.fromarray(gen_dataset.photo(rng, 120, 90)).save(src / "a.jpg")
    Image.fromarray(gen_dataset.photo(rng, 50, 70)).save(src / "b.png")
    run("convert", tmp_path / "src", tmp_path / "out", "--to", "npy", "--image-size", "32", "-q")
    images = np.load(tmp_path / "out" / "pets" / "images.npy", mmap_mode="r")
    assert images.shape == (2, 32, 32, 3)
    ref = pillow_reference(src / "b.png", 32)
    assert np.abs(images[1].astype(int) - ref).max() <= 1


def test_convert_is_deterministic(dataset, tmp_path):
    src, out, _, _ = dataset
    run("convert", src, tmp_path / "again", "--to", "npy", "--allow-bad", "-q", "-j", "1")
    for f in npy_files(out):
        rel = os.path.relpath(f, out)
        with open(f, "rb") as a, open(tmp_path / "again" / rel, "rb") as b:
            assert a.read() == b.read(), rel
