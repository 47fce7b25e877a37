"""Shard folders of records: written in input order at any worker count, read as one dataset, checked whole."""

import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import assert_same_batches, assert_same_files, overwrite

from fastdata import Field, FormatError, make_loader, open_dataset, write
from fastdata.formats.shards import read_index
from fastdata.info import describe
from fastdata.verify import verify

SCHEMA = {"id": "int", "caption": "str", "tokens": Field("tokens"), "boxes": Field("ragged", shape=(4,)),
          "emb": Field("array", shape=(8,))}


def _records(count, seed=0):
    rng = np.random.default_rng(seed)
    return [{"id": index, "caption": "ü" * int(rng.integers(0, 40)),
             "tokens": rng.integers(0, 999, index % 13).tolist(),
             "boxes": rng.random((index % 4, 4)).astype(np.float32), "emb": np.full(8, index, np.float32)}
            for index in range(count)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(count=st.integers(1, 120), shard_size=st.integers(1, 6000), order=st.randoms(use_true_random=False),
       container=st.sampled_from(["hdf5", "arrow"]))
@pytest.mark.slow
def test_a_folder_reads_every_record_as_one_file_of_them_does(tmp_path, count, shard_size, order, container):
    records = _records(count)
    folder, single = tmp_path / f"folder-{container}", tmp_path / "single.h5"
    write(records, folder, SCHEMA, shard_size=shard_size, format=container, overwrite=True)
    write(records, single, SCHEMA, overwrite=True)
    index = read_index(folder)
    assert index.num_samples == count and index.starts[-1] == count
    sizes = np.diff(index.starts)
    assert (sizes > 0).all() and index.container == container
    dataset, reference = open_dataset(folder), open_dataset(single)
    indices = list(range(count))
    order.shuffle(indices)
    assert_same_batches(dataset.read_batch(indices), reference.read_batch(indices))
    assert dataset[count - 1]["id"] == count - 1


def test_the_folder_is_the_same_bytes_for_any_number_of_workers(tmp_path):
    records = _records(700)
    for workers in (1, 2):
        write(records, tmp_path / f"w{workers}", SCHEMA, shard_size=20_000, workers=workers)
    assert_same_files(tmp_path / "w1", tmp_path / "w2")
    assert read_index(tmp_path / "w1").num_shards > 3


def test_the_loader_over_a_folder_yields_the_single_files_batches_with_workers_and_resume(tmp_path):
    records = _records(300)
    write(records, tmp_path / "folder", SCHEMA, shard_size=8_000)
    write(records, tmp_path / "single.arrow", SCHEMA)
    here = list(make_loader(open_dataset(tmp_path / "single.arrow"), 32, shuffle=True, seed=4))
    loader = make_loader(open_dataset(tmp_path / "folder"), 32, shuffle=True, seed=4, num_workers=2)
    try:
        there = list(loader)
    finally:
        loader.close()
    for mine, theirs in zip(here, there, strict=True):
        assert_same_batches(mine, theirs)
    resumed = make_loader(open_dataset(tmp_path / "folder"), 32, shuffle=True, seed=4)
    iterator = iter(resumed)
    next(iterator)
    state = resumed.state_dict()
    del iterator
    again = make_loader(open_dataset(tmp_path / "folder"), 32, shuffle=True, seed=4)
    again.load_state_dict(state)
    assert [batch["id"].tolist() for batch in again] == [batch["id"].tolist() for batch in here[1:]]


def test_a_swapped_shard_is_refused_and_verify_names_the_damaged_records(tmp_path):
    folder = tmp_path / "folder"
    write([{"id": index, "caption": "x" * 50} for index in range(400)], folder, {"id": "int", "caption": "str"},
          shard_size=5_000)
    index = read_index(folder)
    assert "records of 2 named fields" in describe(folder) and verify(folder).ok
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    data = (damaged / index.names[2]).read_bytes()
    overwrite(damaged / index.names[2], data.index(b"x" * 50) + 10, b"Y")
    report = verify(damaged)
    start, stop = int(index.starts[2]), int(index.starts[3])
    assert not report.ok and set(report.damaged_samples.tolist()) <= set(range(start, stop))
    assert report.damaged_samples.size and f"{index.names[2]!r}" in str(report)
    swapped = tmp_path / "swapped"
    shutil.copytree(folder, swapped)
    first, second = (swapped / index.names[0]), (swapped / index.names[1])
    assert first.stat().st_size == second.stat().st_size  # equal-size shards: only their identity tells them apart
    os.rename(first, swapped / "tmp")
    os.rename(second, first)
    os.rename(swapped / "tmp", second)
    with pytest.raises(FormatError, match=r"shard-00000\.h5.* is shard 1 .*where index.json lists shard 0"):
        open_dataset(swapped).read_batch([0])
