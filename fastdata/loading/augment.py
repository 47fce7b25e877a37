"""Batched, seeded augmentation: whole-batch tensor ops with per-sample random parameters.

NOTE [counter-based draws]: every random parameter is a pure function of
``(seed, epoch, global sample index, draw number)``: a splitmix64 stream
keyed by the seed, the epoch and the index. So a sample's crop does not
depend on the batch it lands in, the rank, the world size or the workers;
a run is reproducible, and each epoch draws afresh. No global RNG state is
read or advanced. Draw numbers are fixed per transform (RandomResizedCrop:
0-9 area, 10-19 log-ratio, 20-29 top, 30-39 left, 40 flip), so ``boxes``
and ``flips`` agree whether they are asked together or apart.

NOTE [batched augmentation]: each transform is a few tensor ops over the
batch, with no loop over samples. RandomCrop pads once into a new buffer,
takes every row's window from one strided view of it (windows at every
offset; an advanced index over rows and columns took 9 ms per batch of
256 x 32 px uint8 against 1.1 ms, one thread) and flips the chosen rows;
RandomResizedCrop samples every row's box (flip folded into the direction
of its x positions) with one ``grid_sample``; CenterCrop is a slice.
Measured on this 2-core machine while 3 other jobs ran (load 5), one torch
thread, batches of 256 uint8 to normalized float32 (python
benchmarks/run.py --only augment): CPU ms per batch, batched against a
per-image loop of the same tensor ops (torchvision-style), and against
no augmentation (CenterCrop + Normalize): CIFAR 32 px crop+flip 5.9 vs
25.4 ms (4.3x fewer; wall 23,137 vs 5,015 samples/s; none 0.5 ms); RRC
80 -> 64 px 51.6 vs 82.6 ms (1.6x; 3,259 vs 1,529 samples/s; none 12.5 ms);
RRC 256 -> 224 px 739 vs 443 ms (0.6x; 161 vs 289 samples/s; none 156 ms).
At 224 px one core spends most of the batch in ``grid_sample`` (a general
gather per output pixel: 0.7 s alone, wall) and in turning the whole
256 px batch to float, where the loop converts only each crop and resizes
it with ``interpolate``'s separable kernel; resizing separably over the
batch (index_select of rows, lerp, transpose, index_select, lerp) was
slower still, 2.98 s against 1.22 s a batch. With 2 threads on the busy
machine the batched rows ran at 1,888, 1,437 and 219 samples/s: slower than
one thread at 32 and 64 px, faster at 224 px (NOTE [one thread] in
benchmarks/sections/augment.py). The batched form is
meant for GPUs (a few kernels per batch, not a few per image; not measured
here: no GPU) and for jpeg files, where the crop is fused into decoding
(decode_jpeg_resized_crop in codecs/images.py) and only the flip runs on
the batch.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F

from fastdata.errors import OptionError

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_ATTEMPTS = 10  # torchvision's RandomResizedCrop.get_params tries 10 boxes, then falls back to a centre crop


def _mix_int(x):
    """Return the splitmix64 finaliser of the Python int ``x`` (mod 2**64)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _mix(x):
    """Return the splitmix64 finaliser of the uint64 array ``x`` (array arithmetic wraps mod 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_uniforms(seed: int, epoch: int, indices: np.ndarray, count: int) -> np.ndarray:
    """Return ``count`` uniform draws in [0, 1) for each sample index (see NOTE [counter-based draws]).

    Args:
        seed: the run's seed (any int).
        epoch: the epoch (any int).
        indices: int64 [B] global sample indices.
        count: draws per sample.

    Returns:
        float64 [B, count], 53 random bits each; row ``i`` depends only on ``(seed, epoch, indices[i])``.
    """
    key = _mix_int((_mix_int((seed + _GOLDEN) & _MASK) + (epoch & _MASK) * _GOLDEN + _GOLDEN) & _MASK)
    idx = np.asarray(indices, dtype=np.int64).reshape(-1).view(np.uint64)
    state = _mix(idx * np.uint64(_GOLDEN) + np.uint64(key))  # a splitmix64 state per sample
    steps = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    bits = _mix(state[:, None] + steps[None, :])  # the state's splitmix64 stream, draws 1..count
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class RandomCrop:
    """Pad, crop a random ``size`` window and flip it horizontally with probability 1/2 (the CIFAR recipe).

    torchvision's RandomCrop(size, padding, fill) then RandomHorizontalFlip, batched: the top-left corner is
    uniform over the padded image. The output keeps the input's dtype (uint8 stays uint8) and is contiguous.

    Args:
        size: output int or (height, width).
        padding: pixels of ``fill`` added on every side first.
        flip: whether to flip half the samples.
        fill: the padding value.
    """

    def __init__(self, size, padding=4, flip=True, fill=0):
        self.size, self.padding, self.flip, self.fill = _pair(size), _non_negative("padding", padding), flip, fill

    def __call__(self, images, indices, epoch, seed):
        batch, channels, height, width = _check_batch(images, indices)
        pad = self.padding
        out_h, out_w = self.size
        if height + 2 * pad < out_h or width + 2 * pad < out_w:
            raise OptionError(f"RandomCrop: size {self.size} is larger than the padded images "
                              f"({height + 2 * pad}, {width + 2 * pad}); lower size or raise padding")
        top, left, flips = self._windows(indices, epoch, seed, height, width)
        if pad:
            padded = images.new_full((batch, channels, height + 2 * pad, width + 2 * pad), self.fill)
            padded[:, :, pad:pad + height, pad:pad + width] = images
        else:
            padded = images.contiguous()
        # see NOTE [batched augmentation]: every window of the padded batch is a view; pick one per row
        step_b, step_c, step_h, step_w = padded.stride()
        starts = np.arange(batch) * step_b + top * step_h + left * step_w
        count = int(starts.max(initial=-1)) + 1  # windows up to the last one picked (none for an empty batch)
        windows = padded.as_strided((count, channels, out_h, out_w), (1, step_c, step_h, step_w))
        out = windows[torch.from_numpy(starts).to(images.device)]
        flipped = np.flatnonzero(flips)
        if len(flipped):
            rows = torch.from_numpy(flipped).to(images.device)  # row numbers, not a mask: no device sync
            out[rows] = out[rows].flip(-1)
        return out

    def _windows(self, indices, epoch, seed, height, width):
        """Return int64 ``top``, ``left`` [B] of each row's window in the padded image, and bool ``flips`` [B]."""
        pad, (out_h, out_w) = self.padding, self.size
        draws = sample_uniforms(seed, epoch, _numpy_indices(indices), 3)
        top = np.minimum(draws[:, 0] * (height + 2 * pad - out_h + 1), height + 2 * pad - out_h).astype(np.int64)
        left = np.minimum(draws[:, 1] * (width + 2 * pad - out_w + 1), width + 2 * pad - out_w).astype(np.int64)
        return top, left, (draws[:, 2] < 0.5) & self.flip

    def move_boxes(self, boxes, indices, epoch, seed, size):
        """Return ``(boxes moved as __call__ moves their images, the output size)``; see NOTE [boxes move]."""
        top, left, flips = self._windows(indices, epoch, seed, *size)
        shift = (self.padding - left, self.padding - top)
        return _moved(boxes, (1.0, 1.0), shift, self.size, flips), self.size

    def __repr__(self):
        return f"RandomCrop(size={self.size}, padding={self.padding}, flip={self.flip}, fill={self.fill})"


class RandomResizedCrop:
    """Crop a random box of random area and aspect ratio, resize it to ``size`` (bilinear), flip half (ImageNet).

    torchvision's RandomResizedCrop (antialias=False) then RandomHorizontalFlip: ``boxes`` is its get_params,
    vectorised. ``__call__`` samples every box with one ``grid_sample`` (align_corners=False, coordinates
    clamped to the box as ``interpolate`` clamps them). uint8 input gives float32 in 0..255 units; float input
    keeps its dtype. The output is contiguous (Normalize gives it a memory format).

    Args:
        size: output int or (height, width).
        scale: range of the box's area as a fraction of the image's.
        ratio: range of the box's aspect ratio (width / height), drawn uniform in log space.
        flip: whether to flip half the samples.
    """

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip=True):
        self.size, self.flip = _pair(size), flip
        self.scale, self.ratio = _range("scale", scale), _range("ratio", ratio)
        if self.scale[0] <= 0 or self.ratio[0] <= 0:
            raise OptionError(f"RandomResizedCrop: scale and ratio should be positive, got {scale} and {ratio}")

    def boxes(self, seed, epoch, indices, heights, widths) -> np.ndarray:
        """Return int64 [B, 4] crop boxes (top, left, height, width) for images of ``heights`` x ``widths``.

        torchvision's get_params per sample: up to 10 tries of an area uniform in ``scale`` and a log-ratio
        uniform in log(``ratio``), w = round(sqrt(area * r)), h = round(sqrt(area / r)), the first with
        0 < w <= W and 0 < h <= H kept, its corner uniform; else the centre crop clamped to ``ratio``.
        """
        draws = sample_uniforms(seed, epoch, _numpy_indices(indices), 4 * _ATTEMPTS + 1)
        height = np.broadcast_to(np.asarray(heights, dtype=np.int64), (len(draws),))[:, None]
        width = np.broadcast_to(np.asarray(widths, dtype=np.int64), (len(draws),))[:, None]
        (low, high), (log_low, log_high) = self.scale, np.log(self.ratio)
        area = (height * width) * (low + (high - low) * draws[:, :_ATTEMPTS])
        aspect = np.exp(log_low + (log_high - log_low) * draws[:, _ATTEMPTS:2 * _ATTEMPTS])
        w = np.rint(np.sqrt(area * aspect)).astype(np.int64)  # rint rounds half to even, as Python's round
        h = np.rint(np.sqrt(area / aspect)).astype(np.int64)
        fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
        first = fits.argmax(axis=1)[:, None]
        found = fits.any(axis=1)
        h, w = np.take_along_axis(h, first, 1)[:, 0], np.take_along_axis(w, first, 1)[:, 0]
        height, width = height[:, 0], width[:, 0]
        top = np.take_along_axis(draws[:, 2 * _ATTEMPTS:3 * _ATTEMPTS], first, 1)[:, 0] * (height - h + 1)
        left = np.take_along_axis(draws[:, 3 * _ATTEMPTS:4 * _ATTEMPTS], first, 1)[:, 0] * (width - w + 1)
        top, left = np.minimum(top, height - h).astype(np.int64), np.minimum(left, width - w).astype(np.int64)
        fall_h, fall_w = self._fallback(height, width)
        h, w = np.where(found, h, fall_h), np.where(found, w, fall_w)
        top, left = np.where(found, top, (height - h) // 2), np.where(found, left, (width - w) // 2)
        return np.stack([top, left, h, w], axis=1)

    def _fallback(self, height, width):
        """Return torchvision's fallback box sizes: the whole image, clamped to the ratio range."""
        low, high = self.ratio
        in_ratio = width / height
        h = np.where(in_ratio < low, np.maximum(np.rint(width / low), 1), height).astype(np.int64)
        w = np.where(in_ratio > high, np.maximum(np.rint(height * high), 1), width).astype(np.int64)
        return np.minimum(h, height), np.minimum(w, width)

    def flips(self, seed, epoch, indices) -> np.ndarray:
        """Return bool [B]: which samples to flip horizontally (all False when ``flip`` is off)."""
        return (sample_uniforms(seed, epoch, _numpy_indices(indices), 4 * _ATTEMPTS + 1)[:, -1] < 0.5) & self.flip

    def move_boxes(self, boxes, indices, epoch, seed, size):
        """Return ``(boxes moved as __call__ moves their images, the output size)``; see NOTE [boxes move]."""
        indices = _numpy_indices(indices)
        crops = self.boxes(seed, epoch, indices, *size).astype(np.float64)
        scale = (self.size[1] / crops[:, 3], self.size[0] / crops[:, 2])
        shift = (-crops[:, 1] * scale[0], -crops[:, 0] * scale[1])
        return _moved(boxes, scale, shift, self.size, self.flips(seed, epoch, indices)), self.size

    def __call__(self, images, indices, epoch, seed):
        batch, _, height, width = _check_batch(images, indices)
        indices = _numpy_indices(indices)
        boxes = self.boxes(seed, epoch, indices, height, width).astype(np.float64)
        flips = self.flips(seed, epoch, indices)
        work = images if images.dtype in (torch.float32, torch.float64) else images.to(torch.float32)
        gy = _axis_grid(boxes[:, 0], boxes[:, 2], height, self.size[0], np.zeros(batch, dtype=bool))
        gx = _axis_grid(boxes[:, 1], boxes[:, 3], width, self.size[1], flips)
        gx, gy = (torch.from_numpy(g).to(device=images.device, dtype=work.dtype) for g in (gx, gy))
        grid = torch.stack(torch.broadcast_tensors(gx[:, None, :], gy[:, :, None]), dim=-1)
        out = F.grid_sample(work, grid, mode="bilinear", padding_mode="border", align_corners=False)
        return out.to(images.dtype) if images.is_floating_point() else out

    def __repr__(self):
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, flip={self.flip})"


def _axis_grid(start, length, extent, out, flips):
    """Return float64 [B, out] normalized sample positions of a box along one axis (see NOTE [crop grid])."""
    # NOTE [crop grid]: interpolate(align_corners=False) samples output pixel i of a box at
    # start + (i + 0.5) * length / out - 0.5, clamped to the box's first and last pixel; grid_sample's
    # normalized x is (2 * pixel + 1) / extent - 1. A flipped row reads its positions in reverse. The
    # grid is affine_grid's for a diagonal theta, but built from these per-axis positions: the clamp
    # needs them (without it an upscaled box blends in the pixels just outside it), and broadcasting
    # two [B, n] rows into [B, 224, 224, 2] took 0.26 s a batch of 256 against affine_grid's 1.17 s.
    steps = np.arange(out) + 0.5
    steps = np.where(flips[:, None], out - steps, steps)
    pixel = start[:, None] + steps * (length / out)[:, None] - 0.5
    pixel = np.clip(pixel, start[:, None], (start + length - 1)[:, None])
    return (2 * pixel + 1) / extent - 1


class CenterCrop:
    """Crop the centre ``size`` window (evaluation): a slice, torchvision's rounding of the corner.

    Args:
        size: output int or (height, width); at most the images' size.
    """

    def __init__(self, size):
        self.size = _pair(size)

    def __call__(self, images, indices=None, epoch=0, seed=0):
        top, left = self._corner(images.shape[-2:])
        return images[:, :, top:top + self.size[0], left:left + self.size[1]]

    def _corner(self, size):
        (height, width), (out_h, out_w) = size, self.size
        if out_h > height or out_w > width:
            raise OptionError(f"CenterCrop: size {self.size} is larger than the images ({height}, {width})")
        return int(round((height - out_h) / 2)), int(round((width - out_w) / 2))

    def move_boxes(self, boxes, indices, epoch, seed, size):
        """Return ``(boxes moved as __call__ moves their images, the output size)``; see NOTE [boxes move]."""
        top, left = self._corner(size)
        return _moved(boxes, (1.0, 1.0), (-left, -top), self.size, np.zeros(len(boxes), bool)), self.size

    def __repr__(self):
        return f"CenterCrop(size={self.size})"


class Normalize:
    """Convert 0..255 images (uint8, or float as RandomResizedCrop returns) to ``(x / 255 - mean) / std``.

    Computed in float32 (float64 input: float64) as one multiply-add, then cast to ``dtype`` in
    ``memory_format``.

    Args:
        mean: per-channel means in [0, 1] units (as a converter stores them in metadata["mean"]).
        std: per-channel standard deviations in [0, 1] units (metadata["std"]).
        dtype: the output's floating dtype (float32, float16, bfloat16, ...).
        memory_format: the output's memory format (torch.channels_last for convolutions that prefer it).
    """

    def __init__(self, mean, std, dtype=torch.float32, memory_format=torch.contiguous_format):
        self.mean = np.asarray(mean, dtype=np.float64).reshape(-1)
        self.std = np.asarray(std, dtype=np.float64).reshape(-1)
        if self.mean.shape != self.std.shape or not (self.std > 0).all():
            raise OptionError(f"Normalize: mean and std should have one value per channel and std > 0, "
                              f"got mean={mean}, std={std}")
        if not dtype.is_floating_point:
            raise OptionError(f"Normalize: dtype should be a floating dtype, got {dtype}")
        self.dtype, self.memory_format = dtype, memory_format
        self._constants = {}  # (device, dtype) -> (scale, shift) tensors [1, C, 1, 1]

    def __call__(self, images, indices=None, epoch=0, seed=0):
        if images.shape[1] != len(self.mean):
            raise OptionError(f"Normalize: {len(self.mean)} channel means for images of {images.shape[1]} channels")
        work = torch.float64 if images.dtype == torch.float64 else torch.float32
        scale, shift = self._scale_shift(images.device, work)
        out = images.to(work, memory_format=self.memory_format, copy=True)
        out.mul_(scale).add_(shift)  # x / (255 std) - mean / std
        return out.to(self.dtype) if self.dtype != work else out

    def _scale_shift(self, device, dtype):
        key = (device, dtype)
        if key not in self._constants:
            scale, shift = 1.0 / (255.0 * self.std), -self.mean / self.std
            self._constants[key] = tuple(torch.tensor(v, dtype=dtype, device=device).view(1, -1, 1, 1)
                                         for v in (scale, shift))
        return self._constants[key]

    def move_boxes(self, boxes, indices, epoch, seed, size):
        """Return ``(boxes, size)`` unchanged: normalizing moves no pixel."""
        return boxes, size

    def __repr__(self):
        return f"Normalize(mean={self.mean.tolist()}, std={self.std.tolist()}, dtype={self.dtype})"


class Compose:
    """Apply transforms in order, each called with the batch's indices, epoch and seed."""

    def __init__(self, *transforms):
        self.transforms = transforms

    def __call__(self, images, indices, epoch, seed):
        for transform in self.transforms:
            images = transform(images, indices, epoch, seed)
        return images

    def move_boxes(self, boxes, indices, epoch, seed, size):
        """Return ``(boxes moved by every transform in turn, the output size)``; see NOTE [boxes move]."""
        for transform in self.transforms:
            boxes, size = transform.move_boxes(boxes, indices, epoch, seed, size)
        return boxes, size

    def __repr__(self):
        return f"Compose({', '.join(map(repr, self.transforms))})"


def _moved(boxes, scale, shift, size, flips):
    """Return float ``boxes`` [B, T, 4] (x, y, width, height) scaled, shifted, clipped to ``size`` and flipped.

    NOTE [boxes move]: a box moves as its image's pixels do: each corner
    ``c`` goes to ``c * scale + shift`` per row (a crop shifts, a resize
    scales: the continuous edges of pixels map exactly as grid_sample's
    pixel centres do), is clipped to the output (a box cut by the crop keeps
    its inside part; one wholly outside keeps zero width or height, so the
    rows of fields beside it, labels per box, stay aligned: drop empty boxes
    in the loop where the model needs), and a flipped row mirrors x.
    """
    def per_row(value):  # a number, or one per row
        row = np.array(np.broadcast_to(value, (len(boxes),)), dtype=np.float64)
        return torch.from_numpy(row).to(device=boxes.device, dtype=boxes.dtype)[:, None]

    (scale_x, scale_y), (shift_x, shift_y) = map(per_row, scale), map(per_row, shift)
    height, width = size
    x0 = (boxes[..., 0] * scale_x + shift_x).clamp(0, width)
    y0 = (boxes[..., 1] * scale_y + shift_y).clamp(0, height)
    x1 = ((boxes[..., 0] + boxes[..., 2]) * scale_x + shift_x).clamp(0, width)
    y1 = ((boxes[..., 1] + boxes[..., 3]) * scale_y + shift_y).clamp(0, height)
    flipped = torch.as_tensor(np.asarray(flips, bool), device=boxes.device)[:, None]
    x0, x1 = torch.where(flipped, width - x1, x0), torch.where(flipped, width - x0, x1)
    return torch.stack([x0, y0, x1 - x0, y1 - y0], dim=-1)


def _pair(size):
    """Return ``size`` (an int or a pair) as a (height, width) tuple of positive ints."""
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2 or not all(isinstance(v, int) and v > 0 for v in pair):
        raise OptionError(f"size should be a positive int or (height, width), got size={size!r}")
    return pair


def _non_negative(name, value):
    if not isinstance(value, int) or value < 0:
        raise OptionError(f"{name} should be a non-negative int, got {name}={value!r}")
    return value


def _range(name, values):
    low, high = (float(v) for v in values)
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise OptionError(f"RandomResizedCrop: {name} should be (low, high) with low <= high, got {name}={values}")
    return low, high


def _check_batch(images, indices):
    """Return the shape of a [B, C, H, W] batch whose ``indices`` name its B rows."""
    if images.dim() != 4:
        raise OptionError(f"augmentations take a [B, C, H, W] batch, got shape {tuple(images.shape)}")
    if len(indices) != images.shape[0]:
        raise OptionError(f"{len(indices)} indices for a batch of {images.shape[0]} images")
    return images.shape


def _numpy_indices(indices):
    if isinstance(indices, torch.Tensor):
        indices = indices.cpu().numpy()
    return np.asarray(indices, dtype=np.int64)

