"""read_batch(crop=ResizedCrop(...)) on jpeg files: each row is its stored bytes through decode_jpeg_resized_crop."""

from functools import partial

import h5py
import numpy as np
import pytest
import torch
from support import NUM_CLASSES, PER_CLASS
from support import run_cli as run

from fastdata import open_dataset
from fastdata.codecs.images import decode_jpeg_resized_crop
from fastdata.errors import FormatError
from fastdata.formats import read_packed
from fastdata.loading.augment import RandomResizedCrop
from fastdata.loading.decoders import JpegImageDecoder, ResizedCrop

NUM_SAMPLES = NUM_CLASSES * PER_CLASS
STORED = 96


@pytest.fixture(scope="module", params=[".h5", ".arrow"])
def jpeg_file(request, source_root, tmp_path_factory):
    """``source_root`` converted by the CLI to jpeg storage at 96 px."""
    out = tmp_path_factory.mktemp("fused") / f"photos{request.param}"
    result = run("convert", "imagefolder", source_root, out, "--storage", "jpeg", "--size", STORED, "--workers", "1",
                 "--quiet")
    assert result.exit_code == 0, result.output
    return out


class Boxes:
    """A ``boxes(heights, widths)`` that draws boxes inside each image from a seed and records every call."""

    def __init__(self, seed=0):
        self.seed, self.calls = seed, []

    def __call__(self, heights, widths):
        self.calls.append((heights.copy(), widths.copy()))
        rng = np.random.default_rng(self.seed)
        box_heights, box_widths = rng.integers(1, heights + 1), rng.integers(1, widths + 1)
        tops, lefts = rng.integers(0, heights - box_heights + 1), rng.integers(0, widths - box_widths + 1)
        return np.stack([tops, lefts, box_heights, box_widths], axis=1).astype(np.int64)


def stored_bytes(path, index):
    columns, _ = read_packed(path)
    return bytes(columns.samples[columns.offsets[index] : columns.offsets[index + 1]])


@pytest.mark.parametrize("size", [(64, 48), (STORED, STORED), (160, 130)])  # shrunk, about the same, enlarged
def test_each_row_is_its_stored_jpeg_decoded_through_the_fused_crop(jpeg_file, size):
    ds, boxes = open_dataset(jpeg_file), Boxes()
    indices = np.array([5, 0, 17, 3, 3, NUM_SAMPLES - 1])
    images, labels = ds.read_batch(indices, crop=ResizedCrop(size, boxes))
    assert images.shape == (len(indices), 3, *size) and images.dtype == torch.uint8
    assert images.is_contiguous(memory_format=torch.channels_last)  # see NOTE [channels last]
    assert torch.equal(labels, ds.read_batch(indices)[1])
    ((heights, widths),) = boxes.calls  # asked once for the batch, with the sizes in the rows' headers
    assert heights.tolist() == widths.tolist() == [STORED] * len(indices)
    for row, (index, box) in enumerate(zip(indices.tolist(), boxes(heights, widths))):
        want = decode_jpeg_resized_crop(stored_bytes(jpeg_file, index), box, size)
        assert torch.equal(images[row].permute(1, 2, 0), torch.from_numpy(want))


def test_a_whole_image_box_at_the_stored_size_is_the_plain_read(jpeg_file):
    ds = open_dataset(jpeg_file)
    whole = ResizedCrop((STORED, STORED), lambda h, w: np.stack([0 * h, 0 * w, h, w], axis=1))
    assert torch.equal(ds.read_batch(np.arange(NUM_SAMPLES), crop=whole)[0], ds.read_batch(np.arange(NUM_SAMPLES))[0])


def test_one_and_two_threads_give_the_same_batch(jpeg_file):
    ds, crop = open_dataset(jpeg_file), ResizedCrop((40, 56), Boxes(seed=7))
    indices = np.arange(NUM_SAMPLES)[::-1].copy()
    one, two = (ds.read_batch(indices, crop=crop, threads=threads)[0] for threads in (1, 2))
    assert torch.equal(one, two)


def test_a_shard_folder_crops_every_part_as_its_single_file_does(shard_folders, shard_single):
    folder, single = open_dataset(shard_folders("hdf5", "jpeg")), open_dataset(shard_single("hdf5", "jpeg"))
    indices = np.random.default_rng(0).permutation(len(single))  # rows from every shard, in any order
    crop = ResizedCrop((24, 40), Boxes(seed=3))
    assert torch.equal(folder.read_batch(indices, crop=crop)[0], single.read_batch(indices, crop=crop)[0])


def test_max_batch_bytes_counts_the_crop_size(jpeg_file):
    ds = open_dataset(jpeg_file)
    for size in [(8, 8), (200, 300)]:
        crop = ResizedCrop(size, Boxes())
        images = ds.read_batch(np.arange(NUM_SAMPLES), crop=crop)[0]
        assert images.numel() == NUM_SAMPLES * 3 * size[0] * size[1]
        assert ds.max_batch_bytes(NUM_SAMPLES, crop=crop) == images.numel() + 8 * NUM_SAMPLES  # plus the labels
    assert ds.max_batch_bytes(4) == 4 * 3 * STORED * STORED + 8 * 4


def test_boxes_of_the_wrong_shape_are_refused(jpeg_file):
    ds = open_dataset(jpeg_file)
    with pytest.raises(ValueError, match=r"crop.boxes should return \[B, 4\]"):
        ds.read_batch(np.arange(3), crop=ResizedCrop((8, 8), lambda h, w: np.zeros((3, 3), np.int64)))


@pytest.mark.parametrize("box", [(-1, 0, 10, 10), (0, 0, 0, 10), (0, 0, STORED + 1, 10), (0, 90, 10, 7)])
def test_a_box_outside_its_image_is_refused_naming_the_sample(jpeg_file, box):
    ds = open_dataset(jpeg_file)
    boxes = [(0, 0, STORED, STORED), box, (1, 2, 3, 4)]
    with pytest.raises(ValueError, match=rf"crop.boxes gave \({', '.join(map(str, box))}\).*sample 7 of .*photos.*"
                                         rf"outside its {STORED}x{STORED} image"):
        ds.read_batch(np.array([2, 7, 9]), crop=ResizedCrop((8, 8), lambda h, w: np.array(boxes)))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("damage", ["header", "scan"])
def test_a_damaged_stored_jpeg_names_the_file_and_the_sample(source_root, tmp_path, threads, damage):
    path = tmp_path / "damaged.h5"
    run("convert", "imagefolder", source_root, path, "--storage", "jpeg", "--size", STORED, "--workers", "1",
        "--quiet")
    with h5py.File(path, "r") as f:
        start, stop = (int(offset) for offset in f["offsets"][5:7])
        where = f["samples"].id.get_offset() + start
    if damage == "header":  # zero it all, SOI marker included: the size cannot be read
        length = stop - start
    else:  # zero the second half of the entropy-coded data: the header reads, the pixels do not decode
        where, length = where + (stop - start) // 2, (stop - start) // 2 - 2
    with open(path, "r+b") as f:
        f.seek(where)
        f.write(bytes(length))
    ds, crop = open_dataset(path), ResizedCrop((32, 32), Boxes())
    with pytest.raises(FormatError, match=r"damaged\.h5.*sample 5 does not decode.*convert the source again"):
        ds.read_batch(np.arange(NUM_SAMPLES), crop=crop, threads=threads)
    assert ds.read_batch(np.array([4, 6]), crop=crop, threads=threads)[0].shape == (2, 3, 32, 32)


def test_the_crop_is_a_read_option_of_jpeg_files_only(jpeg_file, packed_files):
    assert "crop" in open_dataset(jpeg_file).read_options and "crop" in JpegImageDecoder.read_options
    assert "crop" not in open_dataset(packed_files("hdf5", "raw")).read_options


def test_random_resized_crop_boxes_as_the_loader_binds_them(jpeg_file):
    ds, rrc = open_dataset(jpeg_file), RandomResizedCrop((40, 32))
    indices = np.array([3, 11, 12, 20])
    for epoch in (0, 1):
        images = ds.read_batch(indices, crop=ResizedCrop(rrc.size, partial(rrc.boxes, 5, epoch, indices)))[0]
        boxes = rrc.boxes(5, epoch, indices, np.full(4, STORED), np.full(4, STORED))
        for row, (index, box) in enumerate(zip(indices.tolist(), boxes)):
            want = decode_jpeg_resized_crop(stored_bytes(jpeg_file, index), box, rrc.size)
            assert torch.equal(images[row].permute(1, 2, 0), torch.from_numpy(want))
