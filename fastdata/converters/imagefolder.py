"""Image folder -> packed file: one sub-folder per class, class index in sorted order."""

import os
import time
import warnings
from collections import Counter
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from fastdata.codecs.images import ImageSpec, image_extensions
from fastdata.converters.imageprep import (
    PixelStats,
    check_classes_kept,
    close_c_stderr,
    prepare_one,
    sample_metadata,
    source_metadata,
)
from fastdata.converters.imageshards import convert_to_shards
from fastdata.converters.parallel import ordered_map
from fastdata.converters.report import ON_ERROR, ConversionReport, check_choice, handle_bad_input
from fastdata.converters.shards import container_of, is_folder_output
from fastdata.converters.staging import allocated_memmap, staged_output
from fastdata.converters.upload import remote_output
from fastdata.errors import OptionError, SourceError
from fastdata.formats import Columns, write_packed

STORAGE_MODES = ("raw", "jpeg")
_OPEN_ROWS = {}  # staging file path -> np.memmap, per process (see NOTE [rows in place])


def find_images(root):
    """List the images of an ImageFolder tree.

    Files in nested folders belong to their top-level class; hidden files and
    folders and files without an extension Pillow opens are ignored (counted
    by kind in the conversion report); symlinked folders are followed once
    each; folders that cannot be read are left out (listed as skipped by the
    conversion).

    Returns:
        ``(classes, paths, labels)``: sorted class names, image paths relative
        to ``root`` (sorted within each class) and int64 labels ``[N]``.

    Raises:
        SourceError: ``root`` is not a readable folder, has no class folder,
            a class folder cannot be read or holds no image file, or a JSON
            file beside the class folders holds COCO-style annotations.
    """
    found = _scan_images(root)
    return found.classes, found.paths, found.labels


@dataclass
class _FoundImages:
    """What a walk of an ImageFolder tree found (see find_images)."""

    classes: list
    paths: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    unreadable: list = field(default_factory=list)  # (folder relative to root, reason)
    ignored: Counter = field(default_factory=Counter)  # kind ("hidden", ".txt", ...) -> files left out


def _scan_images(root):
    root = os.fspath(root)
    found = _FoundImages(_class_folders(root))
    found.ignored.update(_ignored_at_top(root))
    # A link back to the root or into another class is not followed.
    folders = [root] + [os.path.join(root, name) for name in found.classes]
    outside = {_inode(folder) for folder in folders}
    for label, name in enumerate(found.classes):
        top, errors, ignored = os.path.join(root, name), [], Counter()
        images = sorted(_walk_images(top, outside - {_inode(top)}, ignored, errors.append))
        _check_class_found(root, name, images, errors, ignored)
        found.paths += [os.path.join(name, path) for path in images]
        found.labels += [label] * len(images)
        found.unreadable += [(os.path.relpath(exc.filename, root), _unreadable_reason(exc)) for exc in errors]
        found.ignored.update(ignored)
    found.labels = np.asarray(found.labels, dtype=np.int64)
    found.ignored = dict(sorted(found.ignored.items()))
    return found


def _class_folders(root):
    """Return the sorted class folder names of ``root``."""
    if not os.path.isdir(root):
        raise SourceError(f"{root!r} is not a folder; expected {root}/<class>/<image>")
    try:
        entries = list(os.scandir(root))
    except OSError as exc:
        raise SourceError(f"cannot read {root!r} ({exc.strerror}); check its permissions") from exc
    classes = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise SourceError(f"{root!r} has no class folders; expected {root}/<class>/<image>")
    return classes


def _ignored_at_top(root):
    """Count the hidden entries and the files directly in ``root`` (they belong to no class).

    Raises:
        SourceError: a file there holds COCO-style annotations (see NOTE [annotations beside the images]).
    """
    counts = Counter()
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                counts["hidden"] += 1
            elif not entry.is_dir():
                _check_not_annotations(entry.path, root)
                counts["outside class folders"] += 1
    return counts


# NOTE [annotations beside the images]: a COCO-style detection set (an
# images folder and annotations.json beside it) converted as an ImageFolder
# became one class named after the images folder, exit 0, its boxes and
# categories ignored. A JSON file at the top whose start lists images by
# "file_name" (COCO's image records, written first, before annotations and
# categories) stops the conversion instead; moved out, the images convert
# as the class folders they lie in.
_ANNOTATION_PEEK = 1 << 16  # bytes of a top-level .json read to tell whether it lists images


def _check_not_annotations(path, root):
    """Raise SourceError if the file at ``path`` holds COCO-style annotations of the images under ``root``."""
    if not path.lower().endswith(".json"):
        return
    try:
        with open(path, "rb") as f:
            start = f.read(_ANNOTATION_PEEK)
    except OSError:  # counted as a file outside the class folders, as before
        return
    if b'"images"' in start and b'"file_name"' in start:
        raise SourceError(f"{path!r} holds COCO-style annotations of the images in {root!r}: convert imagefolder "
                          "reads <class>/<image> folders and would store each image under the folder it lies in, "
                          "its boxes and categories lost. Detection sets are not converted yet; to convert the "
                          "images alone, as classes by folder, move the annotations out of the folder")


def _walk_images(top, skip, ignored, onerror):
    """Yield the image paths under ``top``, relative to it.

    Counts the files left out by kind into ``ignored``; passes the OSError of
    each folder that cannot be listed to ``onerror``.
    """
    seen, extensions = set(skip), image_extensions()
    for folder, subfolders, files in os.walk(top, onerror=onerror, followlinks=True):
        if _inode(folder) in seen:  # a symlink loop, a second link, or a skipped folder
            subfolders[:] = []
            continue
        seen.add(_inode(folder))
        subfolders[:] = [d for d in subfolders if not _hidden(d, ignored)]
        for name in files:
            if _hidden(name, ignored):
                continue
            if name.lower().endswith(extensions):
                yield os.path.relpath(os.path.join(folder, name), top)
            else:
                ignored[os.path.splitext(name)[1].lower() or "no extension"] += 1


def _hidden(name, ignored):
    """Return whether ``name`` is hidden, counting it in ``ignored`` if so."""
    if name.startswith("."):
        ignored["hidden"] += 1
        return True
    return False


def _unreadable_reason(exc):
    return f"folder cannot be read ({type(exc).__name__}: {exc.strerror}); its images were left out"


def _check_class_found(root, name, images, errors, ignored):
    """Raise SourceError for a class folder that cannot be read or has no image file."""
    top = os.path.join(root, name)
    for exc in errors:
        if exc.filename == top:
            raise SourceError(
                f"class folder {name!r} in {root!r} cannot be read ({exc.strerror}); fix its permissions or remove it"
            ) from exc
    if not images:
        held = ", ".join(f"{count} {kind}" for kind, count in sorted(ignored.items())) or "nothing"
        unread = f" and {len(errors)} folder(s) it cannot read" if errors else ""
        raise SourceError(
            f"class folder {name!r} in {root!r} has no image files (it holds {held}{unread}); "
            "add images or remove the folder"
        )


def _inode(folder):
    stat = os.stat(folder)
    return stat.st_dev, stat.st_ino


def convert_imagefolder(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    size: int | tuple[int, int] = 64,
    resize: str = "crop",
    resample: str = "bilinear",
    storage: str = "raw",
    quality: int = 90,
    workers: int | None = None,
    on_error: str = "skip",
    overwrite: bool = False,
    progress: bool = True,
    format: str | None = None,
    shard_size: int | None = None,
    resume: bool = False,
    executor: object | None = None,
    part: tuple[int, int] | None = None,
    storage_options: dict | None = None,
) -> ConversionReport:
    """Preprocess an image folder once into a packed ``.h5`` or ``.arrow`` file, or a shard folder.

    Args:
        src: ImageFolder tree (``src/<class>/<image>``).
        out: output path; its extension picks the format. Any other path is a
            shard folder (see fastdata.converters.shards): shard files of about
            ``shard_size`` bytes in the container ``format``, and ``index.json``.
            A URL (``s3://bucket/train/``, any fsspec URL) is a shard folder
            there: each shard is uploaded as it is finished, the index last.
        size: stored size, an int (square) or ``(height, width)``.
        resize: "crop", "pad" or "stretch" (see ImageSpec).
        resample: Pillow filter name ("bilinear", "bicubic", "lanczos", "nearest").
        storage: "raw" (uint8 [3, H, W], fastest to load) or "jpeg"
            (re-encoded at ``quality``, decoded when loading).
        workers: processes to decode with; default all cores.
        on_error: for an image that cannot be used: "skip" it, "warn" and skip
            it, or "raise" SampleError.
        overwrite: replace an existing ``out``.
        progress: show a progress bar (only on a terminal).
        format: shard folder: "hdf5" (default) or "arrow".
        shard_size: shard folder: bytes per shard [default: DEFAULT_SHARD_BYTES, 64 MiB].
        resume: shard folder: finish an interrupted conversion of the same settings,
            keeping its intact shards; on a finished one, check every file its index
            lists (size and crc32) and redo those missing or damaged (``report.redone``),
            or report it finished (``report.finished``) with nothing rewritten.
        executor: shard folder: run the shards on this ``concurrent.futures.Executor``
            or ``dask.distributed.Client`` instead of ``workers`` local processes.
        part: shard folder: ``(i, n)``: write only shards ``k`` with ``k % n == i``; the
            part that finds every shard done writes the index.
        storage_options: URL ``out``: fsspec keywords (credentials, ``endpoint_url``...);
            default fsspec's own (environment variables, config files).

    Returns:
        ConversionReport (``path``: the file or the shard folder).

    Example:
        >>> convert_imagefolder("photos/train", "train.h5", size=64)
        >>> convert_imagefolder("imagenet/train", "train-shards", size=64, shard_size=64 << 20)
        >>> convert_imagefolder("imagenet/train", "s3://bucket/imagenet/train/", size=64, workers=16)
    """
    started = time.perf_counter()
    height, width = (size, size) if isinstance(size, int) else size
    spec = ImageSpec(height, width, resize=resize, resample=resample)
    check_choice("storage", storage, STORAGE_MODES)
    check_choice("on_error", on_error, ON_ERROR)
    if not 1 <= quality <= 100:
        raise OptionError(f"quality should be in 1..100, got quality={quality}")
    container = container_of(out, format)
    remote = remote_output(out, storage_options, is_folder_output(out))
    if not is_folder_output(out) and (shard_size, resume, executor, part) != (None, False, None, None):
        raise OptionError(f"shard_size, resume, executor and part need a shard folder, not the file {out!r}; "
                          "give OUT without an extension")
    found = _scan_images(src)
    classes, paths, labels = found.classes, found.paths, found.labels
    unreadable = _apply_on_error_to_folders(found.unreadable, on_error)
    if is_folder_output(out):
        # The tasks name their images from src: absolute, for workers in another folder (a Dask cluster's).
        return convert_to_shards(
            os.path.abspath(src), out, found, spec, storage, quality, on_error, started, container=container,
            overwrite=overwrite, shard_size=shard_size, resume=resume, executor=executor, part=part, workers=workers,
            progress=progress, remote=remote,
        )
    with staged_output(out, overwrite) as (staging, staged_path):
        sink = _RawSink(staging, len(paths), spec) if storage == "raw" else _JpegSink(staging)
        prepare = partial(_prepare_image, spec=spec, storage=storage, quality=quality, rows=sink.rows)
        tasks = [(index, os.path.join(src, path)) for index, path in enumerate(paths)]
        # Decode, preprocess and encode every image, in input order.
        kept, skipped, stats = [], list(unreadable), PixelStats()
        try:
            with closing(ordered_map(prepare, tasks, workers=workers, progress=progress, unit="img")) as results:
                for index, (ok, payload, sums, reason) in enumerate(results):
                    if not ok:
                        handle_bad_input("image", paths[index], index, reason, on_error)
                        skipped.append((paths[index], reason))
                        continue
                    sink.append(index, payload)
                    stats.add(sums)
                    kept.append(index)
        finally:
            _OPEN_ROWS.clear()  # this process's maps of the staging file (workers=1)
            close_c_stderr()
        # Check every class kept an image, then write labels and metadata.
        kept_labels = labels[kept]
        class_counts = np.bincount(kept_labels, minlength=len(classes))
        check_classes_kept(classes, class_counts, src, skipped)
        metadata = {
            **sample_metadata(classes, spec, storage, quality),
            "num_samples": len(kept),
            "class_counts": class_counts.tolist(),
            **stats.mean_std(),
            "source": source_metadata(src, found),
            "skipped": [{"path": path, "reason": reason} for path, reason in skipped],
        }
        write_packed(staged_path, sink.columns(kept_labels), metadata)
    return ConversionReport(os.fspath(out), len(kept), skipped, time.perf_counter() - started, "img", found.ignored)


def _apply_on_error_to_folders(unreadable, on_error):
    """Apply the ``on_error`` policy to the folders that could not be read; return them."""
    for path, reason in unreadable:
        if on_error == "raise":
            raise SourceError(
                f"cannot read folder {path!r}: {reason}; fix its permissions, "
                "or pass on_error='skip' (--on-error skip) to leave it out"
            )
        if on_error == "warn":
            warnings.warn(f"skipped folder {path!r}: {reason}", stacklevel=3)
    return unreadable


def _prepare_image(task, spec, storage, quality, rows):
    """Return ``(True, payload, channel sums, None)`` or ``(False, None, None, reason)``.

    For raw storage the pixels are written straight into row ``index`` of the
    staging file ``rows`` (``(path, shape)``, see NOTE [rows in place]) and
    the payload is None; for jpeg storage the payload is the JPEG bytes.
    """
    index, path = task
    ok, payload, sums, reason = prepare_one(path, spec, storage, quality)
    if ok and storage == "raw":
        _open_rows(*rows)[index] = payload.transpose(2, 0, 1)
        payload = None
    return ok, payload, sums, reason


def _open_rows(path, shape):
    """Return this process's writable map of the staging file (opened once per process)."""
    if path not in _OPEN_ROWS:
        _OPEN_ROWS[path] = np.memmap(path, mode="r+", dtype=np.uint8, shape=shape)
    return _OPEN_ROWS[path]


class _RawSink:
    """uint8 [3, H, W] images in a staging file, one row per input.

    NOTE [rows in place]: workers write each raw image straight into its
    input's row of a shared file map, so the pixels never travel through the
    pool's pipes (pickled, copied four times and once more by this process:
    at 224x224 that was ~150 KB per image of work for the parent). Rows of
    skipped inputs are closed up at the end, keeping input order.
    """

    def __init__(self, staging, capacity, spec):
        shape = (capacity, 3, spec.height, spec.width)
        path = os.path.join(staging, "images.u8")
        self._images = allocated_memmap(path, np.uint8, shape)  # see NOTE [allocated maps]
        self.rows = (path, shape)
        self._kept = []

    def append(self, index, payload):
        self._kept.append(index)

    def columns(self, labels):
        for row, index in enumerate(self._kept):
            if row != index:
                self._images[row] = self._images[index]
        return Columns(self._images[: len(self._kept)], labels)


class _JpegSink:
    """Appends JPEG bytes to a staging file and records their offsets."""

    rows = None

    def __init__(self, staging):
        self._path = os.path.join(staging, "images.jpeg")
        self._file = open(self._path, "wb")
        self._offsets = [0]

    def append(self, index, payload):
        self._file.write(payload)
        self._offsets.append(self._offsets[-1] + len(payload))

    def columns(self, labels):
        self._file.close()
        size = self._offsets[-1]
        values = np.memmap(self._path, mode="r", dtype=np.uint8, shape=(size,)) if size else np.empty(0, np.uint8)
        return Columns(values, labels, np.asarray(self._offsets, dtype=np.int64))
