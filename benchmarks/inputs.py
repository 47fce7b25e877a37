"""The suite's synthetic inputs, made once and cached in the work folder.

* photos: ImageFolder of photo-like JPEGs of varied sizes (a quarter to four
  times the area of 500x375, aspect ratios 1:4 to 4:1) and modes (RGB, L, CMYK);
* tiny: ImageFolder of photo-like 32x32 JPEGs (CIFAR-sized);
* reviews: IMDB-like tree of review-like ``.txt`` files;
* packed files converted from them, and packed files with the rows of a
  converted file repeated to a given number of samples.

A cached input carries a ``.params.json`` written last, so an interrupted
run is redone, never reused half-made.
"""

import json
import os
import shutil
import time

import numpy as np

from fastdata import convert_imagefolder, convert_text
from fastdata.measure.synthetic import make_imagefolder, make_text_corpus

PHOTO_SIZE = (500, 375)  # width, height the synthetic source photos vary around
PHOTO_QUALITY = 90
IMAGE_FILES = (("hdf5", "raw", ".h5"), ("hdf5", "jpeg", ".h5"), ("arrow", "raw", ".arrow"), ("arrow", "jpeg", ".arrow"))
TEXT_FILES = (("hdf5", ".h5"), ("arrow", ".arrow"))
TINY_SIZE = (32, 32)


def photo_folder(workdir, num_images, seed):
    """Return ``(root, paths, labels, info)`` of the photo folder under ``workdir/images``."""
    root, info = prepare_imagefolder(os.path.join(workdir, "images"), num_images, seed)
    paths, labels = list_images(root)
    return root, paths, labels, info


def prepare_imagefolder(folder, num_images, seed):
    """Return ``(root, info)`` of a synthetic ImageFolder of photos in ``folder``, generated unless cached."""
    num_classes = min(10, max(4, num_images // 250))
    per_class = max(1, round(num_images / num_classes))
    params = {
        "generator": "fastdata.measure.synthetic.make_imagefolder",
        "num_classes": num_classes,
        "per_class": per_class,
        "size": list(PHOTO_SIZE),
        "quality": PHOTO_QUALITY,
        "seed": seed,
        "vary": True,
        "jpeg_only": True,
    }
    root = os.path.join(folder, f"imagefolder-{num_classes}x{per_class}-varied-seed{seed}")
    seconds = _cached(root, params, lambda: make_imagefolder(root, num_classes, per_class, PHOTO_SIZE, seed,
                                                             PHOTO_QUALITY, vary=True, jpeg_only=True),
                      complete=lambda: len(list_images(root)[0]) == num_classes * per_class)
    return root, {**params, "cached": seconds is None, "generate_seconds": seconds}


def imagenet_like(workdir, num_images, classes, distinct, seed):
    """Return ``(params, root, seconds)``: an ImageNet-like folder of ``num_images`` varied JPEGs in ``workdir``.

    Made with fastdata.measure.synthetic.make_imagenet_like unless cached (``seconds`` None then).
    """
    from fastdata.measure.synthetic import make_imagenet_like

    params = {"generator": "fastdata.measure.synthetic.make_imagenet_like", "num_images": num_images,
              "classes": classes, "distinct": distinct, "seed": seed}
    root = os.path.join(workdir, f"imagenet-like-{num_images}-seed{seed}")
    seconds = _cached(root, params, lambda: make_imagenet_like(root, num_images, classes, distinct, seed))
    return params, root, seconds


def list_images(root):
    """Return ``(paths, labels int64 [N])``: sorted class folders, sorted files."""
    if not os.path.isdir(root):
        return [], np.empty(0, np.int64)
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    paths, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(f for f in os.listdir(os.path.join(root, name)) if f.endswith(".jpg"))
        paths += [os.path.join(root, name, f) for f in files]
        labels += [label] * len(files)
    return paths, np.asarray(labels, dtype=np.int64)


def read_all(paths):
    """Read every file once so that all methods start from a warm page cache; return bytes read."""
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += len(f.read())
    return total


def image_file(workdir, count, size, storage, ext):
    """Return the path of ``count`` photos packed at ``size`` (the images section converts and times it)."""
    return os.path.join(workdir, "images", f"{count}-images-{size}px-{storage}{ext}")


def packed_images(workdir, num_images, size, seed):
    """Return ``{"hdf5-raw": path, ...}`` of the photo folder converted at ``size``, converting missing files.

    Files converted (and timed) by the images section are reused.
    """
    root, paths, _, _ = photo_folder(workdir, num_images, seed)
    files = {}
    for fmt, storage, ext in IMAGE_FILES:
        path = image_file(workdir, len(paths), size, storage, ext)
        if not _complete(path, len(paths), size=size):
            convert_imagefolder(root, path, size=size, storage=storage, overwrite=True, progress=False)
        files[f"{fmt}-{storage}"] = path
    return files


def tiny_folder(workdir, num_images, seed):
    """Return the root of an ImageFolder of 32x32 photo-like JPEGs, made unless cached."""
    num_classes = 10
    per_class = max(1, num_images // num_classes)
    params = {"num_classes": num_classes, "per_class": per_class, "size": list(TINY_SIZE), "seed": seed}
    root = os.path.join(workdir, "tiny", f"imagefolder-{num_classes}x{per_class}-32px-seed{seed}")
    _cached(root, params, lambda: make_imagefolder(root, num_classes, per_class, TINY_SIZE, seed, 90))
    return root


def repeated_tiny(workdir, num_images, seed, size, num_samples):
    """Return ``{"hdf5": path, "arrow": path}`` of the 32x32 folder converted raw at ``size``.

    The converted rows are repeated in order until there are ``num_samples``.
    """
    root = tiny_folder(workdir, num_images, seed)
    count = len(list_images(root)[0])
    files = {}
    for fmt, ext in TEXT_FILES:  # the same two containers
        converted = os.path.join(workdir, "tiny", f"{count}-tiny-{size}px-raw{ext}")
        if not _complete(converted, count, size=size):
            convert_imagefolder(root, converted, size=size, storage="raw", overwrite=True, progress=False)
        repeated = os.path.join(workdir, "tiny", f"{num_samples}-tiny-{size}px-raw-repeated{ext}")
        files[fmt] = repeat_rows(converted, repeated, num_samples)
    return files


def review_corpus(workdir, num_docs, seed):
    """Return the ``train`` folder of an IMDB-like review corpus (``neg``/``pos``), made unless cached."""
    per_class = max(1, num_docs // 2)
    params = {"per_class": per_class, "seed": seed}
    root = os.path.join(workdir, "text", f"reviews-{2 * per_class}-seed{seed}")
    _cached(root, params, lambda: make_text_corpus(root, per_class=per_class, seed=seed))
    return os.path.join(root, "train")


def convert_reviews(corpus, workdir, max_length):
    """Convert ``corpus`` to HDF5 and Arrow; return ``(files, conversion)`` with the seconds of each."""
    files, conversion = _review_files(corpus, workdir, max_length), {}
    for fmt in files:
        report = convert_text(corpus, files[fmt], max_length=max_length, overwrite=True, progress=False)
        conversion[fmt] = {"seconds": report.seconds, "num_samples": report.num_samples,
                           "docs_per_s": report.num_samples / report.seconds, "file_bytes": os.path.getsize(files[fmt])}
    return files, conversion


def packed_reviews(workdir, num_docs, seed, max_length):
    """Return ``{"hdf5": path, "arrow": path}`` of the review corpus, converting unless already converted."""
    corpus = review_corpus(workdir, num_docs, seed)
    files = _review_files(corpus, workdir, max_length)
    if not all(_converted_from(path, corpus, max_length) for path in files.values()):
        files, _ = convert_reviews(corpus, workdir, max_length)
    return files


def _review_files(corpus, workdir, max_length):
    name = os.path.basename(os.path.dirname(corpus))
    return {fmt: os.path.join(workdir, "text", f"{name}-len{max_length}{ext}") for fmt, ext in TEXT_FILES}


def _converted_from(path, corpus, max_length):
    from fastdata.formats import read_packed

    try:
        _, metadata = read_packed(path)
    except (ValueError, OSError):
        return False
    source, preprocessing = metadata.get("source", {}), metadata.get("preprocessing", {})
    return source.get("path") == os.path.abspath(corpus) and preprocessing.get("max_length") == max_length


def repeat_rows(src, dst, num_samples):
    """Write ``dst``: the rows of packed file ``src`` repeated in order until there are ``num_samples``.

    Fixed-size samples only (raw images). Cached: kept when it already holds
    ``num_samples`` rows of ``src``'s shape. Returns ``dst``.
    """
    from fastdata.formats import Columns, read_packed, write_packed

    columns, metadata = read_packed(src)
    if columns.ragged:
        raise ValueError(f"{src!r}: only fixed-size samples can be repeated")
    if _complete(dst, num_samples, shape=metadata["sample_shape"]):
        return dst
    rows = np.arange(num_samples) % columns.num_samples
    samples = np.take(np.asarray(columns.samples), rows, axis=0)
    labels = np.take(np.asarray(columns.labels), rows)
    origin = {"path": src, "num_samples": len(columns.labels)}
    repeated = {**metadata, "num_samples": num_samples, "repeated_from": origin}
    repeated.pop("format", None), repeated.pop("format_version", None)
    tmp = dst + ".tmp" + os.path.splitext(dst)[1]
    write_packed(tmp, Columns(samples, labels), repeated)
    os.replace(tmp, dst)
    return dst


def _complete(path, num_samples, size=None, shape=None):
    """Return whether ``path`` is a readable packed file of ``num_samples`` (and the size or shape)."""
    if not os.path.exists(path):
        return False
    from fastdata.formats import read_packed

    try:
        _, metadata = read_packed(path)
    except (ValueError, OSError):
        return False
    stored = metadata.get("sample_shape")
    return (metadata.get("num_samples") == num_samples and (size is None or stored[-2:] == [size, size])
            and (shape is None or stored == list(shape)))


def _cached(root, params, make, complete=lambda: True):
    """Make ``root`` with ``make()`` unless its marker (written last) holds ``params``.

    Returns:
        the seconds ``make()`` took, or None where ``root`` was cached.
    """
    marker = os.path.join(root, ".params.json")
    try:
        with open(marker) as f:
            if json.load(f) == params and complete():
                return None
    except (OSError, ValueError):
        pass
    shutil.rmtree(root, ignore_errors=True)
    print(f"making {root} (cached for later runs) ...", flush=True)
    started = time.perf_counter()
    make()
    seconds = time.perf_counter() - started
    with open(marker, "w") as f:
        json.dump(params, f)
    print(f"  made in {seconds:.1f}s", flush=True)
    return seconds
