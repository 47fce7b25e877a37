"""Turn stored rows into tensors: one Decoder subclass per kind of packed file."""

import abc
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from fastdata._cpu import usable_cpus
from fastdata.codecs.images import decode_jpeg, decode_jpeg_resized_crop, jpeg_decoder_into, jpeg_size
from fastdata.errors import FormatError, OptionError
from fastdata.reading.buffers import BufferPool
from fastdata.reading.parts import Part, Parts
from fastdata.reading.rowcopy import RowCopier


class Decoder(abc.ABC):
    """Turn the stored rows of one ``(kind, storage)`` of packed file into tensors.

    A decoder reads the ``Columns`` of open files (``samples``, ``offsets``,
    ``labels``). ``item`` and ``batch`` give the same values for the same
    sample, and ``unbatch`` turns a batch back into those items;
    ``batch_parts`` reads the rows of several files (the shards of a folder)
    into one batch, equal to the items of each in turn. DecoderContract in
    tests/loading checks every decoder against this.

    Attributes:
        read_options: names of the keyword options ``batch_parts`` (and
            ``batch``) take besides ``pin_memory``; ``read_batch`` passes them on, and make_loader
            sets only the ones a decoder names.
        copies_in_background: whether ``start_parts`` leaves the batch being
            read on helper threads, off the GIL, until it is finished.
    """

    read_options: tuple[str, ...] = ()
    copies_in_background = False

    def __init__(self, metadata: dict, path: str):
        self.path = path

    @abc.abstractmethod
    def item(self, columns, index: int, path: str | None = None) -> torch.Tensor:
        """Return sample ``index`` read on its own; errors name ``path`` (default: the decoder's)."""

    def batch(self, columns, indices: np.ndarray, pin_memory: bool = False, **options) -> tuple[torch.Tensor, ...]:
        """Return the samples at int64 ``indices`` (checked, in range) as a tuple of batch tensors."""
        return self.batch_parts(Parts([columns], indices, [0, len(indices)], [self.path]), pin_memory, **options)

    @abc.abstractmethod
    def batch_parts(self, parts: Sequence[Part], pin_memory: bool = False, **options) -> tuple[torch.Tensor, ...]:
        """Return the rows of every part, in order, as one tuple of batch tensors (no parts: an empty batch)."""

    def start_parts(self, parts: Sequence[Part], pin_memory: bool = False,
                    **options) -> Callable[[], tuple[torch.Tensor, ...]]:
        """Begin ``batch_parts``; return a function that finishes it (call it once, before the parts are released).

        Default: the batch is read here. A decoder that ``copies_in_background``
        leaves it running on helper threads (NOTE [pipelined reads] in batchloader.py).
        """
        batch = self.batch_parts(parts, pin_memory, **options)
        return lambda: batch

    def unbatch(self, *samples: torch.Tensor) -> Sequence[torch.Tensor]:
        """Return the items of a batch, one per row, equal to what ``item`` gives (default: the rows of one tensor)."""
        (batch,) = samples
        return batch

    @abc.abstractmethod
    def max_batch_bytes(self, batch_size: int, **options) -> int:
        """Return the most bytes ``batch`` returns for ``batch_size`` samples with these read options."""


class _ImageDecoder(Decoder):
    """Shared by image decoders: every sample is uint8 ``[C, H, W]`` (``sample_shape``: 3 channels, or 1 grey)."""

    def __init__(self, metadata, path):
        super().__init__(metadata, path)
        self.sample_shape = tuple(metadata["sample_shape"])

    def max_batch_bytes(self, batch_size, **options):
        return batch_size * int(np.prod(self.sample_shape))


class RawImageDecoder(_ImageDecoder):
    """uint8 images stored as fixed ``[C, H, W]`` rows: reading is a copy."""

    read_options = ("threads",)
    copies_in_background = True

    def __init__(self, metadata, path):
        super().__init__(metadata, path)
        self._buffers = BufferPool()
        self._copier = RowCopier()

    def item(self, columns, index, path=None):
        return torch.from_numpy(np.array(columns.samples[index]))

    def batch_parts(self, parts, pin_memory=False, threads=None):
        """Copy a batch on ``threads`` threads, this one included (default: all cores; 1 in a DataLoader worker).

        See NOTE [copy on two cores] in rowcopy.py.
        """
        return self.start_parts(parts, pin_memory, threads)()

    def start_parts(self, parts, pin_memory=False, threads=None):
        parts = Parts.of(parts)  # see NOTE [parts without objects]
        out = self._buffers.take((parts.num_rows, *self.sample_shape), np.uint8)
        if threads is None:
            threads = 1 if get_worker_info() is not None else usable_cpus()  # workers own a core each
        # Indices are checked already; the copier's mode="clip" spares numpy a temporary copy.
        if parts.stitched is not None:  # every part in one array: one take (see NOTE [stitched rows])
            view, rows = parts.stitched
            jobs = [(view, rows, out)]
        else:
            indices, bounds = parts.indices, parts.bounds
            jobs = [(columns.samples, indices[start:stop], out[start:stop])
                    for columns, start, stop in zip(parts.columns, bounds, bounds[1:])]
        copy = self._copier.start(jobs, threads)

        def finish():
            copy.finish()
            images = torch.from_numpy(out)
            return (images.pin_memory() if pin_memory else images,)

        return finish


class ResizedCrop(NamedTuple):
    """A random-resized-crop done while decoding JPEG rows: each row's box, resized to ``size``.

    Attributes:
        size: ``(height, width)`` of every row of the batch.
        boxes: ``boxes(heights, widths)`` takes the full-size heights and
            widths of the batch's rows (int64 ``[B]``) and returns their
            boxes, int64 ``[B, 4]`` of ``(top, left, height, width)``, each
            inside its image (e.g. RandomResizedCrop.boxes with its seed,
            epoch and indices bound).
    """

    size: tuple[int, int]
    boxes: Callable[[np.ndarray, np.ndarray], np.ndarray]


class JpegImageDecoder(_ImageDecoder):
    """Images stored as JPEG bytes: decoded on a thread pool (the decoder frees the GIL).

    NOTE [channels last]: JPEG decodes to ``[H, W, C]`` rows. A batch is
    returned as the ``[B, C, H, W]`` permuted view of those rows, i.e. a
    tensor in ``torch.channels_last`` memory format: the same values and
    shape, without a transposing copy that measured ~30% of the decode time
    at 64x64 (convolutions on GPU prefer this layout; ``.contiguous()`` gives
    NCHW strides where a model needs them).
    """

    read_options = ("threads", "crop")

    def __init__(self, metadata, path):
        super().__init__(metadata, path)
        self._pool, self._pool_size = None, 0
        self._buffers = BufferPool()

    def item(self, columns, index, path=None):
        data = columns.samples[columns.offsets[index] : columns.offsets[index + 1]]
        try:
            pixels = decode_jpeg(data, grey=self.sample_shape[0] == 1)
        except Exception as exc:
            raise self._damaged(path or self.path, index, exc) from exc
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))

    @staticmethod
    def _damaged(path, index, exc):
        """Return the error for stored bytes that do not decode, naming the file and the sample."""
        return FormatError(
            f"{path!r}: the stored JPEG of sample {index} does not decode ({type(exc).__name__}: {exc}); "
            "the file is damaged, convert the source again"
        )

    def max_batch_bytes(self, batch_size, crop=None, **options):
        if crop is None:
            return super().max_batch_bytes(batch_size)
        return batch_size * self.sample_shape[0] * int(crop.size[0]) * int(crop.size[1])

    def batch_parts(self, parts, pin_memory=False, threads=None, crop=None):
        """Decode a batch on ``threads`` threads, this one included (default: all cores; 1 in a DataLoader worker).

        The rows of every part share one pool of threads and one buffer.
        With ``crop`` (a ResizedCrop), every row is decoded straight to its
        box resized to ``crop.size`` (decode_jpeg_resized_crop): the boxes
        are asked for once, from the sizes in the rows' JPEG headers.

        NOTE [shared row counter]: every thread takes the next undecoded row
        from one counter, so the threads finish within one image of each
        other whatever the image sizes and however the OS schedules them;
        fixed halves per thread left a core idle at the end of every batch.
        The calling thread decodes too, instead of sleeping until the pool
        is done. Measured on 2 cores, 15 alternating epochs in one process:
        +9% at 64x64 and +10% at 224x224 over fixed halves.
        """
        channels, height, width = self.sample_shape
        parts = Parts.of(parts)
        sources, starts, stops = [], [], []
        for columns, indices, _ in parts:
            sources += [memoryview(columns.samples)] * len(indices)
            starts += columns.offsets[indices].tolist()
            stops += columns.offsets[indices + 1].tolist()
        if crop is not None and channels != 3:
            raise OptionError("the crop fused into decoding decodes RGB JPEGs; these are grey: crop on the device "
                              "instead (make_loader(device=..., augment=...) without the fused crop)")
        boxes = None if crop is None else self._crop_boxes(crop, parts, sources, starts, stops)
        if crop is not None:
            height, width = (int(side) for side in crop.size)
        decoded = self._buffers.take((len(starts), height, width, channels), np.uint8)
        rows = itertools.count()  # next() is atomic under the GIL

        def decode_rows():  # the least Python per image: it runs under the GIL, between decodes
            row, count, decode, size = None, len(starts), jpeg_decoder_into(channels == 1), (height, width)
            try:
                for row in rows:
                    if row >= count:
                        return
                    if boxes is None:
                        decode(sources[row][starts[row] : stops[row]], buffer=decoded[row])
                    else:
                        decode_jpeg_resized_crop(sources[row][starts[row] : stops[row]], boxes[row], size, decoded[row])
            except Exception as exc:
                raise self._damaged(*parts.row_origin(row), exc) from exc

        if threads is None:
            threads = 1 if get_worker_info() is not None else usable_cpus()  # workers own a core each
        helpers = [self._helper_pool(threads - 1).submit(decode_rows) for _ in range(min(threads, len(starts)) - 1)]
        try:
            decode_rows()
        finally:  # never return (or raise) while a helper still writes into the batch
            failures = [error for error in [helper.exception() for helper in helpers] if error is not None]
            # A pool thread sets its future's result before it drops the call it ran (decode_rows, and with it
            # these views of the shards' maps): cleared here, a shard the store closes next is unmapped at once.
            sources.clear()
        if failures:
            raise failures[0]
        images = torch.from_numpy(decoded).permute(0, 3, 1, 2)  # see NOTE [channels last]
        return (images.pin_memory() if pin_memory else images,)

    def _crop_boxes(self, crop, parts, sources, starts, stops):
        """Return ``crop.boxes`` of the batch's rows (a list of ``[top, left, height, width]``), given their sizes."""
        sizes = np.empty((len(starts), 2), np.int64)
        for row in range(len(starts)):
            try:
                sizes[row] = jpeg_size(sources[row][starts[row] : stops[row]])
            except Exception as exc:
                raise self._damaged(*parts.row_origin(row), exc) from exc
        boxes = np.asarray(crop.boxes(sizes[:, 0], sizes[:, 1]))
        if boxes.shape != (len(starts), 4):
            raise ValueError(f"crop.boxes should return [B, 4] (top, left, height, width), got shape {boxes.shape}")
        boxes = boxes.astype(np.int64)
        outside = (boxes[:, :2] < 0).any(1) | (boxes[:, 2:] < 1).any(1) | (boxes[:, :2] + boxes[:, 2:] > sizes).any(1)
        if outside.any():  # the decode would clamp such a box silently
            row = int(np.argmax(outside))
            path, index = parts.row_origin(row)
            raise ValueError(f"crop.boxes gave {tuple(boxes[row].tolist())} (top, left, height, width) for sample "
                             f"{index} of {path!r}, outside its {sizes[row, 0]}x{sizes[row, 1]} image")
        return boxes.tolist()

    def _helper_pool(self, size):
        """Return a thread pool of at least ``size`` threads (made once, grown when asked for more)."""
        if self._pool_size < size:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._pool_size = ThreadPoolExecutor(size, thread_name_prefix="fastdata-decode"), size
        return self._pool


class TokenDecoder(Decoder):
    """Token ids stored ragged (flat values + offsets): 1-D int64 items, padded batches.

    NOTE [token padding]: a batch is copied row by row, one slice per sample,
    into a ``[B, T]`` int64 array filled with ``pad_id``. Measured on 2 cores
    (best of 30 runs, 256 samples of 200-311 uint16 tokens from a memmap),
    that loop took ~0.13 ms per batch against ~0.22 ms for a ``[B, T]``
    index array under a length mask and ~0.20 ms for one flat index over the
    concatenated ranges: the vectorised gathers build int64 index arrays as
    large as the batch, which costs more than 256 slice copies.
    """

    read_options = ("pad_to",)

    def __init__(self, metadata, path):
        super().__init__(metadata, path)
        try:
            self.pad_id = int(metadata["tokenizer"]["pad_id"])
            self.max_length = int(metadata["lengths"]["max"])
        except (KeyError, TypeError, ValueError) as exc:  # damaged metadata: named, never a bare error
            raise FormatError(f"{path!r}: its metadata holds no integer tokenizer.pad_id and lengths.max "
                              f"({type(exc).__name__}: {exc}); convert the source again") from None

    def max_batch_bytes(self, batch_size, pad_to=None):
        width = self.max_length if pad_to is None else pad_to
        return batch_size * 8 * (width + 1)  # tokens [B, T] and lengths [B], int64

    def item(self, columns, index, path=None):
        values = np.asarray(columns.samples)[columns.offsets[index] : columns.offsets[index + 1]]
        return torch.from_numpy(values.astype(np.int64))

    def batch_parts(self, parts, pin_memory=False, pad_to=None):
        """Return ``(tokens int64 [B, T], lengths int64 [B])``; T is the longest of all parts or ``pad_to``."""
        starts = [part.columns.offsets[part.indices] for part in parts]
        lengths = np.concatenate([part.columns.offsets[part.indices + 1] for part in parts] or [[]]).astype(np.int64)
        lengths -= np.concatenate(starts or [[]]).astype(np.int64)
        if pad_to is not None:
            np.minimum(lengths, pad_to, out=lengths)
        width = int(lengths.max(initial=0)) if pad_to is None else pad_to
        tokens = np.full((len(lengths), width), self.pad_id, dtype=np.int64)
        row = 0
        for part, part_starts in zip(parts, starts):
            values = np.asarray(part.columns.samples)  # a plain view: memmap slices cost more to make
            part_lengths = lengths[row : row + len(part_starts)].tolist()
            for start, length in zip(part_starts.tolist(), part_lengths):  # see NOTE [token padding]
                tokens[row, :length] = values[start : start + length]
                row += 1
        tokens = torch.from_numpy(tokens)
        return (tokens.pin_memory() if pin_memory else tokens, torch.from_numpy(lengths))

    def unbatch(self, tokens, lengths):
        """Split a padded batch back into 1-D int64 items (views of ``tokens``)."""
        return [row[:length] for row, length in zip(tokens, lengths.tolist())]


DECODERS = {
    ("image", "raw"): RawImageDecoder,
    ("image", "jpeg"): JpegImageDecoder,
    ("text", "tokens"): TokenDecoder,
}


def decoder_for(metadata: dict, path: str) -> Decoder:
    """Return a new decoder for a file's metadata; raise FormatError if unknown."""
    key = (metadata.get("kind"), metadata.get("storage"))
    if key not in DECODERS:
        raise FormatError(f"{path!r}: no reader for kind={key[0]!r}, storage={key[1]!r}; upgrade fastdata")
    return DECODERS[key](metadata, path)
