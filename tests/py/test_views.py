"""Tensor views (`stagefs convert --to npy`): every file opens with numpy's mmap, tables equal
what pyarrow reads, image folders follow torchvision's ImageFolder and match Pillow's
resize + center crop (exact mode: Pillow's pixels; fast mode: within stated bounds), damaged
images are flagged where Pillow refuses them (and where docs/views.md says stagefs is stricter),
bad inputs behave as the contract says, and the CLI checks its arguments.

The dataset comes from gen_dataset.py (deterministic). The mount serves the same bytes
(ViewSet::open is shared); mount-vs-convert `cmp` tests live with the mount.
"""

import io
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
# center crop). Exact mode reproduces Pillow's fixed-point filter and decodes JPEGs with the
# libjpeg-turbo Pillow ships, with its settings: measured 0 levels everywhere. 1 level is allowed
# for JPEGs in case a Pillow build links another libjpeg-turbo release.
EXACT_MAX_DIFF_PNG = 0
EXACT_MAX_DIFF_JPEG = 1
EXACT_MEAN_DIFF = 0.01
# Fast mode (JPEG decoded at M/8 scale in the DCT domain, then the same filter with the
# full-resolution geometry), measured on these images and on bench/bench_images.py's photos:
# see docs/views.md and docs/benchmarks.md#views for the figures; the bounds leave a margin.
FAST_MAX_DIFF = 30
FAST_MEAN_DIFF = 2.5


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
    proc = run("convert", src, out, "--to", "npy", "--all-levels", "--allow-bad", "-q")
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
        ["images", "tables", "images.npy", "labels.npy", "classes.txt", "files.txt"])
    assert not os.path.exists(out / "notes")
    # The truncated table is listed as bad, not written; its directory has nothing to hold.
    assert not os.path.exists(out / "broken")
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


def diffs_vs_pillow(src_dir, out_dir, size, skip=()):
    """(max, mean, name) of |stagefs - Pillow| for every sample of the converted folder."""
    images = np.load(out_dir / "images.npy", mmap_mode="r")
    files = (out_dir / "files.txt").read_text().splitlines()
    result = []
    for i, rel in enumerate(files):
        path = src_dir / rel
        if str(path) in skip:
            continue
        ref = pillow_reference(path, size).astype(int)
        diff = np.abs(images[i].astype(int) - ref)
        result.append((int(diff.max()), float(diff.mean()), rel))
    return result


def test_exact_mode_pixels_equal_pillow(dataset):
    src, out, info, _ = dataset
    worst = diffs_vs_pillow(src / "images" / "train", out / "images" / "train", 224, {info["corrupt_jpeg"]})
    for mx, mean, rel in worst:
        bound = EXACT_MAX_DIFF_PNG if rel.lower().endswith(".png") else EXACT_MAX_DIFF_JPEG
        assert mx <= bound and mean <= EXACT_MEAN_DIFF, (rel, mx, mean)
    print("exact: max/mean abs diff vs Pillow:", sorted(worst, reverse=True)[:5])
    assert len(worst) >= 15


def test_fast_mode_stays_within_its_accuracy_bounds(dataset, tmp_path):
    src, _, info, _ = dataset
    out = tmp_path / "fast"
    # Larger photos than the dataset's, so that the DCT scaling actually reduces them.
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(5)
    for i, (w, h, kw) in enumerate([(500, 375, {}), (375, 500, {"subsampling": 0}),
                                    (640, 480, {"progressive": True}), (1024, 700, {}),
                                    (300, 300, {}), (460, 330, {"quality": 75})]):
        arr = gen_dataset.photo(rng, w, h).astype(np.float32) + rng.normal(0, 10, (h, w, 3))
        Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(photos / f"p{i}.jpg", quality=kw.pop("quality", 90), **kw)
    run("convert", photos, out, "--to", "npy", "--fast-decode", "-q")
    worst = diffs_vs_pillow(photos, out, 224)
    for mx, mean, rel in worst:
        assert mx <= FAST_MAX_DIFF and mean <= FAST_MEAN_DIFF, (rel, mx, mean)
    print("fast: max/mean abs diff vs Pillow:", sorted(worst, reverse=True))
    # Fast mode is not exact mode: at least one photo was decoded at a reduced scale.
    exact = tmp_path / "exact"
    run("convert", photos, exact, "--to", "npy", "-q")
    assert (exact / "images.npy").read_bytes() != (out / "images.npy").read_bytes()


def listed_bad(stderr):
    """File names in convert's list of bad inputs."""
    return {os.path.basename(line.strip().split(":")[0]) for line in stderr.splitlines()
            if line.startswith("  ")}


def pillow_refuses(path):
    try:
        with Image.open(path) as im:
            im.load()
            im.convert("RGB")
        return False
    except Exception:
        return True


@pytest.mark.parametrize("fast", [False, True])
def test_damaged_images_are_flagged_where_pillow_refuses_them(tmp_path, fast):
    d = tmp_path / "damaged"
    categories = gen_dataset.make_damaged(str(d))
    args = ["--fast-decode"] if fast else []
    p = run("convert", d, tmp_path / "out", "--to", "npy", "-q", *args, check=False)
    assert p.returncode == 1, p.stderr
    flagged = listed_bad(p.stderr)
    refused = {name for name in categories if pillow_refuses(d / name)}
    # Everything Pillow refuses is flagged (truncation, missing EOI, damaged headers, PNG CRC
    # and zlib errors, truncated PNGs) ...
    assert refused <= flagged, sorted(refused - flagged)
    # ... and what is flagged beyond that is only the documented stricter categories.
    extra = {categories[n] for n in flagged - refused}
    assert extra <= gen_dataset.STRICTER_THAN_PILLOW, extra
    # Tolerated damage decodes (as in Pillow): data after EOI/IEND, padding before EOI.
    for name, cat in categories.items():
        if cat in ("intact", "jpeg-trailing-data", "jpeg-extraneous-before-eoi", "png-no-iend"):
            assert name not in flagged, (name, p.stderr)
    # Every truncated file counts, wherever it was cut.
    assert {n for n, c in categories.items() if c in ("jpeg-truncated", "jpeg-no-eoi")} <= flagged
    # Flagged slots are zeros, the others are not.
    images = np.load(tmp_path / "out" / "images.npy", mmap_mode="r")
    files = (tmp_path / "out" / "files.txt").read_text().splitlines()
    for i, name in enumerate(files):
        assert images[i].any() != (name in flagged), name


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
    run("convert", tmp_path / "src" / "pets", tmp_path / "out", "--to", "npy", "--image-size", "32", "-q")
    images = np.load(tmp_path / "out" / "images.npy", mmap_mode="r")
    assert images.shape == (2, 32, 32, 3)
    ref = pillow_reference(src / "b.png", 32)
    assert np.abs(images[1].astype(int) - ref).max() <= 1


def test_convert_is_deterministic(dataset, tmp_path):
    src, out, _, _ = dataset
    run("convert", src, tmp_path / "again", "--to", "npy", "--all-levels", "--allow-bad", "-q", "-j", "1")
    for f in npy_files(out):
        rel = os.path.relpath(f, out)
        with open(f, "rb") as a, open(tmp_path / "again" / rel, "rb") as b:
            assert a.read() == b.read(), rel


def test_convert_writes_the_given_folder_view_not_every_level(dataset, tmp_path):
    src, _, _, _ = dataset
    out = tmp_path / "o"
    run("convert", src / "images" / "train", out, "--to", "npy", "--allow-bad", "-q")
    # One images.npy (the ImageFolder root given), not one per class folder as well.
    written = sorted(os.path.relpath(os.path.join(dp, f), out) for dp, _, fs in os.walk(out) for f in fs)
    assert written == ["classes.txt", "files.txt", "images.npy", "labels.npy"]
    assert (out / "classes.txt").read_text().splitlines() == ["cat", "dog", "zebra"]
    # Tables are written wherever they are; image views of sub-levels only with --all-levels.
    out2 = tmp_path / "o2"
    run("convert", src, out2, "--to", "npy", "--allow-bad", "-q")
    assert (out2 / "tables" / "numbers.parquet" / "id.npy").exists()
    assert (out2 / "images.npy").exists()
    assert not (out2 / "images" / "train" / "images.npy").exists()


def test_several_sources_go_to_their_own_folders(dataset, tmp_path):
    src, _, _, _ = dataset
    out = tmp_path / "o"
    run("convert", src / "images" / "train", src / "images" / "flat", out, "--to", "npy", "--allow-bad", "-q")
    assert np.load(out / "train" / "images.npy").shape[0] == len((out / "train" / "files.txt").read_text().splitlines())
    assert (out / "flat" / "files.txt").read_text().splitlines() == ["f0.jpg", "f1.jpg", "f2.jpg"]


def test_non_utf8_names_do_not_collide_in_files_txt_and_classes_txt(tmp_path):
    src = tmp_path / "src"
    rng = np.random.default_rng(3)
    for cls in (b"caf\xe9", b"caf\xe8"):  # Latin-1 names: both would be "caf\ufffd" lossily
        d = os.path.join(bytes(src), cls)
        os.makedirs(d)
        for name in (b"\xff.png", b"\xfe.png"):
            Image.fromarray(gen_dataset.photo(rng, 30, 20)).save(os.path.join(d, name).decode("utf-8", "surrogateescape"), format="PNG")
    out = tmp_path / "out"
    run("convert", src, out, "--to", "npy", "--image-size", "8", "-q")
    classes = (out / "classes.txt").read_bytes().split(b"\n")[:-1]
    files = (out / "files.txt").read_bytes().split(b"\n")[:-1]
    assert classes == [b"caf\xe8", b"caf\xe9"]
    assert files == [b"caf\xe8/\xfe.png", b"caf\xe8/\xff.png", b"caf\xe9/\xfe.png", b"caf\xe9/\xff.png"]
    # Read back with surrogateescape, the names are os.listdir's strings, so paths open.
    text = (out / "files.txt").read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    assert all(os.path.exists(src / t) for t in text)


def test_too_deep_directory_is_skipped_and_listed_not_fatal(tmp_path):
    src = tmp_path / "src"
    rng = np.random.default_rng(4)
    (src / "ok").mkdir(parents=True)
    Image.fromarray(gen_dataset.photo(rng, 30, 20)).save(src / "ok" / "a.png")
    # A directory whose path passes PATH_MAX (4096): ENAMETOOLONG for anything path-based.
    fd = os.open(src, os.O_RDONLY)
    name = "d" * 250
    for _ in range(18):
        os.mkdir(name, dir_fd=fd)
        nfd = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(fd)
    out = tmp_path / "out"
    p = run("convert", src, out, "--to", "npy", "--image-size", "8", "-q", check=False)
    assert p.returncode == 1, p.stderr
    assert "dddd" in p.stderr and ("too long" in p.stderr or "deeper" in p.stderr), p.stderr
    assert (out / "files.txt").read_text().splitlines() == ["ok/a.png"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory")
def test_unreadable_directory_is_skipped_and_listed_not_fatal(tmp_path):
    src = tmp_path / "src"
    rng = np.random.default_rng(6)
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        Image.fromarray(gen_dataset.photo(rng, 30, 20)).save(src / c / "x.png")
    os.chmod(src / "b", 0)
    try:
        p = run("convert", src, tmp_path / "out", "--to", "npy", "--image-size", "8", "-q", check=False)
    finally:
        os.chmod(src / "b", 0o755)
    assert p.returncode == 1 and "Permission denied" in p.stderr, p.stderr
    assert (tmp_path / "out" / "classes.txt").read_text().splitlines() == ["a"]


@pytest.mark.parametrize("size", ["0", "8193", "4294967295", "-1", "x"])
def test_image_size_out_of_range_is_a_clear_error(tmp_path, size):
    for cmd in (["convert", tmp_path, tmp_path / "o", "--to", "npy"], ["mount", tmp_path, tmp_path, "--cache", tmp_path]):
        p = run(*cmd, f"--image-size={size}", check=False)
        assert p.returncode == 2, (cmd, p.stderr)
        assert "--image-size" in p.stderr and ("out of range" in p.stderr or "whole number" in p.stderr), p.stderr


def test_missing_source_is_reported_as_missing(tmp_path):
    p = run("convert", tmp_path / "nope", tmp_path / "o", "--to", "npy", check=False)
    assert p.returncode == 1 and "does not exist" in p.stderr, p.stderr
    f = tmp_path / "file"
    f.write_text("x")
    p = run("convert", f, tmp_path / "o", "--to", "npy", check=False)
    assert "is not a directory" in p.stderr, p.stderr


def test_convert_usage_line_names_sources_then_out():
    p = run("convert", "--help")
    assert "<SRC>... <OUT>" in p.stdout, p.stdout
    assert "--allow-bad" in p.stdout and "written either way" in p.stdout


def test_truncated_jpeg_is_a_bad_input_not_a_grey_image(tmp_path):
    # The bug: the first part of a valid JPEG decoded "fine" with the rest grey, exit 0.
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(8)
    buf = io.BytesIO()
    Image.fromarray(gen_dataset.photo(rng, 120, 90)).save(buf, format="JPEG", quality=90)
    (src / "a.jpg").write_bytes(buf.getvalue())
    (src / "b.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 2 // 3])
    with pytest.raises(OSError, match="truncated"):
        Image.open(src / "b.jpg").load()
    p = run("convert", src, tmp_path / "out", "--to", "npy", "--image-size", "16", "-q", check=False)
    assert p.returncode == 1 and "b.jpg" in p.stderr and "a.jpg" not in p.stderr, p.stderr
    images = np.load(tmp_path / "out" / "images.npy")
    assert images[0].any() and not images[1].any()
