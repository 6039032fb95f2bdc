"""Bad JPEGs keep the contract of docs/views.md ("Damaged inputs", "Memory") on the CPU path: a
corrupt, a truncated, a CMYK, a progressive and a 30,000-pixel-wide JPEG each give either their
pixels or the documented error (named in the list of bad inputs, exit 1, or with `--allow-bad`
exit 0 and a slot of zeros), never a crash, and `stagefs convert`'s peak memory stays near the
decode budget however large the header says the image is (sizes are checked before anything is
allocated). The GPU path (the Loader on a device over such a view) skips visibly here.

Each case is one folder with the bad file beside a good one, converted on its own, so one
case's outcome cannot hide another's.
"""

import io
import os
import resource
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, os.path.dirname(__file__))
import gen_dataset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("STAGEFS_BIN", os.path.join(ROOT, "target", "debug", "stagefs"))
SIZE = 64
# Peak RSS of a convert over these folders: the default decode budget (32M px ≈ 100 MB) bounds
# what decodes hold; the rest is the binary, its threads and the output buffers (~20 MB
# measured). A decode that trusted a 30000x30000 header would need 2.7 GB.
MAX_RSS_MB = 100 + 64


def jpeg(arr, **kw):
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", **kw)
    return buf.getvalue()


def photo(w, h, seed=0):
    return gen_dataset.photo(np.random.default_rng(seed), w, h)


def wide(w, h):
    """A w x h gradient with texture, built in uint8 (cheap at 30,000 px, unlike photo())."""
    x = (np.arange(w) * 255 // max(w - 1, 1)).astype(np.uint8)
    y = (np.arange(h) * 255 // max(h - 1, 1)).astype(np.uint8)
    img = np.empty((h, w, 3), np.uint8)
    img[:, :, 0] = x[None, :] // 2 + y[:, None] // 2
    img[:, :, 1] = 255 - img[:, :, 0]
    img[:, :, 2] = ((np.arange(w) % 7) * 30).astype(np.uint8)[None, :]
    return img


def corrupt(data):
    """Entropy data overwritten with bytes that are no valid Huffman code (in the middle)."""
    d = bytearray(data)
    sos = d.index(b"\xff\xda")
    mid = sos + (len(d) - sos) // 2
    d[mid:mid + 64] = bytes([0xFF, 0x00]) * 32
    return bytes(d)


def reference(path):
    """Pillow's pixels: open -> convert("RGB") -> resize to torchvision's size -> center crop."""
    im = Image.open(path)
    im.load()
    im = im.convert("RGB")
    w, h = im.size
    nw, nh = (SIZE, SIZE * h // w) if w <= h else (SIZE * w // h, SIZE)
    im = im.resize((nw, nh), Image.BILINEAR)
    left, top = int(round((nw - SIZE) / 2)), int(round((nh - SIZE) / 2))
    return np.asarray(im.crop((left, top, left + SIZE, top + SIZE)))


def cases():
    """name -> (bytes of bad.jpg, expected: "pixels" or the error text stderr must carry)."""
    base = photo(160, 120)
    whole = jpeg(base, quality=90)
    # A header claiming 30000x30000 (900 Mpx) with no data: refused before any allocation.
    bomb_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"stagefs-bomb-{os.getpid()}.jpg")
    gen_dataset.jpeg_bomb(bomb_path, 30000, 30000)
    with open(bomb_path, "rb") as f:
        bomb = f.read()
    os.unlink(bomb_path)
    big = wide(30000, 1500)
    cmyk = io.BytesIO()
    Image.fromarray(base).convert("CMYK").save(cmyk, format="JPEG", quality=90)
    return {
        "corrupt": (corrupt(whole), "corrupt JPEG data"),
        "truncated": (whole[: len(whole) * 2 // 3], "Premature end"),
        "cmyk": (cmyk.getvalue(), "pixels"),
        "progressive": (jpeg(photo(640, 480, 1), quality=90, progressive=True), "pixels"),
        # 30,000 px wide, 1,500 high (45 Mpx, under the pixel cap): the crop window's source
        # columns are a small part of the width, decoded through a cropping region.
        "wide-30000": (jpeg(big, quality=90), "pixels"),
        # The same as a progressive file: libjpeg would hold every coefficient of all 45 Mpx
        # (270 MB), more than the decode budget, so it is refused before decoding.
        "wide-30000-progressive": (jpeg(big, quality=90, progressive=True),
                                   "needs more memory than the decode budget"),
        "header-30000x30000": (bomb, "30000x30000"),
    }


CASES = cases()


def convert(src, out, *flags):
    """Runs convert in a child of a fresh Python, so that RUSAGE_CHILDREN is convert's alone."""
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode)")
    p = subprocess.run([sys.executable, "-c", code, BIN, "convert", str(src), str(out), "--to", "npy",
                        "--image-size", str(SIZE), "-j", "2", *flags],
                       capture_output=True, text=True, timeout=300)
    rss_kb, rc = map(int, p.stdout.split()[-2:])
    return rc, p.stderr, rss_kb / 1024


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    name = request.param
    data, expected = CASES[name]
    src = tmp_path_factory.mktemp(f"bad-{name}") / "train"
    (src / "cls").mkdir(parents=True)
    (src / "cls" / "a-good.jpg").write_bytes(jpeg(photo(120, 90, 2), quality=90))
    (src / "cls" / "b-bad.jpg").write_bytes(data)
    return name, src, expected


def test_without_allow_bad_the_bad_file_fails_the_run_and_is_named(case, tmp_path):
    name, src, expected = case
    rc, err, rss = convert(src, tmp_path / "out")
    assert rc in (0, 1), (name, rc, err)  # never a signal (a crash is rc < 0 or 101 for a panic)
    if expected == "pixels":
        assert rc == 0 and "b-bad.jpg" not in err, (name, err)
    else:
        assert rc == 1 and "b-bad.jpg" in err and expected in err, (name, err)
        assert "--allow-bad" in err, err
    assert rss < MAX_RSS_MB, f"{name}: convert peaked at {rss:.0f} MB"


def test_with_allow_bad_the_slot_is_zeros_or_pillows_pixels(case, tmp_path):
    name, src, expected = case
    rc, err, rss = convert(src, tmp_path / "out", "--allow-bad")
    assert rc == 0, (name, err)
    images = np.load(tmp_path / "out" / "images.npy")
    files = (tmp_path / "out" / "files.txt").read_text().splitlines()
    assert files == ["cls/a-good.jpg", "cls/b-bad.jpg"], files
    assert images.shape == (2, SIZE, SIZE, 3)
    assert np.array_equal(images[0], reference(src / "cls" / "a-good.jpg"))
    if expected == "pixels":
        want = reference(src / "cls" / "b-bad.jpg")
        diff = np.abs(images[1].astype(int) - want.astype(int))
        # Exact mode: Pillow's pixels (docs/views.md: at most 1 level for JPEG).
        assert diff.max() <= 1 and diff.mean() <= 0.01, (name, diff.max(), diff.mean())
    else:
        assert not images[1].any(), f"{name}: the placeholder slot is zeros"
        assert "b-bad.jpg" in err and expected in err, (name, err)
    assert rss < MAX_RSS_MB, f"{name}: convert peaked at {rss:.0f} MB"


def test_bad_rows_reach_the_device_as_zeros(case, tmp_path):
    """The GPU path: the Loader on a device over the --allow-bad view."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("skipped: needs a GPU")
    import stagefs

    name, src, expected = case
    rc, err, _ = convert(src, tmp_path / "out", "--allow-bad")
    assert rc == 0, err
    view = tmp_path / "out"
    host = np.load(view / "images.npy")
    loader = stagefs.Loader([str(view / "images.npy")], 2, device="cuda:0")
    (images,) = next(iter(loader))
    assert images.device.type == "cuda"
    assert np.array_equal(images.cpu().numpy(), host)
    if expected != "pixels":
        assert not images[1].any()
