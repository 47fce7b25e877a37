"""Image folder -> shard folder: the plan, the task that writes one shard, and the index metadata."""

import os
import time
from dataclasses import dataclass

import numpy as np

from fastdata.converters.imageprep import (
    PixelStats,
    check_classes_kept,
    close_c_stderr,
    prepare_one,
    sample_metadata,
    source_metadata,
)
from fastdata.converters.parallel import run_tasks
from fastdata.converters.report import ConversionReport, handle_bad_input
from fastdata.converters.shardfolder import open_shard_folder
from fastdata.converters.shards import (
    DEFAULT_SHARD_BYTES,
    check_part,
    index_shards,
    label_runs,
    part_tasks,
    samples_per_shard,
    save_record,
    source_digest,
    task_bounds,
    write_shard,
)
from fastdata.errors import OptionError
from fastdata.formats import Columns
from fastdata.formats.shards import conversion_id

_ESTIMATE_INPUTS = 32  # jpeg storage: images encoded to estimate the bytes per sample


def convert_to_shards(src, out, found, spec, storage, quality, on_error, started, *, container, overwrite,
                      shard_size, resume, executor, part, workers, progress, remote=None):
    """Convert the scanned image folder ``found`` into the shard folder ``out``; return a ConversionReport.

    ``remote``: the RemoteFolder of a URL ``out`` (NOTE [remote write] in upload).

    NOTE [driver memory]: the driver holds the input paths and labels, one
    task per shard (slices of them) and the small records; pixels stay in
    the workers, one shard each. Driver peak RSS with part=(0, 400) (the
    whole plan, one 8 MiB shard run), make_imagenet_like, 2 workers: 110.7 MB
    at 10,000 inputs, 131.2 MB at 200,000 (about 110 bytes per input); the
    scan, the source digest and the plan of 200,000 took about 5 s.
    """
    shard_size = DEFAULT_SHARD_BYTES if shard_size is None else shard_size
    if remote is None and os.path.commonpath([os.path.realpath(src), os.path.realpath(out)]) == os.path.realpath(src):
        raise OptionError(f"the shard folder {os.fspath(out)!r} is inside the source {os.fspath(src)!r}, where it "
                          "would become a class; choose a folder outside it")
    samples_per_shard(shard_size, 1)  # check both before any work
    check_part(part, overwrite)
    settings = _settings(src, found, spec, storage, quality, container, shard_size)
    with open_shard_folder(out, settings, container=container, resume=resume, overwrite=overwrite,
                           part=part, remote=remote) as folder:
        damaged = folder.damaged_files() if folder.done else []  # see NOTE [resume checks what it keeps]
        if folder.done and not damaged:
            return _report(folder.where, folder.finished_metadata(), started, finished=True)
        if damaged:
            folder.reopen(damaged)
        folder.write_plan(folder.plan or _plan(src, found, spec, storage, quality, settings))
        bounds = task_bounds(folder.plan["num_inputs"], folder.plan["samples_per_shard"])
        numbers = part_tasks(len(bounds) - 1, part)
        folder.remove_partials(numbers)
        todo = [k for k in numbers if folder.kept_record(k, int(bounds[k]), int(bounds[k + 1])) is None]
        tasks = [_task(folder, k, bounds, src, found, spec, storage, quality, on_error) for k in todo]
        # Write the missing shards, each with its record.
        with folder.writing(todo):
            records = run_tasks(_write_image_shard, tasks, np.diff(bounds)[todo], executor=executor,
                                workers=workers, progress=progress, unit="img")
        _warn_skipped(records, on_error)
        # Tie the shards together once every task is done (by any part).
        metadata = index_shards(folder.root, shard_folder_metadata, missing_ok=part is not None, remote=remote)
    return _report(folder.where, metadata or _part_metadata(records, found), started, redone=damaged)


def _settings(src, found, spec, storage, quality, container, shard_size):
    """Return what a resumed conversion must share with the one it continues."""
    return {
        "kind": "image",
        "source": os.path.abspath(src),
        "source_files": source_digest(src, found.paths),
        "size": [spec.height, spec.width],
        "resize": spec.resize,
        "resample": spec.resample,
        "storage": storage,
        "quality": quality if storage == "jpeg" else None,
        "format": container,
        "shard_size": shard_size,
    }


def _plan(src, found, spec, storage, quality, settings):
    """Return the plan: inputs per shard from the bytes a sample takes, and what the index needs of the scan."""
    sample_bytes = 3 * spec.height * spec.width
    if storage == "jpeg":
        sample_bytes = _estimated_jpeg_bytes(src, found.paths, spec, quality) or sample_bytes
    plan = {
        "kind": "image",
        "container": settings["format"],
        "settings": settings,
        "num_inputs": len(found.paths),
        "samples_per_shard": samples_per_shard(settings["shard_size"], sample_bytes),
        "sample_metadata": sample_metadata(found.classes, spec, storage, quality),
        "source": source_metadata(src, found),
        "unreadable": [list(pair) for pair in found.unreadable],
    }
    return {**plan, "conversion": conversion_id(plan)}  # see NOTE [shard identity] in formats/shards.py


def _estimated_jpeg_bytes(src, paths, spec, quality):
    """Return the mean JPEG size of up to 32 evenly spaced usable inputs (0 if none is usable).

    Depends only on the sorted inputs, so the shard boundaries do too.
    """
    picks = np.unique(np.linspace(0, len(paths) - 1, min(_ESTIMATE_INPUTS, len(paths))).round().astype(np.int64))
    sizes = []
    for index in picks.tolist():
        ok, payload, _, _ = prepare_one(os.path.join(src, paths[index]), spec, "jpeg", quality)
        if ok:
            sizes.append(len(payload))
    close_c_stderr()
    return int(np.mean(sizes)) if sizes else 0


@dataclass(frozen=True)
class _ShardTask:
    """Inputs ``[start, start + len(paths))`` -> shard ``number`` of ``root`` (picklable, for any engine)."""

    root: str
    number: int
    start: int
    src: str
    paths: list
    labels: np.ndarray
    spec: object
    storage: str
    quality: int
    container: str
    on_error: str
    metadata: dict
    remote: object = None  # a URL's RemoteFolder: root is then the staging folder of the worker's machine
    conversion: str | None = None  # the plan's id, recorded by every shard (None: a plan written before ids)


def _task(folder, number, bounds, src, found, spec, storage, quality, on_error):
    start, stop = int(bounds[number]), int(bounds[number + 1])
    return _ShardTask(folder.root, number, start, os.fspath(src), found.paths[start:stop], found.labels[start:stop],
                      spec, storage, quality, folder.container, on_error, folder.plan["sample_metadata"],
                      folder.remote, folder.plan.get("conversion"))


def _write_image_shard(task):
    """Prepare a task's images, write its shard and its record; return the record (NOTE [shard records])."""
    try:
        kept, samples, skipped, stats = _prepare_shard(task)
    finally:
        close_c_stderr()
    labels = task.labels[kept]
    stop = task.start + len(task.paths)
    place = {"number": task.number, "inputs": [task.start, stop]}  # see NOTE [shard identity] in formats/shards.py
    if task.conversion is not None:
        place["conversion"] = task.conversion
    metadata = {**task.metadata, "num_samples": len(kept), "shard": place}
    root = task.root if task.remote is None else task.remote.worker_root()
    facts = {"name": None, "bytes": 0, "crc32": None}
    if kept:
        facts = write_shard(root, task.number, task.container, _columns(samples, labels, task), metadata)
    record = {
        "inputs": [task.start, stop],
        "num_samples": len(kept),
        **facts,
        "class_counts": np.bincount(labels, minlength=len(task.metadata["classes"])).tolist(),
        "label_runs": label_runs(labels),
        "pixels": stats.pixels,
        "sums": [int(s) for s in stats.sums],
        "squares": [int(s) for s in stats.squares],
        "skipped": skipped,
    }
    return save_record(root, task.number, record, task.remote)


def _prepare_shard(task):
    """Return ``(kept positions, samples, [[path, reason, input index], ...] skipped, PixelStats)``.

    Raw samples go straight into uint8 ``[kept, 3, H, W]`` rows (one shard of
    memory per worker); JPEG samples are a list of bytes.
    """
    spec, rows = task.spec, None
    if task.storage == "raw":
        rows = np.empty((len(task.paths), 3, spec.height, spec.width), dtype=np.uint8)
    kept, payloads, skipped, stats = [], [], [], PixelStats()
    for position, path in enumerate(task.paths):
        ok, payload, sums, reason = prepare_one(os.path.join(task.src, path), spec, task.storage, task.quality)
        if not ok:
            if task.on_error == "raise":
                handle_bad_input("image", path, task.start + position, reason, "raise")
            skipped.append([path, reason, task.start + position])
            continue
        if rows is None:
            payloads.append(payload)
        else:
            rows[len(kept)] = payload.transpose(2, 0, 1)
        kept.append(position)
        stats.add(sums)
    return kept, payloads if rows is None else rows[: len(kept)], skipped, stats


def _columns(samples, labels, task):
    if task.storage == "raw":
        return Columns(samples, labels)
    offsets = np.cumsum([0] + [len(p) for p in samples], dtype=np.int64)
    return Columns(np.frombuffer(b"".join(samples), dtype=np.uint8), labels, offsets)


def shard_folder_metadata(plan, records):
    """Return the index metadata from the plan and every task's record: what one file's metadata would hold.

    Raises:
        SourceError: a class kept no image.
    """
    classes = plan["sample_metadata"]["classes"]
    class_counts = np.zeros(len(classes), dtype=np.int64)
    stats = PixelStats()
    for record in records:
        class_counts += record["class_counts"]
        if record["pixels"]:
            stats.add((record["pixels"], record["sums"], record["squares"]))
    skipped = [tuple(pair) for pair in plan["unreadable"]]
    skipped += [(path, reason) for record in records for path, reason, _ in record["skipped"]]
    check_classes_kept(classes, class_counts, plan["source"]["root"], skipped)
    return {
        **plan["sample_metadata"],
        "num_samples": int(class_counts.sum()),
        "class_counts": class_counts.tolist(),
        **stats.mean_std(),
        "source": plan["source"],
        "skipped": [{"path": path, "reason": reason} for path, reason in skipped],
    }


def _warn_skipped(records, on_error):
    """Apply ``on_error`` "warn" to the images this run skipped, in input order."""
    skipped = sorted((index, path, reason) for record in records for path, reason, index in record["skipped"])
    for index, path, reason in skipped:
        handle_bad_input("image", path, index, reason, on_error)


def _part_metadata(records, found):
    """What this part wrote, for its report, while other parts are still running."""
    skipped = [{"path": path, "reason": reason} for r in records for path, reason, _ in r["skipped"]]
    return {"num_samples": sum(r["num_samples"] for r in records), "skipped": skipped, "source": {
        "ignored": found.ignored}}


def _report(root, metadata, started, finished=False, redone=()):
    skipped = [(entry["path"], entry["reason"]) for entry in metadata["skipped"]]
    return ConversionReport(root, metadata["num_samples"], skipped, time.perf_counter() - started, "img",
                            metadata["source"]["ignored"], finished=finished, redone=list(redone))
