"""Batched, seeded augmentation: parameters in range, reproducible per sample, equal to per-sample references."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdata import open_dataset
from fastdata.errors import OptionError
from fastdata.loading.augment import (
    CenterCrop,
    Compose,
    Normalize,
    RandomCrop,
    RandomResizedCrop,
    sample_uniforms,
)

# RRC against crop + interpolate, in 0..255 units. Both sample the same positions, but grid_sample reaches them
# through normalized float32 coordinates ((2x + 1) / W - 1 and back), interpolate through a float32 scale: the
# positions differ by ~1e-5 px at 300 px, so a pixel by at most ~255 * 2e-5; measured worst 0.005 over these tests.
RRC_TOLERANCE = 0.01

sides = st.integers(1, 300)
index_lists = st.lists(st.integers(0, 2**62), min_size=1, max_size=40, unique=True)


def uint8_batch(batch, height, width, seed=0, channels_last=False):
    images = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (batch, 3, height, width), dtype=np.uint8))
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


def random_crop_reference(images, indices, epoch, seed, size, padding, fill=0):
    """Per sample: pad, slice the window sample_uniforms' draws 0 and 1 pick, flip on draw 2 (torchvision-style)."""
    rows = []
    for image, draws in zip(images, sample_uniforms(seed, epoch, indices, 3)):
        padded = F.pad(image, (padding,) * 4, value=fill)
        top = min(int(draws[0] * (padded.shape[1] - size + 1)), padded.shape[1] - size)
        left = min(int(draws[1] * (padded.shape[2] - size + 1)), padded.shape[2] - size)
        crop = padded[:, top:top + size, left:left + size]
        rows.append(crop.flip(-1) if draws[2] < 0.5 else crop)
    return torch.stack(rows)


def resized_crop_reference(images, boxes, flips, size):
    """Per sample: slice the box, bilinear interpolate (align_corners=False, no antialias), flip."""
    rows = []
    for image, (top, left, h, w), flip in zip(images, boxes, flips):
        crop = image[None, :, top:top + h, left:left + w].float()
        out = F.interpolate(crop, size=size, mode="bilinear", align_corners=False, antialias=False)[0]
        rows.append(out.flip(-1) if flip else out)
    return torch.stack(rows)


# ---------------------------------------------------------------- sample_uniforms


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(-2**63, 2**64), epoch=st.integers(0, 10**6), indices=index_lists, count=st.integers(1, 50))
def test_uniforms_are_in_range_and_a_function_of_seed_epoch_and_index_alone(seed, epoch, indices, count):
    indices = np.array(indices, dtype=np.int64)
    draws = sample_uniforms(seed, epoch, indices, count)
    assert draws.shape == (len(indices), count) and draws.dtype == np.float64
    assert (draws >= 0).all() and (draws < 1).all()
    assert np.array_equal(draws, sample_uniforms(seed, epoch, indices, count))
    assert np.array_equal(draws[::-1], sample_uniforms(seed, epoch, indices[::-1], count))  # rows stand alone
    assert np.array_equal(draws[:, :1], sample_uniforms(seed, epoch, indices, 1))  # draw j does not depend on count


def test_uniforms_differ_across_seed_epoch_index_and_draw_and_look_uniform():
    base = sample_uniforms(0, 0, np.arange(20000), 4)
    assert len(np.unique(base)) == base.size  # 80,000 distinct 53-bit draws
    for other in (sample_uniforms(1, 0, np.arange(20000), 4), sample_uniforms(0, 1, np.arange(20000), 4),
                  sample_uniforms(0, 0, np.arange(1, 20001), 4)):
        assert np.abs(other - base).min() > 0
        assert abs(np.corrcoef(other.ravel(), base.ravel())[0, 1]) < 0.02
    counts = np.histogram(base, bins=20, range=(0, 1))[0]
    assert ((counts - 4000) ** 2 / 4000).sum() < 43.8  # chi-square, 19 dof, 99.9% quantile
    assert abs(np.corrcoef(base[:, 0], base[:, 1])[0, 1]) < 0.03  # draws of one sample are not correlated


# ---------------------------------------------------------------- RandomResizedCrop parameters


@settings(max_examples=200, deadline=None)
@given(height=sides, width=sides, indices=index_lists, epoch=st.integers(0, 100),
       scale=st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 1.0)).map(sorted),
       ratio=st.tuples(st.floats(0.1, 10.0), st.floats(0.1, 10.0)).map(sorted))
def test_boxes_lie_inside_the_image_and_keep_area_and_ratio_unless_they_fall_back(
        height, width, indices, epoch, scale, ratio):
    rrc = RandomResizedCrop(8, scale=scale, ratio=ratio)
    indices = np.array(indices, dtype=np.int64)
    boxes = rrc.boxes(7, epoch, indices, height, width)
    assert boxes.shape == (len(indices), 4) and boxes.dtype == np.int64
    top, left, h, w = boxes.T
    assert (h >= 1).all() and (w >= 1).all() and (top >= 0).all() and (left >= 0).all()
    assert (top + h <= height).all() and (left + w <= width).all()
    # a box not from the fallback was rounded from an area in scale and a ratio in ratio (rounding: +-0.5 px a side)
    fall_h, fall_w = rrc._fallback(np.array([height]), np.array([width]))
    fallback = (h == fall_h) & (w == fall_w) & (top == (height - h) // 2) & (left == (width - w) // 2)
    drawn = ~fallback
    area = height * width
    assert ((h[drawn] - 0.5) * (w[drawn] - 0.5) <= scale[1] * area * (1 + 1e-9)).all()
    assert ((h[drawn] + 0.5) * (w[drawn] + 0.5) >= scale[0] * area * (1 - 1e-9)).all()
    assert ((w[drawn] - 0.5) / (h[drawn] + 0.5) <= ratio[1] * (1 + 1e-9)).all()
    assert ((w[drawn] + 0.5) / (h[drawn] - 0.5 + 1e-12) >= ratio[0] * (1 - 1e-9)).all()


@pytest.mark.parametrize(("height", "width", "ratio", "expected"), [
    (100, 100, (5.0, 6.0), (40, 0, 20, 100)),  # square, ratios over 5: w = W, h = round(W / 5), centred
    (20, 200, (0.5, 2.0), (0, 80, 20, 40)),  # wider than the max ratio: h = H, w = round(H * 2)
    (200, 20, (0.5, 2.0), (80, 0, 40, 20)),  # taller than the min ratio: w = W, h = round(W / 0.5)
])
def test_boxes_fall_back_to_torchvisions_centre_crop_when_no_try_fits(height, width, ratio, expected):
    # an area of 90-100% at these ratios never fits: every sample falls back
    boxes = RandomResizedCrop(8, scale=(0.9, 1.0), ratio=ratio).boxes(0, 0, np.arange(50), height, width)
    assert (boxes == np.array(expected)).all()


def test_boxes_match_torchvisions_get_params_run_on_the_same_draws():
    rrc = RandomResizedCrop(8, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
    indices = np.arange(300)
    for height, width in ((375, 500), (20, 400), (33, 33)):
        draws = sample_uniforms(3, 2, indices, 41)
        expected = [torchvision_get_params(height, width, row, rrc.scale, rrc.ratio) for row in draws]
        assert np.array_equal(rrc.boxes(3, 2, indices, height, width), np.array(expected))


def torchvision_get_params(height, width, draws, scale, ratio):
    """torchvision.transforms.RandomResizedCrop.get_params, with its torch draws replaced by ``draws``."""
    import math

    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for attempt in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * draws[attempt])
        aspect_ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * draws[10 + attempt])
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            return (min(int(draws[20 + attempt] * (height - h + 1)), height - h),
                    min(int(draws[30 + attempt] * (width - w + 1)), width - w), h, w)
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def test_a_samples_crop_does_not_depend_on_its_batch_and_changes_with_the_epoch():
    rrc = RandomResizedCrop(16)
    alone = rrc.boxes(0, 4, np.array([3, 7]), 375, 500)[1]
    assert np.array_equal(rrc.boxes(0, 4, np.array([7, 9, 11]), 375, 500)[0], alone)
    assert np.array_equal(rrc.boxes(0, 4, torch.tensor([11, 7]), 375, 500)[1], alone)  # a tensor of indices too
    epochs = np.stack([rrc.boxes(0, epoch, np.arange(100), 375, 500) for epoch in range(3)])
    assert (epochs[0] != epochs[1]).any(axis=1).mean() > 0.95 and (epochs[1] != epochs[2]).any(axis=1).mean() > 0.95
    flips = np.stack([rrc.flips(0, epoch, np.arange(1000)) for epoch in range(2)])
    assert 0.45 < flips.mean() < 0.55 and (flips[0] != flips[1]).mean() > 0.4
    assert not RandomResizedCrop(16, flip=False).flips(0, 0, np.arange(100)).any()


def test_boxes_take_one_size_per_sample():
    rrc = RandomResizedCrop(16)
    heights, widths = np.array([50, 375, 17]), np.array([400, 500, 17])
    boxes = rrc.boxes(1, 1, np.array([5, 6, 7]), heights, widths)
    for i in range(3):
        assert np.array_equal(boxes[i], rrc.boxes(1, 1, np.array([5 + i]), heights[i], widths[i])[0])


# ---------------------------------------------------------------- transforms against per-sample references


@settings(max_examples=40, deadline=None)
@given(height=st.integers(1, 40), width=st.integers(1, 40), size=st.integers(1, 24), padding=st.integers(0, 6),
       indices=index_lists, channels_last=st.booleans(), fill=st.integers(0, 255))
def test_random_crop_equals_pad_slice_and_flip_per_sample(height, width, size, padding, indices, channels_last, fill):
    if size > min(height, width) + 2 * padding:
        with pytest.raises(OptionError, match="larger than the padded images"):
            RandomCrop(size, padding)(uint8_batch(1, height, width), [0], 0, 0)
        return
    indices = np.array(indices, dtype=np.int64)
    images = uint8_batch(len(indices), height, width, channels_last=channels_last)
    out = RandomCrop(size, padding, fill=fill)(images, indices, 2, 9)
    assert out.dtype == torch.uint8 and out.shape == (len(indices), 3, size, size) and out.is_contiguous()
    assert torch.equal(out, random_crop_reference(images, indices, 2, 9, size, padding, fill))


def test_random_crop_without_flip_or_padding_and_with_a_rectangle():
    images = uint8_batch(25, 30, 40)[5:]  # a view into its storage: the windows start at its offset
    out = RandomCrop((10, 30), padding=0, flip=False)(images, np.arange(20), 0, 0)
    draws = sample_uniforms(0, 0, np.arange(20), 3)
    for i, (row, col) in enumerate(zip((draws[:, 0] * 21).astype(int), (draws[:, 1] * 11).astype(int))):
        assert torch.equal(out[i], images[i, :, row:row + 10, col:col + 30])


@settings(max_examples=30, deadline=None)
@given(height=st.integers(1, 300), width=st.integers(1, 300), out_h=st.integers(1, 48), out_w=st.integers(1, 48),
       indices=st.lists(st.integers(0, 10**9), min_size=1, max_size=6, unique=True), channels_last=st.booleans())
def test_random_resized_crop_equals_crop_then_interpolate_per_sample(height, width, out_h, out_w, indices,
                                                                   channels_last):
    rrc = RandomResizedCrop((out_h, out_w), scale=(0.01, 1.0))
    indices = np.array(indices, dtype=np.int64)
    images = uint8_batch(len(indices), height, width, seed=len(indices), channels_last=channels_last)
    out = rrc(images, indices, 1, 3)
    assert out.dtype == torch.float32 and out.shape == (len(indices), 3, out_h, out_w)
    assert out.is_contiguous()
    expected = resized_crop_reference(images, rrc.boxes(3, 1, indices, height, width), rrc.flips(3, 1, indices),
                                      (out_h, out_w))
    torch.testing.assert_close(out, expected, rtol=0, atol=RRC_TOLERANCE)


def test_random_resized_crop_keeps_a_float_dtype_and_its_row_results_stand_alone():
    images = uint8_batch(3, 60, 90).double()
    rrc = RandomResizedCrop(20)
    out = rrc(images, np.array([3, 7, 9]), 0, 0)
    assert out.dtype == torch.float64
    half = rrc(images.half(), np.array([3, 7, 9]), 0, 0)  # computed in float32, returned in float16
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.double(), out, rtol=0, atol=0.25)  # 256 in float16: steps of 0.25
    torch.testing.assert_close(rrc(images[1:], np.array([7, 9]), 0, 0), out[1:], rtol=0, atol=1e-9)
    assert not torch.equal(rrc(images, np.array([3, 7, 9]), 1, 0), out)  # the next epoch crops elsewhere


@pytest.mark.parametrize(("height", "width", "size"), [(32, 32, 24), (33, 40, 24), (256, 256, (224, 200)), (7, 9, 7)])
def test_center_crop_is_a_slice_with_torchvisions_rounding(height, width, size):
    images = uint8_batch(4, height, width)
    out = CenterCrop(size)(images, np.arange(4), 0, 0)
    out_h, out_w = (size, size) if isinstance(size, int) else size
    top, left = int(round((height - out_h) / 2)), int(round((width - out_w) / 2))
    assert torch.equal(out, images[:, :, top:top + out_h, left:left + out_w])
    with pytest.raises(OptionError, match="larger than the images"):
        CenterCrop(height + 1)(images)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("channels_last_input", [False, True])
def test_normalize_equals_the_formula_in_dtype_and_memory_format(dtype, memory_format, channels_last_input):
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    images = uint8_batch(5, 17, 23, channels_last=channels_last_input)
    out = Normalize(mean, std, dtype=dtype, memory_format=memory_format)(images, np.arange(5), 0, 0)
    expected = (images.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert out.dtype == dtype and out.is_contiguous(memory_format=memory_format)
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 2e-6)  # a float32 rounding, then the cast
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_normalize_takes_rrc_floats_in_0_255_units_and_rejects_bad_options():
    images = uint8_batch(2, 8, 8)
    normalize = Normalize([0.5] * 3, [0.25] * 3)
    torch.testing.assert_close(normalize(images.float()), normalize(images))
    with pytest.raises(OptionError, match="std > 0"):
        Normalize([0.5] * 3, [0.0, 1.0, 1.0])
    with pytest.raises(OptionError, match="floating dtype"):
        Normalize([0.5] * 3, [0.5] * 3, dtype=torch.uint8)
    with pytest.raises(OptionError, match="1 channel means"):
        Normalize([0.5], [0.5])(images)


def test_compose_applies_in_order_with_the_same_indices_epoch_and_seed():
    images, indices = uint8_batch(6, 40, 40), np.arange(10, 16)
    crop, normalize = RandomCrop(32, padding=2), Normalize([0.1, 0.2, 0.3], [0.3, 0.2, 0.1])
    out = Compose(crop, normalize)(images, indices, 5, 1)
    assert torch.equal(out, normalize(crop(images, indices, 5, 1)))
    assert not torch.equal(out, crop(normalize(images), indices, 5, 1))  # that order pads with 0 after normalizing
    assert "RandomCrop(size=(32, 32)" in repr(Compose(crop, normalize))


def test_bad_options_and_batches_are_refused():
    with pytest.raises(OptionError, match="size should be"):
        RandomCrop(0)
    with pytest.raises(OptionError, match="padding should be"):
        RandomCrop(8, padding=-1)
    with pytest.raises(OptionError, match="low <= high"):
        RandomResizedCrop(8, scale=(1.0, 0.5))
    with pytest.raises(OptionError, match="positive"):
        RandomResizedCrop(8, ratio=(0.0, 1.0))
    with pytest.raises(OptionError, match="2 indices for a batch of 3"):
        RandomResizedCrop(8)(uint8_batch(3, 8, 8), [0, 1], 0, 0)
    with pytest.raises(OptionError, match=r"\[B, C, H, W\]"):
        RandomCrop(8)(uint8_batch(1, 8, 8)[0], [0], 0, 0)


def test_the_jpeg_decoders_channels_last_batches_go_through_the_imagenet_recipe(packed_files):
    dataset = open_dataset(packed_files("hdf5", "jpeg"))
    indices = np.arange(len(dataset))
    images, labels = dataset.read_batch(indices)
    assert images.dtype == torch.uint8 and images.is_contiguous(memory_format=torch.channels_last)
    recipe = Compose(RandomResizedCrop(24), Normalize([0.5] * 3, [0.2] * 3))
    out = recipe(images, indices, 0, 0)
    assert out.shape == (len(indices), 3, 24, 24) and out.dtype == torch.float32 and torch.isfinite(out).all()
    expected = resized_crop_reference(images, recipe.transforms[0].boxes(0, 0, indices, *images.shape[2:]),
                                      recipe.transforms[0].flips(0, 0, indices), (24, 24))
    torch.testing.assert_close(out, recipe.transforms[1](expected), rtol=0, atol=RRC_TOLERANCE / 255 / 0.2)
    cifar = RandomCrop(images.shape[-1], padding=4)(images, indices, 0, 0)
    assert torch.equal(cifar, random_crop_reference(images, indices, 0, 0, images.shape[-1], 4))


@pytest.mark.parametrize("transform", [RandomCrop(8), RandomResizedCrop(8), CenterCrop(8),
                                       Compose(RandomResizedCrop(8), Normalize([0.5] * 3, [0.5] * 3))],
                         ids=repr)
def test_an_empty_batch_gives_an_empty_batch_of_the_output_size(transform):
    out = transform(uint8_batch(0, 12, 12), np.zeros(0, dtype=np.int64), 0, 0)
    assert out.shape == (0, 3, 8, 8)
