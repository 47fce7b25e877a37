"""fastdata.measure.synthetic: photo-like JPEG folders for tests, demos and benchmarks."""

import os
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from fastdata.converters import find_images
from fastdata.measure.synthetic import (
    learnable_class_name,
    make_imagefolder,
    make_imagenet_like,
    make_learnable_imagefolder,
    make_photo,
)


def test_make_imagefolder_writes_an_imagefolder_tree(tmp_path):
    root = make_imagefolder(tmp_path / "photos", num_classes=3, per_class=2, size=(120, 90), seed=0)
    assert root == os.fspath(tmp_path / "photos")
    classes, relpaths, labels = find_images(root)
    assert classes == ["class_0", "class_1", "class_2"]
    assert relpaths == [os.path.join(f"class_{c}", f"img_{i:05d}.jpg") for c in range(3) for i in range(2)]
    assert labels.tolist() == [0, 0, 1, 1, 2, 2]
    with Image.open(os.path.join(root, relpaths[0])) as img:
        assert img.format == "JPEG" and img.mode == "RGB" and img.size == (120, 90)


def test_make_imagefolder_is_seeded(tmp_path):
    a = make_imagefolder(tmp_path / "a", 2, 2, size=(120, 90), seed=5)
    b = make_imagefolder(tmp_path / "b", 2, 2, size=(120, 90), seed=5)
    c = make_imagefolder(tmp_path / "c", 2, 2, size=(120, 90), seed=6)
    name = os.path.join("class_1", "img_00001.jpg")
    read = lambda root: pathlib.Path(root, name).read_bytes()  # noqa: E731
    assert read(a) == read(b)
    assert read(a) != read(c)


def test_make_photo_images_differ_and_are_not_flat():
    rng = np.random.default_rng(0)
    first, second = np.asarray(make_photo(rng, 120, 90)), np.asarray(make_photo(rng, 120, 90))
    assert first.shape == (90, 120, 3) and first.dtype == np.uint8
    assert not np.array_equal(first, second)
    assert first.std() > 10


@pytest.mark.parametrize("width, height", [(32, 24), (16, 16), (41, 90)])
def test_make_photo_works_for_small_sizes(width, height):
    img = make_photo(np.random.default_rng(0), width, height)
    assert img.size == (width, height) and img.mode == "RGB"


def test_a_varied_jpeg_only_folder_holds_jpegs_of_many_sizes_and_modes(tmp_path):
    root = make_imagefolder(tmp_path / "photos", num_classes=2, per_class=12, size=(120, 90), seed=0,
                            vary=True, jpeg_only=True)
    _, relpaths, _ = find_images(root)
    assert len(relpaths) == 24 and all(path.endswith(".jpg") for path in relpaths)
    kinds = set()
    for relpath in relpaths:
        with Image.open(os.path.join(root, relpath)) as img:
            assert img.format == "JPEG"
            kinds.add((img.mode, img.size))
    assert {mode for mode, _ in kinds} == {"RGB", "L", "CMYK"}
    assert len({size for _, size in kinds}) > 20


def test_an_imagenet_like_folder_links_a_few_distinct_photos_over_every_class(tmp_path):
    root = make_imagenet_like(tmp_path / "imagenet", 250, classes=7, distinct=40, seed=0)
    classes, relpaths, labels = find_images(root)
    assert len(classes) == 7 and len(relpaths) == 250
    assert np.bincount(labels).tolist() == [36] * 5 + [35] * 2  # spread evenly
    stats = [os.stat(os.path.join(root, path)) for path in relpaths]
    assert len({stat.st_ino for stat in stats}) == 40 and all(stat.st_nlink > 1 for stat in stats)
    assert os.listdir(tmp_path) == ["imagenet"]  # the distinct photos live only as links
    sizes, modes = [], set()
    for relpath in relpaths[:40]:
        with Image.open(os.path.join(root, relpath)) as img:
            assert img.format == "JPEG"
            sizes.append(img.size)
            modes.add(img.mode)
    assert len(set(sizes)) == 40 and modes == {"RGB", "L", "CMYK"}
    assert sum(width > height for width, height in sizes) >= 28  # mostly landscape, as photos are


def test_an_imagenet_like_folder_refuses_more_classes_than_images(tmp_path):
    with pytest.raises(ValueError, match="classes <= num_images"):
        make_imagenet_like(tmp_path / "imagenet", 5, classes=10)


def test_a_learnable_folder_has_one_class_per_shape_and_colour_in_colour_keeping_kinds(tmp_path):
    root = make_learnable_imagefolder(tmp_path / "shapes", num_classes=10, per_class=4, seed=0)
    classes, relpaths, labels = find_images(root)
    assert classes == [learnable_class_name(k) for k in range(10)]
    assert classes[:2] == ["00_disc_warm", "01_bar_warm"] and classes[9] == "09_ring_cool"
    assert np.bincount(labels).tolist() == [4] * 10
    kinds, sizes = set(), set()
    for relpath in relpaths:
        with Image.open(os.path.join(root, relpath)) as img:
            kinds.add((img.format, img.mode))
            sizes.add(img.size)
            assert 40 <= min(img.size) and max(img.size) <= 200
    assert kinds == {("JPEG", "RGB"), ("JPEG", "CMYK"), ("PNG", "RGB"), ("PNG", "P"), ("WEBP", "RGB"),
                     ("BMP", "RGB"), ("TIFF", "CMYK")}
    assert len(sizes) > 30 and any(w > 2 * h for w, h in sizes) and any(h > 2 * w for w, h in sizes)


def test_a_learnable_folder_is_seeded(tmp_path):
    folders = [make_learnable_imagefolder(tmp_path / name, 3, 2, seed=seed) for name, seed in
               (("a", 1), ("b", 1), ("c", 2))]
    for name in find_images(folders[0])[1]:
        a, b, c = (pathlib.Path(root, name).read_bytes() for root in folders)
        assert a == b and a != c


def _centre_hues(path):
    """Return the hues (0..255) of the vivid pixels (saturation and value > 150) in the image's central square."""
    with Image.open(path) as img:
        rgb = img.convert("RGB")
    side = min(rgb.size)
    left, top = (rgb.width - side) // 2, (rgb.height - side) // 2
    hsv = np.asarray(rgb.crop((left, top, left + side, top + side)).convert("HSV")).reshape(-1, 3)
    return hsv[(hsv[:, 1] > 150) & (hsv[:, 2] > 150), 0].astype(int), side * side


def test_the_object_lies_in_the_central_square_in_its_colour_family(tmp_path):
    """A centre crop (the converter's resize) keeps the object, and the vivid pixels there have the class's hue."""
    root = make_learnable_imagefolder(tmp_path / "shapes", num_classes=10, per_class=6, seed=3)
    families = {"warm": (-0.1, 0.18), "cool": (0.46, 0.72)}  # a little wider than drawn: JPEG shifts hues
    for relpath in find_images(root)[1]:
        hues, area = _centre_hues(os.path.join(root, relpath))
        assert len(hues) > 0.03 * area, relpath  # the smallest object: a bar of 0.5 x 0.125 of the side
        low, high = families[relpath.split(os.sep)[0].split("_")[-1]]
        turns = hues / 256
        inside = ((turns - low) % 1.0) <= (high - low)  # the warm range wraps through red
        assert inside.mean() > 0.7, relpath


@pytest.mark.slow
def test_mean_colour_alone_does_not_give_the_class(tmp_path):
    """A linear model of each image's mean RGB (least squares on one-hot labels) stays far from learning it."""
    features = {}
    for split, seed in (("train", 0), ("val", 1)):
        root = make_learnable_imagefolder(tmp_path / split, num_classes=10, per_class=30, seed=seed, sides=(40, 64))
        _, relpaths, labels = find_images(root)
        means = [np.asarray(Image.open(os.path.join(root, p)).convert("RGB"), np.float64).mean((0, 1))
                 for p in relpaths]
        features[split] = np.c_[np.array(means) / 255, np.ones(len(means))], labels
    x, y = features["train"]
    weights = np.linalg.lstsq(x, np.eye(10)[y], rcond=None)[0]
    x, y = features["val"]
    accuracy = ((x @ weights).argmax(1) == y).mean()
    assert 0.1 < accuracy < 0.45  # colour family shows through; the shape does not


@settings(max_examples=8, deadline=None)
@given(smallest=st.integers(16, 120), extra=st.integers(0, 150), num_classes=st.integers(1, 20))
def test_learnable_images_keep_to_the_sides_asked_for(tmp_path_factory, smallest, extra, num_classes):
    sides = (smallest, smallest + extra)
    root = make_learnable_imagefolder(tmp_path_factory.mktemp("shapes"), num_classes, 1, seed=smallest, sides=sides)
    classes, relpaths, _ = find_images(root)
    assert len(classes) == len(relpaths) == num_classes
    for relpath in relpaths:
        with Image.open(os.path.join(root, relpath)) as img:
            assert sides[0] <= min(img.size) and max(img.size) <= sides[1]


@pytest.mark.parametrize("options, match", [({"num_classes": 21}, "num_classes"), ({"num_classes": 0}, "num_classes"),
                                            ({"sides": (8, 40)}, "sides"), ({"sides": (50, 40)}, "sides")])
def test_make_learnable_imagefolder_refuses_bad_options(tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        make_learnable_imagefolder(tmp_path / "shapes", **options)
