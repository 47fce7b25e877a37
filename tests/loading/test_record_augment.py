"""Augmenting record batches: boxes declared as an image's move exactly as its pixels do."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from fastdata import Field, OptionError, make_loader, open_dataset, write
from fastdata.loading.augment import CenterCrop, Compose, Normalize, RandomCrop, RandomResizedCrop

SIZE = (40, 56)  # stored height, width


@pytest.fixture(scope="module")
def boxed(tmp_path_factory):
    """24 stored images, each white with 1-3 red rectangles, and their boxes declared as the image's."""
    rng = np.random.default_rng(3)
    records = []
    for index in range(24):
        image = Image.new("RGB", SIZE[::-1], "white")
        draw, boxes = ImageDraw.Draw(image), []
        for _ in range(index % 3 + 1):
            w, h = int(rng.integers(10, 24)), int(rng.integers(10, 20))
            x, y = int(rng.integers(0, SIZE[1] - w)), int(rng.integers(0, SIZE[0] - h))
            draw.rectangle([x, y, x + w - 1, y + h - 1], fill="red")
            boxes.append([x, y, w, h])
        records.append({"image": np.asarray(image), "boxes": np.array(boxes, np.float32), "labels": [7] * len(boxes)})
    path = tmp_path_factory.mktemp("boxed") / "boxed.h5"
    write(records, path, {"image": Field("image", size=SIZE, storage="png"),
                          "boxes": Field("ragged", shape=(4,), boxes="image"),
                          "labels": Field("ragged", dtype="int64")})
    return path


def _red(images):
    pixels = images.float()
    return (pixels[:, 0] > 150) & (pixels[:, 1] < 110) & (pixels[:, 2] < 110)


@pytest.mark.parametrize("augment", [
    RandomCrop((32, 48), padding=6), CenterCrop((30, 30)), RandomResizedCrop((48, 48), scale=(0.3, 1.0)),
    Compose(RandomResizedCrop(36, scale=(0.5, 1.0), ratio=(0.5, 2.0)), Normalize((0.5,) * 3, (0.5,) * 3)),
])
def test_boxes_bound_their_red_rectangles_after_the_augmentation(boxed, augment):
    plain = {int(batch["labels_lengths"].sum()) for batch in make_loader(open_dataset(boxed), 8)}
    loader = make_loader(open_dataset(boxed), 8, shuffle=True, seed=5, device="cpu", augment=augment)
    checked = 0
    for _ in range(2):  # two epochs: other crops
        for batch in loader:
            images = batch["image"]
            if isinstance(augment, Compose):  # back to 0..255 for the colour test
                images = images * 0.5 * 255 + 0.5 * 255
            red = _red(images)
            for row in range(len(images)):
                count = int(batch["boxes_lengths"][row])
                inside = torch.zeros_like(red[row])
                for x, y, w, h in batch["boxes"][row, :count].tolist():
                    assert 0 <= x and 0 <= y and x + w <= red.shape[2] + 1e-4 and y + h <= red.shape[1] + 1e-4
                    if w >= 3 and h >= 3:  # a box left with pixels: its middle is red
                        assert red[row, int(y + h / 2), int(x + w / 2)]
                    top, left = max(0, int(y) - 1), max(0, int(x) - 1)
                    inside[top : int(np.ceil(y + h)) + 1, left : int(np.ceil(x + w)) + 1] = True
                    checked += 1
                assert not red[row][~inside].any()  # no red outside the moved boxes
                assert not batch["boxes"][row, count:].any()  # rows past the length stay zero
                assert batch["labels"][row, :count].tolist() == [7] * count  # fields beside boxes keep their rows
    assert checked > 40 and plain


def test_augment_that_cannot_move_boxes_is_refused_with_boxes_read(boxed):
    def shift(images, indices, epoch, seed):
        return images.roll(1, -1)

    with pytest.raises(OptionError, match="cannot move the boxes of boxes with their images"):
        make_loader(open_dataset(boxed), 8, device="cpu", augment=shift)
    batch = next(iter(make_loader(open_dataset(boxed, fields=["image", "labels"]), 8, device="cpu", augment=shift)))
    assert set(batch) == {"image", "labels", "labels_lengths"}


def test_a_box_field_must_name_an_image_field(tmp_path):
    with pytest.raises(OptionError, match="holds the boxes of 'picture', which is not an image field"):
        write([], tmp_path / "x.h5", {"boxes": Field("ragged", shape=(4,), boxes="picture"), "picture": "str"})
    with pytest.raises(OptionError, match="on a ragged field of shape .4,."):
        write([], tmp_path / "x.h5", {"boxes": Field("ragged", shape=(2,), boxes="image"),
                                      "image": Field("image", size=(8, 8))})


def test_augment_over_two_image_fields_asks_for_one(tmp_path):
    pixels = np.zeros((8, 8, 3), np.uint8)
    write([{"a": pixels, "b": pixels}], tmp_path / "two.h5", {"a": Field("image", size=(8, 8)),
                                                             "b": Field("image", size=(8, 8))})
    with pytest.raises(OptionError, match="reads the image fields a, b; pick one"):
        make_loader(open_dataset(tmp_path / "two.h5"), 1, device="cpu", augment=CenterCrop(4))
    batch = next(iter(make_loader(open_dataset(tmp_path / "two.h5", fields=["b"]), 1, device="cpu",
                                  augment=CenterCrop(4))))
    assert batch["b"].shape == (1, 3, 4, 4)
