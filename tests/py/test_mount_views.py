"""Tensor views through a real mount: `MOUNTPOINT/.npy/` equals `stagefs convert --to npy` byte
for byte, opens with numpy's mmap, survives bad inputs, serves random-offset and random-slot
reads from many threads (DataLoader workers) with the right bytes, and keeps decompression
bombs read at once within the decode budget (the daemon's peak RSS).
"""

import concurrent.futures
import json
import os
import random
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gen_dataset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("STAGEFS_BIN", os.path.join(ROOT, "target", "debug", "stagefs"))
SIZE = 48


def stagefs(*args, check=True):
    p = subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"stagefs {args} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


class Mounted:
    def __init__(self, src, base, *extra):
        self.mnt = base / "mnt"
        self.mnt.mkdir(exist_ok=True)
        self.cache = base / "cache"
        stagefs("mount", src, self.mnt, "--cache", self.cache, "--image-size", SIZE, *extra)

    def stats(self):
        return json.loads((self.mnt / ".stagefs" / "stats").read_text())

    def close(self):
        stagefs("umount", self.mnt)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    base = tmp_path_factory.mktemp("views-mount")
    src = base / "src"
    gen_dataset.generate(str(src))
    out = base / "converted"
    stagefs("convert", src, out, "--to", "npy", "--image-size", SIZE, "--all-levels", "--allow-bad", "-q")
    return base, src, out


@pytest.fixture(scope="module")
def mount(dataset):
    base, src, _ = dataset
    m = Mounted(src, base)
    yield m
    m.close()


def files_under(root):
    for d, _, names in os.walk(root):
        for n in names:
            yield os.path.relpath(os.path.join(d, n), root)


def test_mount_views_are_byte_identical_to_convert(dataset, mount):
    _, _, out = dataset
    rels = sorted(files_under(out))
    assert any(r.endswith("images.npy") for r in rels)
    assert any(r.endswith("features.npy") for r in rels)
    for rel in rels:
        a = (out / rel).read_bytes()
        b = (mount.mnt / ".npy" / rel).read_bytes()
        assert a == b, rel
        # Sizes in stat are exact (known before decoding).
        assert os.stat(mount.mnt / ".npy" / rel).st_size == len(a), rel


def test_every_npy_view_opens_with_mmap(mount):
    npys = [r for r in files_under(mount.mnt / ".npy") if r.endswith(".npy")]
    assert npys
    for rel in npys:
        arr = np.load(mount.mnt / ".npy" / rel, mmap_mode="r")
        # The file is exactly its header and the data the header promises, and the first rows
        # read back whole.
        with open(mount.mnt / ".npy" / rel, "rb") as f:
            prefix = f.read(10)
        assert prefix[:8] == b"\x93NUMPY\x01\x00", rel  # format 1.0: a 2-byte header length
        header_len = 10 + int.from_bytes(prefix[8:10], "little")
        assert os.stat(mount.mnt / ".npy" / rel).st_size == header_len + arr.nbytes, rel
        head = np.asarray(arr[: min(len(arr), 3)]).copy()
        assert head.shape == (min(len(arr), 3),) + arr.shape[1:], rel


def test_table_columns_equal_pyarrow(dataset, mount):
    _, src, _ = dataset
    table = pq.read_table(src / "tables" / "numbers.parquet")
    d = mount.mnt / ".npy" / "tables" / "numbers.parquet"
    schema = json.loads((d / "schema.json").read_text())
    checked = 0
    for col in schema["columns"]:
        if not col.get("file"):
            continue
        got = np.load(d / col["file"], mmap_mode="r")
        want = table.column(col["name"]).to_numpy(zero_copy_only=False)
        want = np.asarray(want, dtype=got.dtype) if want.dtype != object else np.array(
            [np.nan if v is None else v for v in want], dtype=got.dtype)
        np.testing.assert_array_equal(np.asarray(got), want)
        checked += 1
    assert checked >= 2


def test_bad_inputs_keep_the_mount_up_and_are_reported(dataset, mount):
    broken = mount.mnt / ".npy" / "broken" / "truncated.parquet"
    with pytest.raises(OSError) as e:
        os.listdir(broken)
    assert e.value.errno == 5  # EIO
    cat = np.load(mount.mnt / ".npy" / "images" / "train" / "cat" / "images.npy")
    files = (mount.mnt / ".npy" / "images" / "train" / "cat" / "files.txt").read_text().split("\n")
    bad = [i for i, f in enumerate(files) if f.endswith("corrupt.jpg")]
    assert bad and not cat[bad[0]].any(), "a corrupt image reads as zeros"
    errors = mount.stats()["errors"]
    assert any("corrupt.jpg" in e for e in errors), errors
    assert any("truncated.parquet" in e for e in errors), errors
    # Still serving.
    assert (mount.mnt / "tables" / "data.csv").read_bytes() == (dataset[1] / "tables" / "data.csv").read_bytes()


def test_random_offset_reads_from_many_threads_equal_the_converted_file(dataset, mount):
    _, _, out = dataset
    rel = os.path.join("images", "train", "dog", "images.npy")
    want = (out / rel).read_bytes()
    path = mount.mnt / ".npy" / rel

    def worker(seed):
        rng = random.Random(seed)
        with open(path, "rb", buffering=0) as f:
            for _ in range(100):
                off = rng.randrange(0, len(want))
                n = rng.randrange(1, 50_000)
                f.seek(off)
                assert f.read(n) == want[off : off + n], (seed, off, n)

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        list(ex.map(worker, range(8)))


def test_strict_views_fail_reads_of_corrupt_images(dataset, tmp_path):
    _, src, _ = dataset
    m = Mounted(src, tmp_path, "--strict-views")
    try:
        with pytest.raises(OSError) as e:
            (m.mnt / ".npy" / "images" / "train" / "cat" / "images.npy").read_bytes()
        assert e.value.errno == 5
        # Folders without bad images still read.
        np.load(m.mnt / ".npy" / "images" / "train" / "zebra" / "images.npy")
    finally:
        m.close()


def test_rendered_views_are_cached_on_scratch_across_remounts(dataset, tmp_path):
    _, src, out = dataset
    rel = os.path.join("images", "flat", "images.npy")
    m = Mounted(src, tmp_path)
    try:
        assert (m.mnt / ".npy" / rel).read_bytes() == (out / rel).read_bytes()
        assert m.stats()["views_rendered"] > 0
    finally:
        m.close()
    m = Mounted(src, tmp_path, "--no-staging")
    try:
        assert (m.mnt / ".npy" / rel).read_bytes() == (out / rel).read_bytes()
        s = m.stats()
        assert s["views_rendered"] == 0, s
        assert s["bytes_from_source"] == 0, s
    finally:
        m.close()


def test_random_slot_reads_equal_convert(dataset, mount):
    _, _, out = dataset
    rel = os.path.join("images", "train", "images.npy")
    want = np.load(out / rel, mmap_mode="r")
    got = np.load(mount.mnt / ".npy" / rel, mmap_mode="r")
    assert got.shape == want.shape
    order = list(range(len(want)))
    random.Random(11).shuffle(order)

    def check(i):
        assert np.array_equal(np.asarray(got[i]), np.asarray(want[i])), i

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        list(ex.map(check, order))


def vm_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def test_decompression_bombs_read_at_once_stay_within_the_decode_budget(tmp_path):
    src = tmp_path / "src" / "bombs"
    src.mkdir(parents=True)
    # Each PNG is 3000x3000 (27 MB of RGB if decoded whole) in ~30 KB; each JPEG header claims
    # 16383x16383 (805 MB) in a few hundred bytes. Both are under the raised cap, so they are
    # decoded: the PNGs row by row, the JPEGs refused before decoding (they do not fit the
    # budget even at 1/8 scale) — and bad anyway, having no data.
    for i in range(3):
        gen_dataset.png_bomb(src / f"p{i}.png", 3000, 3000)
        gen_dataset.jpeg_bomb(src / f"j{i}.jpg", 16383, 16383)
    budget_px = 4 << 20  # 12 MiB of RGB
    m = Mounted(tmp_path / "src", tmp_path, "--max-image-pixels", "300M",
                "--decode-budget", str(budget_px), "--no-staging")
    try:
        pid = m.stats()["pid"]
        path = m.mnt / ".npy" / "bombs" / "images.npy"
        # Peak RSS before anything of images.npy is read (its size comes from stat alone).
        base = vm_kib(pid, "VmHWM")
        slot = SIZE * SIZE * 3
        header = os.path.getsize(path) - 6 * slot
        assert header > 0 and header % 64 == 0

        def read(i):
            with open(path, "rb", buffering=0) as f:
                f.seek(header + i * slot)
                return f.read(slot)

        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            slots = list(ex.map(read, range(6)))
        peak = vm_kib(pid, "VmHWM")
        files = (m.mnt / ".npy" / "bombs" / "files.txt").read_text().splitlines()
        errors = m.stats()["errors"]
    finally:
        m.close()
    extra_mib = (peak - base) / 1024
    budget_mib = budget_px * 3 / 2**20
    print(f"daemon peak RSS grew {extra_mib:.1f} MiB reading the bombs (budget {budget_mib:.0f} MiB)")
    # The budget, plus the daemon's own buffers for these reads (render blocks, file bytes).
    assert extra_mib < budget_mib + 48, (extra_mib, budget_mib)
    for name, data in zip(files, slots):
        if name.endswith(".png"):
            assert len(data) == slot  # black, and decoded
        else:
            assert data == b"\0" * slot, name  # no entropy data: bad, zeros
            assert any(name in e for e in errors), (name, errors)


def test_fast_decode_mount_equals_fast_convert(dataset, tmp_path):
    _, src, _ = dataset
    out = tmp_path / "fast"
    stagefs("convert", src / "images" / "flat", out, "--to", "npy", "--image-size", SIZE, "--fast-decode", "-q")
    m = Mounted(src, tmp_path, "--fast-decode")
    try:
        got = (m.mnt / ".npy" / "images" / "flat" / "images.npy").read_bytes()
    finally:
        m.close()
    assert got == (out / "images.npy").read_bytes()
