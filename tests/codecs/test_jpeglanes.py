"""Decode lanes: processes that decode a share of a JPEG batch give the pixels this process would, and end."""

import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from fastdata import convert_imagefolder, open_dataset
from fastdata.codecs import jpeglanes
from fastdata.codecs.images import decode_jpeg, encode_jpeg
from fastdata.errors import FastPathWarning, FormatError
from fastdata.formats import Columns
from fastdata.loading.decoders import JpegImageDecoder
from fastdata.measure.synthetic import make_imagefolder, make_photo

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="decode lanes need memfd_create (Linux)")


def ready_lanes(count):
    """Return ``count`` of this process's lanes, ready (taken: give them back)."""
    deadline = time.monotonic() + 30
    while len(lanes := jpeglanes.take(count)) < count:
        jpeglanes.give_back(lanes)
        assert time.monotonic() < deadline, "no lane became ready within 30 s"
        time.sleep(0.02)
    return lanes


def photos(count, grey, seed):
    """Return JPEG bytes of ``count`` photos of 48x40 (RGB or grey), of varied content and quality."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        img = make_photo(rng, 48, 40)
        out.append(encode_jpeg(np.asarray(img.convert("L")) if grey else np.asarray(img), 60 + k % 40))
    return out


def column_of(jpegs):
    """Return Columns holding ``jpegs`` end to end, as a jpeg file's column."""
    offsets = np.concatenate([[0], np.cumsum([len(data) for data in jpegs])]).astype(np.int64)
    return Columns(np.frombuffer(b"".join(jpegs), np.uint8), np.zeros(len(jpegs), np.int64), offsets)


@pytest.mark.parametrize("grey", [False, True])
def test_a_lane_decodes_the_pixels_this_process_does_and_grows_its_memory_for_bigger_shares(grey):
    (lane,) = ready_lanes(1)
    try:
        for count, seed in ((3, 0), (40, 1), (5, 2)):  # the second share outgrows the first's memory
            jpegs = photos(count, grey, seed)
            column = column_of(jpegs)
            source = memoryview(np.asarray(column.samples))
            lane.start([source] * count, column.offsets[:-1].tolist(), column.offsets[1:].tolist(),
                       (40, 48, 1 if grey else 3), grey)
            rows = lane.finish().copy()
            expected = np.stack([decode_jpeg(data, grey=grey) for data in jpegs])
            assert rows.shape == expected.shape and np.array_equal(rows, expected)
            assert lane.seconds > 0
    finally:
        jpeglanes.give_back([lane])


def test_a_row_that_does_not_decode_on_a_lane_is_named_by_its_place_in_the_share():
    (lane,) = ready_lanes(1)
    try:
        jpegs = photos(6, False, 3)
        jpegs[4] = jpegs[4][:40]  # cut inside its header
        column = column_of(jpegs)
        lane.start([memoryview(np.asarray(column.samples))] * 6, column.offsets[:-1].tolist(),
                   column.offsets[1:].tolist(), (40, 48, 3), False)
        with pytest.raises(jpeglanes.LaneError) as caught:
            lane.finish()
        assert caught.value.row == 4 and lane.alive
    finally:
        jpeglanes.give_back([lane])


@pytest.fixture(scope="module")
def jpeg_file(tmp_path_factory):
    """A converted .h5 of 120 varied photos stored as 32 px JPEG."""
    work = tmp_path_factory.mktemp("lanes")
    source = make_imagefolder(work / "photos", 4, 30, size=(60, 45), seed=7, vary=True, jpeg_only=True)
    path = work / "photos.h5"
    convert_imagefolder(source, path, size=32, storage="jpeg", workers=1, progress=False)
    return path


def decoded_by_threads(path, indices):
    images, labels = open_dataset(path).read_batch(indices, threads=1)
    return images.numpy(), labels.numpy()


def test_batches_decoded_beside_lanes_equal_those_decoded_here(jpeg_file):
    lanes = ready_lanes(1)
    jpeglanes.give_back(lanes)
    before = lanes[0].requests
    dataset = open_dataset(jpeg_file)
    rng = np.random.default_rng(0)
    for size in (4, 17, 64, 120):
        indices = rng.permutation(len(dataset))[:size].astype(np.int64)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FastPathWarning)
            images, labels = dataset.read_batch(indices, threads=2)
        expected = decoded_by_threads(jpeg_file, indices)
        assert np.array_equal(images.numpy(), expected[0]) and np.array_equal(labels.numpy(), expected[1])
    assert lanes[0].requests == before + 4  # every batch had a share on the lane


def test_a_damaged_jpeg_in_a_lanes_share_names_the_file_and_the_sample():
    jpegs = photos(20, False, 4)
    jpegs[17] = b"\xff\xd8" + bytes(300)  # a JPEG start, then nothing
    decoder = JpegImageDecoder({"sample_shape": [3, 40, 48]}, "shard-0003.h5")
    jpeglanes.give_back(ready_lanes(1))
    with pytest.raises(FormatError, match=r"'shard-0003.h5'.*sample 17 does not decode"):
        decoder.batch(column_of(jpegs), np.arange(20, dtype=np.int64), threads=2)
    assert decoder._share is not None  # the lanes' path was taken


def test_a_lane_killed_is_said_once_its_share_decoded_here_and_a_new_lane_takes_its_place():
    jpegs = photos(24, False, 5)
    expected = np.stack([decode_jpeg(data) for data in jpegs]).transpose(0, 3, 1, 2)
    decoder = JpegImageDecoder({"sample_shape": [3, 40, 48]}, "photos.h5")
    (lane,) = ready_lanes(1)
    os.kill(lane.pid, signal.SIGKILL)
    lane._process.wait(10)
    jpeglanes.give_back([lane])
    with pytest.warns(FastPathWarning, match=f"decode lane \\(process {lane.pid}\\) ended"):
        (images,) = decoder.batch(column_of(jpegs), np.arange(24, dtype=np.int64), threads=2)
    assert np.array_equal(images.numpy(), expected) and not lane.alive
    (new,) = ready_lanes(1)
    try:
        assert new.pid != lane.pid and new.alive
    finally:
        jpeglanes.give_back([new])


LANE_OWNER = """
import os, signal, time
from fastdata.codecs import jpeglanes
while not (lanes := jpeglanes.take(1)):
    time.sleep(0.02)
print(lanes[0].pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.integration
def test_a_lane_ends_when_the_process_that_owns_it_is_killed():
    owner = subprocess.run([sys.executable, "-c", LANE_OWNER], capture_output=True, text=True, timeout=60)
    assert owner.returncode == -signal.SIGKILL, owner.stderr
    pid = int(owner.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _running(pid):
        assert time.monotonic() < deadline, f"lane {pid} outlived its owner by 10 s"
        time.sleep(0.05)


def test_a_forked_child_starts_lanes_of_its_own():
    parent_pid = ready_lanes(1)[0]
    jpeglanes.give_back([parent_pid])
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            (lane,) = ready_lanes(1)
            os.write(write, str(lane.pid).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as reply:
        pid = int(reply.read() or 0)
    os.waitpid(child, 0)
    assert pid and pid != parent_pid.pid


def _running(pid):
    """Whether process ``pid`` runs (a zombie left to init counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False
