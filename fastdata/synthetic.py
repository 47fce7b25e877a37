"""Synthetic datasets for demos, tests and benchmarks (nothing is downloaded).

Images look like photos to a JPEG codec: smooth colour fields, a few hard
edged shapes and sensor-like noise, so file sizes and decode times are those
of real photos (about 30-60 KB at 500x375, quality 90).
"""

import os

import numpy as np
from PIL import Image, ImageDraw


def make_photo(rng, width=500, height=375):
    """Return a photo-like RGB PIL image drawn from ``rng``."""
    field = rng.integers(0, 256, size=(4, 5, 3), dtype=np.uint8)
    img = Image.fromarray(field, "RGB").resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(3, 8)):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        x1, y1 = x0 + rng.integers(20, width // 2), y0 + rng.integers(20, height // 2)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    pixels = np.asarray(img, dtype=np.int16) + rng.normal(0, 6, (height, width, 3)).astype(np.int16)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def make_imagefolder(root, num_classes=4, per_class=25, size=(500, 375), seed=0, quality=90):
    """Write an ImageFolder tree of JPEGs ``root/class_k/img_j.jpg``; return ``root``."""
    rng = np.random.default_rng(seed)
    for label in range(num_classes):
        folder = os.path.join(root, f"class_{label}")
        os.makedirs(folder, exist_ok=True)
        for index in range(per_class):
            path = os.path.join(folder, f"img_{index:05d}.jpg")
            make_photo(rng, *size).save(path, "JPEG", quality=quality)
    return os.fspath(root)
