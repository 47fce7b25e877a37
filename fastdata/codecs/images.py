"""Pillow image preprocessing shared by the converter and the JPEG loader path.

Everything here works on numpy arrays and PIL images only (no torch), so that
converter worker processes start quickly.
"""

import functools
import io
import os
import stat
import warnings
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps

from fastdata._optional import optional
from fastdata.errors import OptionError

RESIZE_MODES = ("crop", "pad", "stretch")
RESAMPLE_FILTERS = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
_SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_simplejpeg = optional("simplejpeg")
_FILE_KINDS = {
    stat.S_ISDIR: "a folder",
    stat.S_ISFIFO: "a FIFO (named pipe)",
    stat.S_ISSOCK: "a socket",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
}


@functools.cache
def image_extensions():
    """Return the lower-case file extensions Pillow can open, sorted (".bmp", ..., ".jpg", ..., ".tga", ...).

    Taken from Pillow's registry, so every format it decodes converts. Stub
    formats (HDF5, GRIB, BUFR, WMF on most systems) are left out: Pillow
    recognises them but has no decoder for them.
    """
    registry = Image.registered_extensions()  # imports every plugin, once
    return tuple(sorted(ext for ext, name in registry.items() if name in Image.OPEN and not _is_stub(name)))


def _is_stub(name):
    factory = Image.OPEN[name][0]
    return isinstance(factory, type) and issubclass(factory, ImageFile.StubImageFile)


@dataclass(frozen=True)
class ImageSpec:
    """How every image is brought to one stored shape.

    Attributes:
        height, width: stored size in pixels.
        resize: "crop" (cover the size, then center crop), "pad" (fit inside,
            then pad with ``background``) or "stretch" (ignore aspect ratio).
        resample: a key of RESAMPLE_FILTERS.
        background: RGB colour behind transparent pixels and padding.
    """

    height: int
    width: int
    resize: str = "crop"
    resample: str = "bilinear"
    background: tuple = (255, 255, 255)

    def __post_init__(self):
        if self.height < 1 or self.width < 1:
            raise OptionError(f"size should be positive, got {self.height}x{self.width}")
        if self.resize not in RESIZE_MODES:
            raise OptionError(f"resize should be one of {RESIZE_MODES}, got {self.resize!r}")
        if self.resample not in RESAMPLE_FILTERS:
            raise OptionError(f"resample should be one of {tuple(RESAMPLE_FILTERS)}, got {self.resample!r}")

    def to_dict(self):
        return {**asdict(self), "background": list(self.background)}


def load_image(path, spec):
    """Decode ``path`` and preprocess it to ``spec``; return uint8 ``[H, W, 3]``.

    Raises whatever Pillow raises for an unusable file (OSError, ValueError,
    Image.DecompressionBombError, ...), and OSError for a path that is not
    a regular file (a FIFO would block the open forever); the caller reports it.
    """
    _check_regular_file(path)

    def read():
        with open(path, "rb") as file:
            return file.read()

    return _prepared(path, read, spec)


def load_image_bytes(data, spec):
    """Decode encoded image ``data`` (bytes of any format Pillow opens) as ``load_image`` decodes a file."""
    return _prepared(io.BytesIO(data), lambda: bytes(data), spec)


def prepare_pixels(img, spec):
    """Return the PIL image ``img`` (any mode) preprocessed to ``spec``: uint8 ``[H, W, 3]``; ``img`` is unchanged."""
    return np.asarray(resize(to_rgb(ImageOps.exif_transpose(img), spec.background), spec))


def _prepared(source, read, spec):
    """Open ``source`` (a path or file object) and preprocess it to ``spec``; ``read()`` returns its bytes."""
    with warnings.catch_warnings():
        # Pillow warns (rather than fails) between 1x and 2x MAX_IMAGE_PIXELS;
        # we treat both as a bomb. Other warnings (odd EXIF, ...) are harmless.
        warnings.simplefilter("ignore")
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(source) as img:
            # JPEG only: decode at 1/2, 1/4 or 1/8 scale, never below the target.
            longest = max(spec.height, spec.width)
            full_size = img.size
            img.draft(None, (longest, longest))
            img = _load_pixels(img, read, full_scale=img.size == full_size)
            ImageOps.exif_transpose(img, in_place=True)  # no copy where there is no rotation
            return np.asarray(resize(to_rgb(img, spec.background), spec))


def _check_regular_file(path):
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = next((kind for test, kind in _FILE_KINDS.items() if test(mode)), "an unknown kind of file")
        raise OSError(f"not a regular file but {kind}; left unopened")


def _load_pixels(img, read, full_scale):
    """Decode ``img``, whose encoded bytes ``read()`` returns; return it or an image with the same pixels and info.

    A full-scale RGB JPEG goes through simplejpeg where installed: the same
    libjpeg-turbo settings, so the same pixels (tested), 0.1-0.2 ms sooner
    at 500x375. A JPEG that simplejpeg only decodes with a warning (extra
    bytes, a truncated scan) is left to Pillow, which keeps the decision
    on what is usable the same with or without simplejpeg.
    """
    if full_scale and _simplejpeg is not None and img.format == "JPEG" and img.mode == "RGB":
        data = read()
        try:
            decoded = Image.fromarray(_simplejpeg.decode_jpeg(data, strict=True), "RGB")
        except ValueError:
            pass
        else:
            decoded.info.update(img.info)  # EXIF and XMP, for the orientation
            return decoded
    img.load()
    return img


def to_rgb(img, background=(255, 255, 255)):
    """Return ``img`` as 8-bit RGB; transparency is composited on ``background``."""
    if img.mode == "RGB":
        return img
    if img.mode in _SIXTEEN_BIT_MODES:
        pixels = np.asarray(img, dtype=np.int64)
        img = Image.fromarray((np.clip(pixels, 0, 65535) >> 8).astype(np.uint8), "L")
    elif img.mode == "F":
        img = Image.fromarray(np.clip(np.asarray(img), 0, 255).astype(np.uint8), "L")
    elif img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in _ALPHA_MODES:
        rgba = img.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return img.convert("RGB")


def resize(img, spec):
    """Resize an RGB image to ``spec``'s size with its resize policy."""
    size = (spec.width, spec.height)
    resample = RESAMPLE_FILTERS[spec.resample]
    w, h = img.size
    if spec.resize == "stretch":
        return img.resize(size, resample)
    if spec.resize == "crop":
        return img.resize(size, resample, box=_crop_box(w, h, spec.width, spec.height))
    left, top, inner_w, inner_h = pad_placement(w, h, spec)
    canvas = Image.new("RGB", size, spec.background)
    canvas.paste(img.resize((inner_w, inner_h), resample), (left, top))
    return canvas


def pad_placement(w, h, spec):
    """Return ``(left, top, width, height)``: where ``resize="pad"`` puts a ``w`` x ``h`` image in ``spec``'s size."""
    scale = min(spec.width / w, spec.height / h)
    inner_w, inner_h = max(1, round(w * scale)), max(1, round(h * scale))
    return (spec.width - inner_w) // 2, (spec.height - inner_h) // 2, inner_w, inner_h


def _crop_box(w, h, width, height):
    """Return the centered box of a ``w`` x ``h`` image with the aspect ratio of ``width`` x ``height``.

    The box lies inside the image for every size: ``width / (width / w)``
    can come out a hair above ``w`` in floats, and Pillow refuses such a box
    ("box offset can't be negative"), which once dropped 2-7% of real photos.
    """
    scale = max(width / w, height / h)
    left = (w - min(w, width / scale)) / 2
    top = (h - min(h, height / scale)) / 2
    return left, top, w - left, h - top


def encode_jpeg(pixels, quality):
    """Encode uint8 ``[H, W, 3]`` (RGB) or ``[H, W]`` (grey) pixels as JPEG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB" if pixels.ndim == 3 else "L").save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def decode_jpeg(data, out=None, grey=False):
    """Decode JPEG bytes (any buffer) to uint8 ``[H, W, 3]`` (``grey``: ``[H, W, 1]``), into ``out`` if given.

    Uses simplejpeg where installed (``fastdata[jpeg]``): it gives the same
    pixels as Pillow (both are libjpeg-turbo with the same settings), runs
    about 4x faster on small images, decodes straight into ``out`` and
    releases the GIL for the whole decode, so decoding threads scale with
    cores. Pillow otherwise.
    """
    mode = "L" if grey else "RGB"
    if _simplejpeg is not None:
        return _simplejpeg.decode_jpeg(data, colorspace="GRAY" if grey else "RGB", buffer=out)
    with Image.open(io.BytesIO(data)) as img:
        pixels = np.asarray(img.convert(mode) if img.mode != mode else img).reshape(img.height, img.width, -1)
    if out is None:
        return pixels
    out[...] = pixels
    return out


def jpeg_decoder_into(grey=False):
    """Return ``decode(data, buffer=out)``, decode_jpeg into ``out`` with no Python frame of ours in between.

    For loops over many small images, where every call runs under the GIL:
    simplejpeg's own function where installed (a 64x64 batch on 2 threads
    decoded 2.5-4.5% faster than through two wrapper calls), decode_jpeg
    otherwise.
    """
    if _simplejpeg is not None:
        return functools.partial(_simplejpeg.decode_jpeg, colorspace="GRAY") if grey else _simplejpeg.decode_jpeg
    return lambda data, buffer: decode_jpeg(data, buffer, grey)


# NOTE [fast DCT scales]: libjpeg-turbo decodes at any scale M/8, but only
# 1/8 (the DC coefficient alone), 1/4 and 1/2 (SIMD 2x2 and 4x4 IDCTs on x86)
# are cheap like the SIMD 8x8 of 1; the others run plain C and decode slower
# than the full image.
# Measured on 2 cores, best of 15 rounds of 8 photo-like JPEGs (ms per image,
# M/8 = 1/8 .. 8/8): 256 px 0.21 0.27 0.35 0.32 0.51 0.78 1.13 0.37; 512 px
# 0.75 0.97 1.07 1.07 1.37 1.97 2.68 1.34. So these four scales only, the
# same as Pillow's draft: either decoder gives the same pixels.
_DCT_SCALES = (1, 2, 4, 8)


def jpeg_size(data):
    """Return ``(height, width)`` of JPEG ``data`` (any buffer) from its header, without decoding the pixels."""
    if _simplejpeg is not None:
        return tuple(_simplejpeg.decode_jpeg_header(data)[:2])
    with Image.open(io.BytesIO(data)) as img:
        return img.height, img.width


def dct_scale(box, size, scales=_DCT_SCALES):
    """Return ``M`` of the smallest DCT scale ``M/8`` at which ``box`` stays at least ``size``.

    Args:
        box: ``(top, left, height, width)`` in full-size pixels.
        size: ``(height, width)`` of the output.
        scales: the numerators to choose from, ascending (default 1, 2, 4, 8: see NOTE [fast DCT scales]).

    Returns:
        int: 8 (full size) when even that keeps the box below ``size``, which is then upscaled.
    """
    height, width = int(box[2]), int(box[3])
    return next((m for m in scales if height * m >= 8 * size[0] and width * m >= 8 * size[1]), 8)


def decode_jpeg_resized_crop(data, box, size, out=None):
    """Decode the ``box`` of JPEG ``data`` resized to ``size``: uint8 ``[height, width, 3]``, into ``out`` if given.

    The image is decoded at the smallest DCT scale that keeps the box at
    least ``size`` (see dct_scale; libjpeg-turbo then skips most of the
    inverse DCT and the colour conversion), the box is mapped onto the
    scaled image in float coordinates and resized to ``size`` with Pillow's
    bilinear filter (antialiased when it shrinks) in one call.

    NOTE [where the fused crop pays]: where the boxes are well above the output:
    torchvision-default boxes (scale 0.08-1) of photos stored at 512 px
    decode at a mean scale of 0.58 for 112 px, with 1.70x less CPU than a
    full decode, then the same crop and resize (1.38 vs 2.36 ms per image;
    1.62x the rate on 2 busy cores). To 224 px, or from 256 px, the boxes
    mostly need the full size (mean scale 0.97-1.0), so both do the same
    work: 0.91-1.05x, within this VM's noise (a rerun of 512 to 224 px:
    2.83 vs 2.92 ms). Resizing costs as much as decoding: a 370 px box to
    224 px took 1.42 ms in Pillow, the full 512x512 decode 1.36 ms. All
    medians of one thread's CPU time, measured by
    benchmarks/sections/fusedcrop.py (256 photos, 5 interleaved rounds) on
    2 cores shared with other work (load average 3).

    Args:
        data: JPEG bytes (any buffer).
        box: ``(top, left, height, width)`` in full-size pixels, inside the image.
        size: ``(height, width)`` of the output.
        out: uint8 ``[height, width, 3]`` array to write into.
    """
    top, left, height, width = (int(v) for v in box)
    out_height, out_width = int(size[0]), int(size[1])
    pixels, scale = _decode_scaled(data, dct_scale(box, size))
    # Only the box and the filter's reach around it become a Pillow image: copying all of a 512x512 decode
    # (Image.fromarray) took 0.39 ms, these rows and columns of it 0.24 ms (0.39 through a contiguous copy).
    reach_y, reach_x = 2 + int(height * scale / out_height), 2 + int(width * scale / out_width)
    y0, x0 = max(0, int(top * scale) - reach_y), max(0, int(left * scale) - reach_x)
    y1 = min(pixels.shape[0], int((top + height) * scale) + reach_y + 1)
    x1 = min(pixels.shape[1], int((left + width) * scale) + reach_x + 1)
    region = (left * scale - x0, top * scale - y0, min(x1, (left + width) * scale) - x0,
              min(y1, (top + height) * scale) - y0)
    stride = pixels.shape[1] * 3  # rows y0:y1, columns x0:x1 of the C-contiguous pixels, read in one copy
    start, stop = (y0 * pixels.shape[1] + x0) * 3, ((y1 - 1) * pixels.shape[1] + x1) * 3
    img = Image.frombuffer("RGB", (x1 - x0, y1 - y0), pixels.reshape(-1)[start:stop], "raw", "RGB", stride, 1)
    resized = img.resize((out_width, out_height), Image.Resampling.BILINEAR, box=region)
    if out is None:
        out = np.empty((out_height, out_width, 3), np.uint8)  # writable, as simplejpeg's arrays are
    out[...] = np.asarray(resized)
    return out


def _decode_scaled(data, m):
    """Return ``(uint8 [h, w, 3], scale)``: ``data`` decoded at the DCT scale ``m/8`` or, for tiny images, below it.

    libjpeg-turbo decodes each 8x8 block to ``k x k`` pixels, so full-size
    ``x`` lands at ``x * k / 8`` and a side of ``n`` pixels at ``ceil(n * k / 8)``.
    simplejpeg takes the smallest ``k`` whose sides reach those of ``m``,
    which is below ``m`` when the image is only a few pixels across.
    """
    if _simplejpeg is not None:
        full_height, full_width = _simplejpeg.decode_jpeg_header(data)[:2]
        height, width = -(-full_height * m // 8), -(-full_width * m // 8)
        k = next(k for k in range(1, m + 1) if -(-full_height * k // 8) >= height and -(-full_width * k // 8) >= width)
        return _simplejpeg.decode_jpeg(data, min_height=height, min_width=width), k / 8
    with Image.open(io.BytesIO(data)) as img:
        full_width, divisor = img.width, 8 // m  # m is one of _DCT_SCALES: Pillow's draft scales by 1/divisor
        drafted = img.draft(None, (max(1, img.width // divisor), max(1, img.height // divisor)))
        img.load()  # drafted[1] is the full image in scaled pixels: (0, 0, width / divisor, height / divisor)
        return np.asarray(to_rgb(img)), 1.0 if drafted is None else drafted[1][2] / full_width
