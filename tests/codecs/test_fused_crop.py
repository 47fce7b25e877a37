"""decode_jpeg_resized_crop: the box decoded at the smallest DCT scale, against a full decode cropped and resized."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from fastdata.codecs import images
from fastdata.codecs.images import dct_scale, decode_jpeg, decode_jpeg_resized_crop, encode_jpeg, jpeg_size
from fastdata.measure.synthetic import make_photo

# Mean absolute error, in levels of 0-255, allowed against the full-size reference. libjpeg-turbo's scaled
# decode shrinks each 8x8 block in the DCT domain (a sharper filter than Pillow's antialiased bilinear), so
# the two differ at edges and in the noise; over 400 torchvision-style boxes of 20-700 px photos resized to
# 32-224 px the mean was 0.29 and the worst 1.9 (a 68x67 box to 32x32 at 1/2); arbitrary boxes: 0.09, worst 1.1.
# A box shifted by half a pixel fails it.
MEAN_ERROR_MAX = 2.5
examples = settings(max_examples=60, deadline=None, derandomize=True,  # the backend fixture holds for every example
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["simplejpeg", "pillow"])
def backend(request, monkeypatch):
    """Each decoding path: simplejpeg, and Pillow's draft where simplejpeg is not installed."""
    if request.param == "pillow":
        monkeypatch.setattr(images, "_simplejpeg", None)
    elif images._simplejpeg is None:
        pytest.skip("simplejpeg is not installed")
    return request.param


def photo_jpeg(width, height, seed=0):
    """Return JPEG bytes of a photo-like ``width`` x ``height`` image (shapes, edges, noise)."""
    return encode_jpeg(np.asarray(make_photo(np.random.default_rng(seed), width, height)), 90)


def reference(data, box, size):
    """Decode ``data`` at full size, then crop ``box`` and resize it to ``size`` with Pillow's bilinear filter."""
    top, left, height, width = box
    full = Image.fromarray(decode_jpeg(data), "RGB")
    return np.asarray(full.resize((size[1], size[0]), Image.Resampling.BILINEAR, box=(left, top, left + width,
                                                                                      top + height)))


def mean_error(a, b):
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


@st.composite
def images_and_boxes(draw):
    """An image of 8-700 px a side (aspect ratios up to 10:1), a box inside it and an output of 32-224 px a side."""
    width = draw(st.integers(8, 700))
    height = draw(st.integers(max(8, width // 10), min(700, width * 10)))
    box_height, box_width = draw(st.integers(1, height)), draw(st.integers(1, width))
    top, left = draw(st.integers(0, height - box_height)), draw(st.integers(0, width - box_width))
    size = (draw(st.integers(32, 224)), draw(st.integers(32, 224)))
    return width, height, (top, left, box_height, box_width), size


@examples
@given(case=images_and_boxes(), seed=st.integers(0, 2**16))
def test_fused_decode_is_the_full_decode_cropped_and_resized(backend, case, seed):
    width, height, box, size = case
    data = photo_jpeg(width, height, seed)
    fused = decode_jpeg_resized_crop(data, box, size)
    assert fused.shape == (*size, 3) and fused.dtype == np.uint8 and fused.flags.writeable
    assert mean_error(fused, reference(data, box, size)) < MEAN_ERROR_MAX


@examples
@given(seed=st.integers(0, 2**16), side=st.integers(120, 700), output=st.sampled_from([32, 64, 112, 128, 224]),
       area=st.floats(0.08, 1.0), log_ratio=st.floats(math.log(3 / 4), math.log(4 / 3)))
def test_torchvision_style_boxes_are_close_to_the_reference(seed, side, output, area, log_ratio):
    data = photo_jpeg(side, side * 3 // 4, seed)
    height, width = jpeg_size(data)
    box_width = min(width, round(math.sqrt(area * width * height * math.exp(log_ratio))))
    box_height = min(height, round(math.sqrt(area * width * height / math.exp(log_ratio))))
    box = ((height - box_height) // 3, (width - box_width) // 2, box_height, box_width)
    fused = decode_jpeg_resized_crop(data, box, (output, output))
    assert mean_error(fused, reference(data, box, (output, output))) < MEAN_ERROR_MAX


def test_a_box_of_the_output_size_is_an_exact_crop_of_the_full_decode(backend):
    # Scale 1 and no resizing: the float box mapping lands on whole pixels, so the pixels are the decoder's own.
    data = photo_jpeg(333, 251)
    full = decode_jpeg(data)
    for top, left, height, width in [(0, 0, 251, 333), (17, 40, 64, 48), (251 - 9, 333 - 5, 9, 5)]:
        fused = decode_jpeg_resized_crop(data, (top, left, height, width), (height, width))
        np.testing.assert_array_equal(fused, full[top : top + height, left : left + width])


def test_a_small_box_is_upscaled_from_the_full_size_decode(backend):
    data = photo_jpeg(400, 300)
    box, size = (100, 120, 40, 30), (224, 224)  # smaller than the output: scale 1, then bilinear upscaling
    assert dct_scale(box, size) == 8
    np.testing.assert_array_equal(decode_jpeg_resized_crop(data, box, size), reference(data, box, size))


def test_the_result_goes_into_out(backend):
    data = photo_jpeg(256, 256)
    out = np.zeros((2, 96, 80, 3), np.uint8)
    assert np.shares_memory(decode_jpeg_resized_crop(data, (10, 20, 200, 180), (96, 80), out=out[1]), out[1])
    np.testing.assert_array_equal(out[1], decode_jpeg_resized_crop(data, (10, 20, 200, 180), (96, 80)))
    assert not out[0].any()


@examples
@given(case=images_and_boxes(), seed=st.integers(0, 2**16))
def test_pillow_and_simplejpeg_give_the_same_pixels(monkeypatch, case, seed):
    # Both are libjpeg-turbo with the same settings at the same scales (see NOTE [fast DCT scales])
    if images._simplejpeg is None:
        pytest.skip("simplejpeg is not installed")
    width, height, box, size = case
    data = photo_jpeg(width, height, seed)
    turbo = decode_jpeg_resized_crop(data, box, size)
    with monkeypatch.context() as patch:
        patch.setattr(images, "_simplejpeg", None)
        np.testing.assert_array_equal(decode_jpeg_resized_crop(data, box, size), turbo)


# ---------------------------------------------------------------- the scale


@settings(max_examples=300, deadline=None, derandomize=True)
@given(box_height=st.integers(1, 4000), box_width=st.integers(1, 4000), height=st.integers(1, 500),
       width=st.integers(1, 500), scales=st.sampled_from([(1, 2, 4, 8), (1, 2, 3, 4, 5, 6, 7, 8), (3, 8)]))
def test_dct_scale_is_the_smallest_that_keeps_the_box_at_least_the_output(box_height, box_width, height, width,
                                                                         scales):
    m = dct_scale((0, 0, box_height, box_width), (height, width), scales)
    assert m in scales

    def keeps(k):
        return box_height * k / 8 >= height and box_width * k / 8 >= width

    assert keeps(m) or m == 8  # 8: the box is smaller than the output even at full size, and is upscaled
    assert not any(keeps(k) for k in scales if k < m)


@pytest.mark.parametrize(("box", "size", "m", "any_m"), [
    ((512, 512), (224, 224), 4, 4),  # 256 >= 224; 3/8 would give 192
    ((375, 500), (224, 224), 8, 5),  # 187 x 250 at 1/2 is too small; 5/8 would do (see NOTE [fast DCT scales])
    ((2000, 1600), (224, 224), 2, 2),  # 250 x 200 at 1/8 is below 224 wide
    ((1792, 1792), (224, 224), 1, 1),  # exactly 224 at 1/8
    ((100, 300), (224, 224), 8, 8),  # smaller than the output: full size
    ((300, 100), (28, 100), 8, 8),  # the width decides
])
def test_dct_scale_examples(box, size, m, any_m):
    box = (0, 0, *box)
    assert dct_scale(box, size) == m and dct_scale(box, size, tuple(range(1, 9))) == any_m


@pytest.mark.parametrize(("width", "height"), [(333, 251), (7, 5), (640, 64), (24, 480)])
def test_the_decode_lands_at_the_chosen_scale(backend, width, height):
    # libjpeg-turbo turns each 8x8 block into m x m pixels: sides ceil(side * m / 8) and coordinates x * m / 8
    data = photo_jpeg(width, height)
    assert jpeg_size(data) == (height, width)
    for m in images._DCT_SCALES:
        pixels, scale = images._decode_scaled(data, m)
        assert pixels.shape == (math.ceil(height * scale), math.ceil(width * scale), 3)
        if min(width, height) >= 8:
            assert scale == m / 8


def test_jpeg_size_reads_only_the_header(backend):
    data = photo_jpeg(123, 45)
    assert jpeg_size(data) == (45, 123)
    assert jpeg_size(memoryview(data)[: len(data) // 4]) == (45, 123)  # the pixels are not needed
