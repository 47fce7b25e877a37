"""The device pipeline: host batches -> device -> augment -> normalize -> dtype -> memory format.

NOTE [device pipeline]: make_loader(device=...) sends every batch through a
DevicePipeline in the process that iterates the loader (after the
read-ahead thread or the workers): the uint8 batch crosses the bus (4x fewer
bytes than float32), then the batched augmentation of augment.py, the
normalization, the dtype and the memory format run on the device as whole-
batch tensor ops. Each batch travels with its global sample indices and its
epoch (a HostBatch), since the augmentation's random parameters are a
function of ``(seed, epoch, index)`` (NOTE [counter-based draws] in
augment.py): the same batches come out for any number of workers, and a
resumed loader continues with the same parameters. On the CPU the transfer
is the identity and everything else runs as on a GPU, so the whole pipeline
is tested on machines without one. With nothing to do it costs 1.4 us a
batch (2,000 host batches of 256 through ``run``, best of 7, 2 shared
cores), against 0.6-1.1 ms to read 256 cached 64 px raw images.

NOTE [fused crop]: on a file whose decoder takes a ``crop`` read option
(JPEG storage), a RandomResizedCrop (alone or first in a Compose) is chosen
before decoding: the HostReader passes ``ResizedCrop(size, boxes)`` to
``read_batch``, the decoder reads each image's size from its header, asks
for the boxes and decodes each box at the smallest DCT scale straight into
the batch buffer; the pipeline then applies only the flips (transforms
after the crop get its uint8 output). The boxes are the same function of
``(seed, epoch, index)`` as the unfused crop's, so in worker processes too
(the reader, not the pipeline, travels to them). Measured on 2 shared
cores (load ~5), 64 photo-like 256 px JPEGs to 224 px, best of 5: the
fused read 136 ms then flips and normalization 136 ms, against a full read
38 ms then the crop on the batch and normalization 374 ms; through
make_loader (512 images, medians of 5 interleaved rounds) 167 against
174 img/s at 224 px and 393 against 369 img/s at 112 px, too noisy on this
machine to rank.
"""

import collections
import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from fastdata.errors import OptionError
from fastdata.loading.augment import Compose, Normalize, RandomResizedCrop
from fastdata.loading.cudacopy import CudaCopier
from fastdata.loading.decoders import ResizedCrop
from fastdata.loading.overlap import read_on_thread


class HostBatch(NamedTuple):
    """A batch as read on the host: ``tensors`` (what ``read_batch`` returned), its int64 ``indices`` and ``epoch``."""

    tensors: tuple
    indices: np.ndarray
    epoch: int


def read_batch(dataset, indices, epoch, pin_memory=False, options=None):
    """Return ``dataset.read_batch(indices, pin_memory, **options)``, given ``epoch`` too where the dataset reads
    by epoch (``"epoch"`` among its ``read_options``: a Mixture's sources draw anew each epoch)."""
    options = options or {}
    if "epoch" in getattr(dataset, "read_options", ()):
        options = {**options, "epoch": epoch}
    return dataset.read_batch(indices, pin_memory, **options)


class HostReader:
    """Read a pipeline's host batches; with ``crop`` (a RandomResizedCrop) fused into decoding (see NOTE [fused crop]).

    Holds no device state, so it pickles into DataLoader workers.
    """

    def __init__(self, crop: RandomResizedCrop | None = None, seed: int = 0):
        self.crop, self.seed = crop, seed

    def read(self, dataset, indices: np.ndarray, epoch: int, pin_memory: bool = False,
             options: dict | None = None) -> HostBatch:
        """Return ``dataset.read_batch(indices, pin_memory, **options)`` as a HostBatch of ``epoch``."""
        options = options or {}
        if self.crop is not None:
            boxes = functools.partial(self.crop.boxes, self.seed, epoch, indices)
            options = {**options, "crop": ResizedCrop(self.crop.size, boxes)}
        return HostBatch(read_batch(dataset, indices, epoch, pin_memory, options), indices, epoch)

    def max_batch_bytes(self, dataset, batch_size: int, options: dict) -> int:
        """Return the most bytes of a batch of ``batch_size`` this reader reads: of the crop's size where fused."""
        if self.crop is not None:
            options = {**options, "crop": ResizedCrop(self.crop.size, None)}
        return dataset.max_batch_bytes(batch_size, **options)


class DevicePipeline:
    """Move host batches to ``device`` and transform them there (see NOTE [device pipeline]).

    Args:
        device: a torch.device of type "cpu" or "cuda".
        augment: None, or a batched transform ``(images, indices, epoch, seed) -> images`` (augment.py).
        normalize: None, or ``(mean, std)`` per channel in [0, 1] units.
        dtype: the images' dtype (default: float32 with ``normalize``, else as augmented).
        memory_format: the images' memory format (default: as augmented).
        seed: the augmentation's seed.
        ahead: batches whose copy is issued before the consumer gets the current one (at least 1).
        fuse_crop: whether the crop of a leading RandomResizedCrop runs in the decoder (see NOTE [fused crop]).
    """

    def __init__(self, device: torch.device, *, augment=None, normalize=None, dtype=None, memory_format=None,
                 seed: int = 0, ahead: int = 1, fuse_crop: bool = False, image_fields: tuple = (),
                 box_fields: dict | None = None):
        self.device, self.seed, self.ahead = device, seed, max(1, ahead)
        self.image_fields = image_fields  # dict batches (records): the fields transformed as images
        self.box_fields = box_fields or {}  # and the box fields moved with them: {boxes field: image field}
        crop, augment = _split_crop(augment) if fuse_crop else (None, augment)
        if crop is not None and normalize is None and dtype is None:
            dtype = torch.float32  # as the unfused RandomResizedCrop returns (see _Flips)
        self.reader = HostReader(crop, seed)
        self.augment = augment
        self.normalize = None
        if normalize is not None:
            mean, std = normalize
            self.normalize = Normalize(mean, std, dtype=dtype or torch.float32,
                                       memory_format=memory_format or torch.preserve_format)
        self.dtype, self.memory_format = dtype, memory_format
        self._copier = CudaCopier(device, self.ahead + 2) if device.type == "cuda" else None

    def run(self, batches: Iterable[HostBatch]) -> Iterator[tuple]:
        """Yield each host batch's tensors on the device, transformed, issuing copies ``ahead`` batches early.

        NOTE [copies off the training thread]: with a copier (a CUDA device)
        the host batches are staged and their copies issued on a thread of
        their own, ``ahead`` batches deep (read_on_thread), so the thread
        that trains only waits for each copy's event and transforms. A batch
        that arrives unpinned (a helper process's slot, ``pin_memory=False``)
        is then copied into its pinned slot there, not inside ``next()``:
        25 MB of 224 px images a step, 3-5 ms at the 5-7 GB/s the first
        H200 run read and copied host memory at, beside a ResNet-18 step of
        11 ms. The thread's steps in turn: take a batch from the source
        (a read-ahead thread, a helper process), wait for its slot's last
        copy, stage, issue the copy; the source is closed on the training
        thread once the staging thread has ended. Not measured on a GPU yet.
        """
        if self._copier is not None:
            yield from self._run_staged(batches)
            return
        in_flight = collections.deque()
        with contextlib.closing(batches) if hasattr(batches, "close") else contextlib.nullcontext():
            for batch in batches:  # closed with this generator: a read-ahead thread stops
                in_flight.append(self._start(batch))
                if len(in_flight) > self.ahead:
                    yield self._finish(*in_flight.popleft())
        while in_flight:
            yield self._finish(*in_flight.popleft())

    def _run_staged(self, batches):
        """run() with the copies issued on a staging thread (see NOTE [copies off the training thread])."""
        staged = self._staged(batches)
        ahead = read_on_thread(staged, self.ahead)
        try:
            for started in ahead:
                yield self._finish(*started)
        finally:
            ahead.close()  # the staging thread stops and is joined
            staged.close()  # then the source, from this thread

    def _staged(self, batches):
        with contextlib.closing(batches) if hasattr(batches, "close") else contextlib.nullcontext():
            for batch in batches:
                yield self._start(batch)

    def _start(self, batch):
        """Issue the copy of ``batch`` to the device; return what _finish needs."""
        tensors, indices, epoch = batch
        if self._copier is None:
            return tensors, indices, epoch, None
        if isinstance(tensors, dict):  # a record batch: its tensors move, its lists (text, JSON) stay
            names = [name for name, value in tensors.items() if isinstance(value, torch.Tensor)]
            moved, ready = self._copier.copy([tensors[name] for name in names])
            return {**tensors, **dict(zip(names, moved))}, indices, epoch, (ready, names)
        tensors, ready = self._copier.copy(tensors)
        return tensors, indices, epoch, ready

    def _finish(self, tensors, indices, epoch, ready):
        """Wait for the copy on the consumer's stream, then transform the images (not labels or lengths)."""
        if isinstance(tensors, dict):
            if ready is not None:
                event, names = ready
                self._copier.wait([tensors[name] for name in names], event)
            return self._records(tensors, indices, epoch)
        if ready is not None:
            tensors = self._copier.wait(tensors, ready)
        images, *rest = tensors  # text: tokens, which take no transform (make_pipeline refuses them one)
        return self.transform(images, indices, epoch), *rest

    def _records(self, batch, indices, epoch):
        """Return a dict batch with its image fields transformed and their box fields moved alike."""
        out = dict(batch)
        for name in self.image_fields:
            out[name] = self.transform(batch[name], indices, epoch)
        if self.augment is not None:
            for name, image in self.box_fields.items():  # see NOTE [boxes move] in augment.py
                boxes, lengths = batch[name], batch[name + "_lengths"]
                moved, _ = self.augment.move_boxes(boxes.float(), indices, epoch, self.seed, batch[image].shape[-2:])
                inside = torch.arange(boxes.shape[1], device=boxes.device)[None, :] < lengths.to(boxes.device)[:, None]
                out[name] = moved * inside[..., None]  # rows past a record's length stay zero
        return out

    def transform(self, images: torch.Tensor, indices: np.ndarray, epoch: int) -> torch.Tensor:
        """Return ``images`` (on the device) augmented, normalized, in the pipeline's dtype and memory format."""
        if self.augment is not None:
            images = self.augment(images, indices, epoch, self.seed)
        if self.normalize is not None:
            return self.normalize(images)
        if self.dtype is not None or self.memory_format is not None:
            images = images.to(self.dtype or images.dtype, memory_format=self.memory_format or torch.preserve_format)
        return images


class _Flips:
    """The rest of a RandomResizedCrop whose crop ran in the decoder: its flips, in place on the uint8 batch.

    In place: the batch is the pipeline's own (the decoder's new crop buffer, or its device copy). Flipping
    uint8 rather than float32 as the unfused crop returns: 32 against 151 ms for half of 64 rows of
    224 x 224 (channels_last, 2 shared cores); the pipeline casts to float32 at the end instead where
    nothing else sets the dtype.
    """

    def __init__(self, crop):
        self.crop = crop

    def __call__(self, images, indices, epoch, seed):
        rows = np.flatnonzero(self.crop.flips(seed, epoch, indices))
        if len(rows):  # positions, not a mask: a mask index waits for the device to count it
            rows = torch.from_numpy(rows).to(images.device)
            images[rows] = images[rows].flip(-1)
        return images


def _split_crop(augment):
    """Return ``(the leading RandomResizedCrop or None, what the pipeline still applies on the batch)``."""
    if isinstance(augment, RandomResizedCrop):
        return augment, _Flips(augment)
    if isinstance(augment, Compose) and augment.transforms and isinstance(augment.transforms[0], RandomResizedCrop):
        crop = augment.transforms[0]
        return crop, Compose(_Flips(crop), *augment.transforms[1:])
    return None, augment


def make_pipeline(dataset, *, device=None, augment=None, normalize=False, dtype=None, memory_format=None, seed=0,
                  ahead=1) -> DevicePipeline | None:
    """Return the DevicePipeline of make_loader's options for ``dataset``, or None for ``device=None``.

    Raises:
        OptionError: an option without ``device``, one that does not apply to a text file, a CUDA device
            without CUDA, a normalization the file has no statistics for or that ``augment`` already does,
            or a ``dtype`` that cannot hold the images (see _check_dtype).
        TypeError: ``augment`` is not callable, ``dtype`` not a torch.dtype or ``memory_format`` not a
            torch.memory_format.
    """
    given = [name for name, value in (("augment", augment), ("normalize", normalize), ("dtype", dtype),
                                      ("memory_format", memory_format)) if value is not None and value is not False]
    if device is None:
        if given:
            raise OptionError(f"{', '.join(given)} run in the device pipeline: pass device='cpu' or device='cuda' "
                              "too")
        return None
    image_fields, box_fields = (), {}
    if getattr(dataset, "kind", None) == "records":  # dict batches: tensors move, image fields transform
        image_fields = tuple(name for name in dataset.fields if dataset.schema[name].type == "image")
        box_fields = {name: dataset.schema[name].boxes for name in dataset.fields
                      if dataset.schema[name].boxes in image_fields}
        if len(image_fields) > 1 and augment is not None:
            raise OptionError(f"augment draws one crop per record, and {dataset.path!r} reads the image fields "
                              f"{', '.join(image_fields)}; pick one with open_dataset(..., fields=[...])")
        if box_fields and augment is not None and not hasattr(augment, "move_boxes"):
            raise OptionError(f"augment {augment!r} cannot move the boxes of {', '.join(box_fields)} with their "
                              "images (it has no move_boxes); use fastdata.loading.augment's transforms, or leave "
                              "the box fields out of fields=")
        if given and not image_fields:
            raise OptionError(f"{', '.join(given)} transform image fields; {dataset.path!r} reads none "
                              f"(fields {', '.join(dataset.fields)})")
    device = _check_device(device)
    if given and getattr(dataset, "kind", None) in ("text", "sequences", "mixture"):
        raise OptionError(f"{', '.join(given)} apply to image batches; a text dataset's batches only move to "
                          f"device={str(device)!r}")
    if augment is not None and not callable(augment):
        raise TypeError(f"augment should be a batched transform (images, indices, epoch, seed) -> images, e.g. "
                        f"fastdata.loading.augment.RandomCrop; got {type(augment).__name__}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype should be a torch.dtype such as torch.float16, got {dtype!r}")
    if memory_format is not None and not isinstance(memory_format, torch.memory_format):
        raise TypeError(f"memory_format should be a torch.memory_format such as torch.channels_last, "
                        f"got {memory_format!r}")
    _check_normalization(augment, normalize)
    _check_dtype(dtype, normalized=normalize is not False and normalize is not None or _normalizes(augment))
    fuse_crop = "crop" in getattr(dataset, "read_options", ())
    return DevicePipeline(device, augment=augment, normalize=_statistics(dataset, normalize), dtype=dtype,
                          memory_format=memory_format, seed=seed, ahead=ahead, fuse_crop=fuse_crop,
                          image_fields=image_fields, box_fields=box_fields)


def _normalizes(augment):
    """Whether ``augment`` is a Normalize or a Compose holding one."""
    if isinstance(augment, Normalize):
        return True
    return isinstance(augment, Compose) and any(_normalizes(transform) for transform in augment.transforms)


def _check_normalization(augment, normalize):
    """Refuse a Normalize in ``augment`` together with ``normalize``: the batches would be normalized twice."""
    if _normalizes(augment) and normalize is not False and normalize is not None:
        raise OptionError(f"augment={augment!r} normalizes, and normalize={normalize!r} would normalize the "
                          "batches a second time; pass normalize=False, or leave Normalize out of augment")


def _check_dtype(dtype, normalized):
    """Refuse a ``dtype`` that cannot hold the batches: normalized ones need floats, others 0..255.

    A cast of 0..255 pixels to int8 wraps 255 to -1, to bool makes every pixel but black True, and to a
    float8 rounds them to a few dozen values; every integer and float dtype that holds 0..255 exactly
    is taken.
    """
    if dtype is None:
        return
    if normalized:
        if not dtype.is_floating_point:
            raise OptionError(f"dtype should be a floating dtype for normalized images (torch.float32, float16, "
                              f"bfloat16), got dtype={dtype}")
        return
    if not _holds_pixels(dtype):
        raise OptionError(f"dtype={dtype} cannot hold pixel values 0..255 (without normalize the images are only "
                          "cast): pass torch.uint8, int16, int32, int64, float16, bfloat16, float32 or float64, or "
                          "normalize=True for floats around 0")


def _holds_pixels(dtype):
    """Whether ``dtype`` holds every integer 0..255 exactly."""
    if dtype.is_floating_point:
        return torch.finfo(dtype).eps <= 2.0**-7  # 8 significant bits or more: every integer up to 256
    if dtype == torch.bool or dtype.is_complex:
        return False
    try:
        info = torch.iinfo(dtype)
    except TypeError:  # quantized dtypes
        return False
    return info.min <= 0 and info.max >= 255


def _check_device(device):
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise OptionError(f"device should be 'cpu', 'cuda' or a torch.device, got device={device!r}") from exc
    if device.type not in ("cpu", "cuda"):
        raise OptionError(f"device should be 'cpu' or 'cuda', got device={str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"device={str(device)!r} but CUDA is not available here; pass device='cpu'")
    return device


def _statistics(dataset, normalize):
    """Return ``(mean, std)`` for ``normalize``: False -> None, True -> the file's stored ones, else as given."""
    if normalize is False or normalize is None:
        return None
    if normalize is True:
        metadata = getattr(dataset, "metadata", None) or {}
        mean, std = metadata.get("mean"), metadata.get("std")
        if mean is None or std is None:
            raise OptionError(f"normalize=True needs the mean and std a converter stores, and "
                              f"{getattr(dataset, 'path', dataset)!r} has none; pass normalize=(mean, std) "
                              "in [0, 1] units")
        return mean, std
    try:
        mean, std = normalize
        outside = np.any(np.abs(np.asarray(mean, dtype=np.float64)) > 1) or np.any(np.asarray(std, np.float64) > 1)
    except (TypeError, ValueError) as exc:
        raise OptionError(f"normalize should be True, False or (mean, std) per channel in [0, 1] units, "
                          f"got normalize={normalize!r}") from exc
    if outside:  # 0..255 units, e.g. (123.7, 116.3, 103.5): the images would come out ~255x too small
        raise OptionError(f"normalize's mean and std are in [0, 1] units (as torchvision's ToTensor gives), "
                          f"got normalize={normalize!r}; divide them by 255")
    return mean, std
