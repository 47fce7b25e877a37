"""fastdata.codecs.images: the reference preprocessing (draft, EXIF, to_rgb, resize)."""

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image, ImageOps

from fastdata.codecs import images
from fastdata.codecs.images import ImageSpec, decode_jpeg, encode_jpeg, load_image, resize, to_rgb
from fastdata.measure.synthetic import make_photo

WHITE = (255, 255, 255)
RED, GREEN, BLUE, BLACK = (255, 0, 0), (0, 255, 0), (0, 0, 255), (0, 0, 0)


def rgb(img):
    """``to_rgb(img)`` as an array, checking that it really is 8-bit RGB."""
    out = to_rgb(img)
    assert out.mode == "RGB"
    assert out.size == img.size
    return np.asarray(out)


def same_size(img):
    """A spec that keeps ``img``'s size, so load_image's result is just its colours."""
    return ImageSpec(img.height, img.width, resize="stretch", resample="nearest")


# ---------------------------------------------------------------- to_rgb


def grayscale_l():
    return Image.fromarray(np.array([[0, 77, 255]], np.uint8), "L"), [[BLACK, (77, 77, 77), WHITE]]


def palette_with_transparency():
    img = Image.new("P", (3, 1))
    img.putpalette([*RED, *GREEN, *BLUE] + [0] * (253 * 3))
    img.putdata([0, 1, 2])
    img.info["transparency"] = 1  # palette entry 1 (green) is fully transparent
    return img, [[RED, WHITE, BLUE]]


def rgba():
    pixels = np.array([[(255, 0, 0, 0), (0, 0, 255, 255), (10, 20, 30, 255)]], np.uint8)
    return Image.fromarray(pixels, "RGBA"), [[WHITE, BLUE, (10, 20, 30)]]


def la():
    pixels = np.array([[(0, 0), (50, 255), (200, 0)]], np.uint8)
    return Image.fromarray(pixels, "LA"), [[WHITE, (50, 50, 50), WHITE]]


def cmyk():
    img = Image.new("CMYK", (3, 1))
    img.putdata([(0, 0, 0, 0), (0, 255, 255, 0), (0, 0, 0, 255)])
    return img, [[WHITE, RED, BLACK]]


def sixteen_bit():
    img = Image.fromarray(np.array([[65535, 256, 0, 511]], np.uint16))
    return img, [[WHITE, (1, 1, 1), BLACK, (1, 1, 1)]]


def one_bit():
    img = Image.new("1", (3, 1))
    img.putdata([0, 255, 0])
    return img, [[BLACK, WHITE, BLACK]]


MODES = {
    "L": grayscale_l,
    "P+transparency": palette_with_transparency,
    "RGBA": rgba,
    "LA": la,
    "CMYK": cmyk,
    "I;16": sixteen_bit,
    "1": one_bit,
}


@pytest.mark.parametrize("make", MODES.values(), ids=MODES.keys())
def test_to_rgb_converts_every_mode(make):
    img, expected = make()
    assert rgb(img).tolist() == [[list(p) for p in row] for row in expected]


@pytest.mark.parametrize(
    "make, suffix",
    [
        (grayscale_l, ".png"),
        (palette_with_transparency, ".png"),
        (rgba, ".png"),
        (la, ".png"),
        (sixteen_bit, ".png"),
        (one_bit, ".png"),
        (one_bit, ".bmp"),
        (cmyk, ".tiff"),
    ],
    ids=["L.png", "P.png", "RGBA.png", "LA.png", "I16.png", "1.png", "1.bmp", "CMYK.tiff"],
)
def test_load_image_converts_every_mode_from_disk(tmp_path, make, suffix):
    img, expected = make()
    path = tmp_path / f"image{suffix}"
    img.save(path)
    out = load_image(path, same_size(img))
    assert out.dtype == np.uint8 and out.shape == (img.height, img.width, 3)
    assert out.tolist() == [[list(p) for p in row] for row in expected]


def test_sixteen_bit_png_reopens_as_16_bit(tmp_path):
    # Guard for the test above: the PNG really is 16-bit when Pillow reads it.
    img, _ = sixteen_bit()
    img.save(tmp_path / "deep.png")
    with Image.open(tmp_path / "deep.png") as reopened:
        assert reopened.mode in ("I;16", "I")
        assert reopened.getpixel((0, 0)) == 65535
    assert load_image(tmp_path / "deep.png", same_size(img))[0, :, 0].tolist() == [255, 1, 0, 1]


def test_big_endian_16_bit_tiff(tmp_path):
    Image.fromarray(np.array([[65535, 256, 0, 511]], ">u2")).save(tmp_path / "deep.tiff")
    with Image.open(tmp_path / "deep.tiff") as reopened:
        assert reopened.mode == "I;16B"
    out = load_image(tmp_path / "deep.tiff", ImageSpec(1, 4, resize="stretch", resample="nearest"))
    assert out[0].tolist() == [[255] * 3, [1] * 3, [0] * 3, [1] * 3]


def test_32_bit_and_float_modes_are_clipped():
    assert rgb(Image.fromarray(np.array([[70000, 65535, 256]], np.int32)))[0, :, 0].tolist() == [255, 255, 1]
    assert rgb(Image.fromarray(np.array([[300.5, -3, 100.7]], np.float32)))[0, :, 0].tolist() == [255, 0, 100]


def test_transparent_gif_is_composited(tmp_path):
    img, expected = palette_with_transparency()
    img.save(tmp_path / "t.gif")
    out = load_image(tmp_path / "t.gif", same_size(img))
    assert out.tolist() == [[list(p) for p in row] for row in expected]


def test_cmyk_jpeg(tmp_path):
    img, expected = cmyk()
    img.save(tmp_path / "cmyk.jpg", quality=100)
    out = load_image(tmp_path / "cmyk.jpg", same_size(img)).astype(int)
    assert np.abs(out - np.array(expected)).max() <= 3


def test_palette_with_partial_alpha(tmp_path):
    img, _ = palette_with_transparency()
    img.info["transparency"] = bytes([0, 128, 255])  # alpha per palette entry
    img.save(tmp_path / "alpha.png")
    out = load_image(tmp_path / "alpha.png", same_size(img)).astype(int)
    assert out[0, 0].tolist() == list(WHITE)  # red, fully transparent
    assert np.abs(out[0, 1] - (127, 255, 127)).max() <= 1  # green, half transparent
    assert out[0, 2].tolist() == list(BLUE)  # blue, opaque


def test_half_transparent_pixel_blends_with_background():
    img = Image.fromarray(np.array([[(0, 0, 0, 128)]], np.uint8), "RGBA")
    (value,) = set(rgb(img)[0, 0].tolist())
    assert 126 <= value <= 128


def test_to_rgb_uses_the_given_background():
    img, _ = rgba()
    out = np.asarray(to_rgb(img, background=(10, 20, 30)))
    assert out[0, 0].tolist() == [10, 20, 30]  # transparent
    assert out[0, 1].tolist() == list(BLUE)  # opaque


def test_to_rgb_returns_rgb_unchanged():
    img = Image.new("RGB", (2, 2), (1, 2, 3))
    assert to_rgb(img) is img


# ---------------------------------------------------------------- EXIF orientation


def test_exif_orientation_is_applied(tmp_path):
    # Stored 60 wide x 40 tall: top half red, bottom half blue. Orientation 6
    # says "rotate 90 degrees clockwise to display": 40 wide x 60 tall with
    # the red half on the right.
    pixels = np.zeros((40, 60, 3), np.uint8)
    pixels[:20] = RED
    pixels[20:] = BLUE
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.jpg"
    Image.fromarray(pixels, "RGB").save(path, exif=exif, quality=95)
    with Image.open(path) as check:
        assert check.size == (60, 40) and check.getexif()[0x0112] == 6

    out = load_image(path, ImageSpec(60, 40, resize="stretch")).astype(int)
    assert out.shape == (60, 40, 3)
    assert np.abs(out[:, :15] - BLUE).max() < 40  # left: what was the bottom
    assert np.abs(out[:, -15:] - RED).max() < 40  # right: what was the top


def test_exif_orientation_changes_the_crop(tmp_path):
    # The same pixels without the tag are read as stored (landscape).
    pixels = np.zeros((40, 60, 3), np.uint8)
    pixels[:20] = RED
    pixels[20:] = BLUE
    Image.fromarray(pixels, "RGB").save(tmp_path / "plain.jpg", quality=95)
    out = load_image(tmp_path / "plain.jpg", ImageSpec(60, 40, resize="stretch")).astype(int)
    assert np.abs(out[:20] - RED).max() < 40
    assert np.abs(out[-20:] - BLUE).max() < 40


# ---------------------------------------------------------------- resize


def three_bands(width=120, height=60, inner=(26, 94)):
    """Red | green | blue vertical bands; green covers columns ``inner``."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, : inner[0]] = RED
    pixels[:, inner[0] : inner[1]] = GREEN
    pixels[:, inner[1] :] = BLUE
    return Image.fromarray(pixels, "RGB")


@pytest.mark.parametrize("mode", ["crop", "pad", "stretch"])
@pytest.mark.parametrize("height, width", [(32, 32), (20, 36), (48, 16), (1, 1)])
@pytest.mark.parametrize("source", [(120, 60), (60, 120), (7, 5), (33, 32)])
def test_every_resize_mode_gives_the_exact_size(mode, height, width, source):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (source[1], source[0], 3), np.uint8))
    out = resize(img, ImageSpec(height, width, resize=mode))
    assert out.mode == "RGB" and out.size == (width, height)


def test_crop_keeps_the_centre():
    out = np.asarray(resize(three_bands(), ImageSpec(32, 32, resize="crop")))
    assert (out == GREEN).all()


def test_crop_of_a_tall_image_keeps_the_middle_rows():
    img = three_bands().transpose(Image.Transpose.TRANSPOSE)  # bands now horizontal, 60x120
    out = np.asarray(resize(img, ImageSpec(32, 32, resize="crop")))
    assert (out == GREEN).all()


def test_pad_puts_the_background_in_the_borders():
    img = Image.new("RGB", (120, 60), BLACK)  # 2:1 into 32x32: content 32x16, rows 8..23
    out = np.asarray(resize(img, ImageSpec(32, 32, resize="pad")))
    assert (out[:8] == WHITE).all() and (out[24:] == WHITE).all()
    assert (out[8:24] == BLACK).all()


def test_pad_of_a_tall_image_pads_left_and_right():
    img = Image.new("RGB", (60, 120), BLACK)
    out = np.asarray(resize(img, ImageSpec(32, 32, resize="pad", background=(9, 8, 7))))
    assert (out[:, :8] == (9, 8, 7)).all() and (out[:, 24:] == (9, 8, 7)).all()
    assert (out[:, 8:24] == BLACK).all()


def test_pad_keeps_everything():
    out = np.asarray(resize(three_bands(), ImageSpec(32, 32, resize="pad")))
    content = out[8:24]
    for colour, column in ((RED, 2), (GREEN, 16), (BLUE, 29)):
        assert (content[:, column] == colour).all()


def test_stretch_keeps_everything_and_fills_the_frame():
    out = np.asarray(resize(three_bands(), ImageSpec(32, 32, resize="stretch")))
    for colour, column in ((RED, 2), (GREEN, 16), (BLUE, 29)):
        assert (out[:, column] == colour).all()
    assert not (out == WHITE).all(axis=-1).any()


@pytest.mark.parametrize("mode", ["crop", "pad", "stretch"])
def test_load_image_resizes_a_file(tmp_path, mode):
    three_bands().save(tmp_path / "bands.png")
    out = load_image(tmp_path / "bands.png", ImageSpec(32, 32, resize=mode))
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8
    assert np.array_equal(out, np.asarray(resize(three_bands(), ImageSpec(32, 32, resize=mode))))


# ---------------------------------------------------------------- JPEG draft


@pytest.fixture(scope="module")
def big_jpeg(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "big.jpg"
    make_photo(np.random.default_rng(1), 1600, 1200).save(path, quality=90)
    return path


def test_draft_decodes_a_big_jpeg_at_reduced_scale(big_jpeg):
    spec = ImageSpec(64, 64)
    with Image.open(big_jpeg) as img:
        img.draft(None, (64, 64))
        img.load()
        assert img.size == (200, 150)  # 1/8 scale: the smallest not below 64x64
        manual = np.asarray(resize(to_rgb(ImageOps.exif_transpose(img)), spec))
    assert np.array_equal(load_image(big_jpeg, spec), manual)


def test_draft_result_is_close_to_a_full_decode(big_jpeg):
    spec = ImageSpec(64, 64)
    with Image.open(big_jpeg) as img:
        full = np.asarray(resize(to_rgb(img.convert("RGB")), spec)).astype(int)
    drafted = load_image(big_jpeg, spec).astype(int)
    assert np.abs(drafted - full).mean() < 4


@pytest.mark.parametrize("height, width", [(300, 300), (100, 400), (400, 100), (150, 200)])
def test_draft_never_decodes_below_the_target(big_jpeg, height, width):
    spec = ImageSpec(height, width)
    longest = max(height, width)
    with Image.open(big_jpeg) as img:
        img.draft(None, (longest, longest))
        assert img.size[0] >= width and img.size[1] >= height
    assert load_image(big_jpeg, spec).shape == (height, width, 3)


# ---------------------------------------------------------------- ImageSpec and JPEG helpers


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"height": 0, "width": 4}, "size should be positive"),
        ({"height": 4, "width": -1}, "size should be positive"),
        ({"height": 4, "width": 4, "resize": "fit"}, "resize should be one of"),
        ({"height": 4, "width": 4, "resample": "cubic"}, "resample should be one of"),
    ],
)
def test_image_spec_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImageSpec(**kwargs)


def test_image_spec_to_dict_is_json_ready():
    assert ImageSpec(3, 4, background=(1, 2, 3)).to_dict() == {
        "height": 3,
        "width": 4,
        "resize": "crop",
        "resample": "bilinear",
        "background": [1, 2, 3],
    }


def test_jpeg_round_trip_and_decode_into_out():
    pixels = np.asarray(make_photo(np.random.default_rng(2), 64, 48))
    data = encode_jpeg(pixels, 95)
    assert data[:2] == b"\xff\xd8"
    decoded = decode_jpeg(data)
    assert decoded.shape == (48, 64, 3) and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(int) - pixels).mean() < 8  # noisy photo, 4:2:0 chroma
    out = np.zeros((48, 64, 3), np.uint8)
    assert np.shares_memory(decode_jpeg(data, out), out)
    assert np.array_equal(out, decoded)


def test_lower_quality_gives_smaller_files():
    pixels = np.asarray(make_photo(np.random.default_rng(3), 64, 48))
    assert len(encode_jpeg(pixels, 30)) < len(encode_jpeg(pixels, 95))


# ---------------------------------------------------------------- full-scale JPEG through simplejpeg


def full_scale_jpegs(folder):
    """JPEGs that load_image decodes at full scale: plain, progressive, 4:4:4, EXIF-rotated, with extra bytes."""
    photo = make_photo(np.random.default_rng(4), 300, 200)
    exif = Image.Exif()
    exif[0x0112] = 6
    paths = {}
    for name, options in [("plain", {}), ("progressive", {"progressive": True}), ("444", {"subsampling": 0}),
                          ("rotated", {"exif": exif})]:
        paths[name] = folder / f"{name}.jpg"
        photo.save(paths[name], quality=90, **options)
    # Bytes between two markers: libjpeg warns ("extraneous bytes") and decodes.
    data = paths["plain"].read_bytes()
    scan = data.index(b"\xff\xda")
    paths["extra-bytes"] = folder / "extra-bytes.jpg"
    paths["extra-bytes"].write_bytes(data[:scan] + b"\x00\x00\x00" + data[scan:])
    return paths


def test_full_scale_jpegs_load_the_same_with_and_without_simplejpeg(tmp_path, monkeypatch):
    pytest.importorskip("simplejpeg")
    spec = ImageSpec(180, 180)  # no draft below 300x200: decoded at full scale
    paths = full_scale_jpegs(tmp_path)
    simplejpeg, tried = images._simplejpeg, []

    def spy(data, **options):
        tried.append(len(data))
        return simplejpeg.decode_jpeg(data, **options)

    monkeypatch.setattr("fastdata.codecs.images._simplejpeg", SimpleNamespace(decode_jpeg=spy))
    fast = {name: load_image(path, spec) for name, path in paths.items()}
    assert len(tried) == len(paths)  # every one went to simplejpeg first (extra-bytes then to Pillow)
    monkeypatch.setattr("fastdata.codecs.images._simplejpeg", None)
    for name, path in paths.items():
        assert np.array_equal(fast[name], load_image(path, spec)), name
    assert fast["rotated"].shape == (180, 180, 3) and not np.array_equal(fast["rotated"], fast["plain"])
