"""fastdata.measure.synthetic: photo-like JPEG folders for tests, demos and benchmarks."""

import os
import pathlib

import numpy as np
import pytest
from PIL import Image

from fastdata.converters import find_images
from fastdata.measure.synthetic import make_imagefolder, make_imagenet_like, make_photo


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
