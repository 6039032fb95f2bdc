"""Augmentation in `stagefs.Loader`'s reader threads: `RandomResizedCrop` windows stay inside the
image and are drawn from (seed, epoch, sample) alone; the flip rate is ~50 %; the resize matches
a small numpy reference of the antialiased triangle filter within 1 level (and Pillow's
`resize(box=...)` exactly); `CenterCrop`, normalize, float16/float32 and NCHW are what they
claim; augmented batches are identical on resume and with any number of readers."""

import numpy as np
import pytest

import stagefs

ROWS = 40
H, W = 48, 64


@pytest.fixture
def images(tmp_path):
    rng = np.random.default_rng(3)
    # Smooth images (the reference's rounding differs from Pillow's 8-bit intermediate by at
    # most half a level per pass) with some noise, so the crops differ visibly.
    y, x = np.mgrid[0:H, 0:W]
    base = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1)
    imgs = (base[None] + rng.integers(0, 40, size=(ROWS, H, W, 3))) % 256
    imgs = imgs.astype(np.uint8)
    ids = tmp_path / "ids.npy"
    path = tmp_path / "images.npy"
    np.save(path, imgs)
    np.save(ids, np.arange(ROWS, dtype=np.int64))
    return str(path), str(ids), imgs


def batches(loader):
    return [tuple(np.array(p) for p in b) for b in loader]


def test_crops_stay_inside_the_image_and_depend_only_on_seed_epoch_and_sample():
    t = stagefs.RandomResizedCrop(16, scale=(0.08, 1.0), flip=True)
    for h, w in [(48, 64), (7, 300), (300, 7), (1, 1)]:
        for row in range(300):
            top, left, ch, cw, _ = box = t.crop_box(3, 1, row, h, w)
            assert ch >= 1 and cw >= 1 and top + ch <= h and left + cw <= w, (box, h, w)
            assert box == t.crop_box(3, 1, row, h, w)
    boxes = lambda seed, epoch: [t.crop_box(seed, epoch, r, 48, 64) for r in range(50)]
    assert boxes(3, 1) != boxes(3, 2) and boxes(3, 1) != boxes(4, 1)


def test_crop_areas_and_ratios_follow_the_requested_ranges():
    t = stagefs.RandomResizedCrop(16, scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3))
    areas, ratios = [], []
    for row in range(2000):
        _, _, h, w, _ = t.crop_box(0, 0, row, 200, 200)
        areas.append(h * w / 200 / 200)
        ratios.append(w / h)
    # Rounding to whole pixels moves the edges by a hair.
    assert 0.34 < min(areas) and max(areas) <= 1.0
    assert 0.74 < min(ratios) and max(ratios) < 1.35
    assert 0.6 < np.mean(areas) < 0.75  # uniform on [0.35, 1]: 0.675


def test_flip_rate_is_about_half_and_flips_mirror(images):
    path, _, imgs = images
    t = stagefs.RandomResizedCrop(W, scale=(1, 1), ratio=(W / H, W / H), flip=True)
    flips = [t.crop_box(0, 0, r, H, W)[4] for r in range(4000)]
    assert 0.47 < np.mean(flips) < 0.53
    # A full-image window resized to its own width (and H rows): the output is the image or
    # its mirror, as crop_box says.
    t = stagefs.RandomResizedCrop(W, scale=(1, 1), ratio=(W / H, W / H), flip=True)
    assert t.crop_box(0, 0, 0, H, W)[:4] == (0, 0, H, W)
    loader = stagefs.Loader([path], ROWS, tensors="numpy", transform=t, seed=0)
    (out,), = batches(loader)
    # RandomResizedCrop outputs size x size; compare the H rows the box scales to W.
    seen = set()
    for r in range(ROWS):
        flip = t.crop_box(0, 0, r, H, W)[4]
        seen.add(flip)
        ref = reference_resize(imgs[r], (0, 0, H, W), W)
        if flip:
            ref = ref[:, ::-1]
        assert np.abs(out[r].astype(int) - ref).max() <= 1, r
    assert seen == {True, False}


def taps(in_size, in0, in1, out_size):
    """Per output pixel: (first index, weights) of Pillow's antialiased triangle filter."""
    scale = (in1 - in0) / out_size
    support = max(scale, 1.0)
    out = []
    for x in range(out_size):
        center = in0 + (x + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        idx = np.arange(xmin, xmax)
        w = np.maximum(0.0, 1.0 - np.abs((idx - center + 0.5) / support))
        out.append((xmin, w / w.sum()))
    return out


def reference_resize(img, box, size):
    """Resizes `img[top:top+h, left:left+w]` to `size x size` with the triangle filter, in float."""
    top, left, h, w = box
    img = img.astype(np.float64)
    tmp = np.stack([(img[:, x0:x0 + len(k)] * k[None, :, None]).sum(axis=1)
                    for x0, k in taps(img.shape[1], left, left + w, size)], axis=1)
    out = np.stack([(tmp[y0:y0 + len(k)] * k[:, None, None]).sum(axis=0)
                    for y0, k in taps(img.shape[0], top, top + h, size)], axis=0)
    return np.clip(np.rint(out), 0, 255).astype(int)


def test_random_resized_crop_matches_a_numpy_reference_and_pillow(images):
    path, _, imgs = images
    size = 24
    t = stagefs.RandomResizedCrop(size, scale=(0.2, 1.0))
    (out,), = batches(stagefs.Loader([path], ROWS, tensors="numpy", transform=t, seed=11))
    assert out.shape == (ROWS, size, size, 3) and out.dtype == np.uint8
    from PIL import Image

    for r in range(ROWS):
        top, left, h, w, flip = t.crop_box(11, 0, r, H, W)
        assert not flip
        ref = reference_resize(imgs[r], (top, left, h, w), size)
        diff = np.abs(out[r].astype(int) - ref).max()
        assert diff <= 1, (r, diff)
        pil = Image.fromarray(imgs[r]).resize((size, size), Image.BILINEAR,
                                              box=(left, top, left + w, top + h))
        np.testing.assert_array_equal(out[r], np.asarray(pil))


def test_center_crop_normalize_dtype_and_layout(images):
    path, _, imgs = images
    mean, std = stagefs.IMAGENET_MEAN, stagefs.IMAGENET_STD
    (u8,), = batches(stagefs.Loader([path], ROWS, tensors="numpy", transform=stagefs.CenterCrop(32)))
    top, left = round((H - 32) / 2), round((W - 32) / 2)
    np.testing.assert_array_equal(u8, imgs[:, top:top + 32, left:left + 32])
    (u8_chw,), = batches(stagefs.Loader([path], ROWS, tensors="numpy", transform=stagefs.CenterCrop(32),
                                        layout="NCHW"))
    np.testing.assert_array_equal(u8_chw, u8.transpose(0, 3, 1, 2))
    (f32,), = batches(stagefs.Loader([path], ROWS, tensors="numpy", transform=stagefs.CenterCrop(32),
                                      normalize=(mean, std), layout="NCHW"))
    assert f32.dtype == np.float32 and f32.shape == (ROWS, 3, 32, 32)
    want = ((u8 / 255.0 - np.array(mean)) / np.array(std)).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(f32, want, rtol=0, atol=1e-6)
    (f16,), = batches(stagefs.Loader([path], ROWS, tensors="numpy", transform=stagefs.CenterCrop(32),
                                      normalize=(mean, std), dtype="float16"))
    assert f16.dtype == np.float16 and f16.shape == (ROWS, 32, 32, 3)
    np.testing.assert_array_equal(f16, want.transpose(0, 2, 3, 1).astype(np.float16))
    # No crop: dtype and layout alone.
    (whole,), = batches(stagefs.Loader([path], ROWS, tensors="numpy", dtype="float32", layout="NCHW"))
    np.testing.assert_allclose(whole, imgs.transpose(0, 3, 1, 2) / 255.0, atol=1e-7)


def test_bad_transforms_are_refused_with_clear_errors(images, tmp_path):
    path, ids, _ = images
    with pytest.raises(ValueError, match="CenterCrop\\(64\\) of 48.64 images"):
        stagefs.Loader([path], 4, tensors="numpy", transform=stagefs.CenterCrop(64))
    with pytest.raises(ValueError, match="uint8 rows"):
        stagefs.Loader([ids], 4, tensors="numpy", transform=stagefs.RandomResizedCrop(8))
    with pytest.raises(ValueError, match="scale"):
        stagefs.Loader([path], 4, tensors="numpy", transform=stagefs.RandomResizedCrop(8, scale=(0.5, 2)))
    with pytest.raises(ValueError, match="mean and std need 1 or 3"):
        stagefs.Loader([path], 4, tensors="numpy", normalize=([0.5, 0.5], [1, 1]))
    with pytest.raises(ValueError, match="dtype"):
        stagefs.Loader([path], 4, tensors="numpy", dtype="int32")


def test_augmented_batches_are_identical_on_resume_and_with_any_readers(images):
    path, ids, _ = images
    kw = dict(tensors="numpy", shuffle=True, seed=2,
              transform=stagefs.RandomResizedCrop(20, scale=(0.35, 1), flip=True),
              normalize=(stagefs.IMAGENET_MEAN, stagefs.IMAGENET_STD), dtype="float16", layout="NCHW")
    def run(loader, stop=None):
        out = []
        for epoch in range(loader.epoch, 2):
            loader.set_epoch(epoch)
            for b in loader:
                out.append(tuple(np.array(p) for p in b))
                if len(out) == stop:
                    return out, loader.state_dict()
        return out, None
    full, _ = run(stagefs.Loader([path, ids], 6, readers=1, **kw))
    assert len(full) == 14
    many, _ = run(stagefs.Loader([path, ids], 6, readers=4, **kw))
    first, state = run(stagefs.Loader([path, ids], 6, readers=3, **kw), stop=9)
    resumed = stagefs.Loader([path, ids], 6, readers=2, **kw)
    resumed.load_state_dict(state)
    rest, _ = run(resumed)
    for got in (many, first + rest):
        assert len(got) == len(full)
        for a, b in zip(got, full):
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])
    # Epochs differ (fresh crops each epoch), so the test above compares something.
    assert not np.array_equal(full[0][0], full[7][0])


def test_a_sample_is_augmented_the_same_in_any_order_and_read_path(tmp_path):
    """Crops depend on (seed, epoch, row), not on the order: row r's output is the same shuffled
    or not. Rows of small images read in a scattered order come from the in-memory copy of the
    file (SMALL_ROW), in file order from pread: both paths go through the transform."""
    rng = np.random.default_rng(5)
    imgs = rng.integers(0, 256, size=(50, 12, 10, 3), dtype=np.uint8)  # 360-byte rows: held in memory
    np.save(tmp_path / "small.npy", imgs)
    np.save(tmp_path / "ids.npy", np.arange(50, dtype=np.int64))
    paths = [str(tmp_path / "small.npy"), str(tmp_path / "ids.npy")]
    t = stagefs.RandomResizedCrop(8, scale=(0.3, 1), flip=True)
    by_row = {}
    for shuffle in (False, True):
        got = {}
        for images, ids in batches(stagefs.Loader(paths, 7, tensors="numpy", shuffle=shuffle, seed=4, transform=t)):
            for img, r in zip(images, ids):
                got[int(r)] = img
        by_row[shuffle] = got
    assert sorted(by_row[True]) == sorted(by_row[False]) == list(range(50))
    for r in range(50):
        np.testing.assert_array_equal(by_row[True][r], by_row[False][r])
