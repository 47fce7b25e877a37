"""The shard index on its own: written atomically, read back, and refused when damaged or foreign."""

import os
import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import rewrite_index

from fastdata.errors import FormatError, NotFoundError
from fastdata.formats.layout import FORMAT_VERSION
from fastdata.formats.shards import (
    INDEX_NAME,
    file_checksum,
    is_shard_folder,
    read_index,
    shard_name,
    write_index,
)


def shard_entries(counts, container="hdf5"):
    return [
        {"name": shard_name(k, container), "num_samples": n, "bytes": 100 + k, "crc32": f"{k:08x}"}
        for k, n in enumerate(counts)
    ]


def dataset(num_samples):
    """The metadata of an image dataset of ``num_samples`` of one class: every field an index must hold."""
    return {"kind": "image", "num_samples": num_samples, "sample_shape": [3, 8, 8], "sample_dtype": "uint8",
            "storage": "raw", "classes": ["a"], "class_counts": [num_samples], "mean": [0.5] * 3, "std": [0.25] * 3}


def write(root, counts, container="hdf5"):
    write_index(root, container, dataset(sum(counts)), {"size": 64}, shard_entries(counts, container))


@given(st.lists(st.integers(0, 50), min_size=1, max_size=30))
def test_global_indices_map_to_the_shard_that_holds_them(tmp_path_factory, counts):
    root = tmp_path_factory.mktemp("index")
    write(root, counts)
    index = read_index(root)
    kept = [k for k, n in enumerate(counts) if n]  # shards of no samples are left out
    assert index.names == [shard_name(k, "hdf5") for k in kept]
    assert index.num_samples == sum(counts) and index.num_shards == len(kept)
    owner = np.repeat(np.arange(len(kept)), [counts[k] for k in kept])  # one entry per sample, the plain way
    assert index.shard_of(np.arange(index.num_samples)).tolist() == owner.tolist()
    assert all(index.starts[s] <= i < index.starts[s + 1] for i, s in enumerate(owner))


def test_index_round_trip_keeps_metadata_settings_sizes_and_checksums(tmp_path):
    write(tmp_path, [3, 4], container="arrow")
    index = read_index(tmp_path)
    assert is_shard_folder(tmp_path) and not is_shard_folder(tmp_path / "missing")
    assert (index.container, index.settings, index.metadata["classes"]) == ("arrow", {"size": 64}, ["a"])
    assert index.sizes.tolist() == [100, 101] and index.checksums == ["00000000", "00000001"]
    assert index.path(1) == os.path.join(str(tmp_path), "shard-00001.arrow")
    assert os.listdir(tmp_path) == [INDEX_NAME]  # no temporary file left


def test_the_conversion_numbers_and_inputs_of_the_shards_round_trip(tmp_path):
    # Records with a number and inputs (NOTE [shard identity]); one without has its name's number.
    shards = shard_entries([3, 4, 5])
    shards[0].update(number=0, inputs=[0, 3])
    shards[2].update(number=7, inputs=[9, 15])
    write_index(tmp_path, "hdf5", dataset(12), {}, shards, conversion="5f0c9e2a41b7d3e8")
    index = read_index(tmp_path)
    assert index.conversion == "5f0c9e2a41b7d3e8"
    assert index.numbers == [0, 1, 7] and index.inputs == [[0, 3], None, [9, 15]]
    write(tmp_path, [3, 4])
    assert read_index(tmp_path).conversion is None


def test_shard_counts_that_disagree_with_the_metadata_are_refused(tmp_path):
    with pytest.raises(FormatError, match="hold 7 samples, the metadata says 8"):
        write_index(tmp_path, "hdf5", dataset(8), {}, shard_entries([3, 4]))
    assert not is_shard_folder(tmp_path)


def test_a_folder_without_an_index_says_how_to_finish_it(tmp_path):
    with pytest.raises(NotFoundError, match="--resume.*fastdata index"):
        read_index(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda index: index.update(layout="tables"), "not a fastdata shard index"),
        (lambda index: index.update(format_version=FORMAT_VERSION + 1), "Upgrade fastdata"),
        (lambda index: index.update(container="zip"), "lacks"),
        (lambda index: index["shards"][0].update(name="../elsewhere.h5"), "not a file of this folder"),
        (lambda index: index["shards"][0].update(name=".hidden.h5"), "not a file of this folder"),
        (lambda index: index["shards"][1].update(start=2), "do not add up"),
        (lambda index: index.update(num_samples=9), "do not add up"),
        (lambda index: index["shards"][1].update(number=0), "lists shard 0 after shard 0 .*listed twice"),
        (lambda index: index["shards"][1].update(name="shard-00000.h5"), "lists shard 0 after shard 0"),
        (lambda index: index.update(container="arrow"), "says its shards are arrow files, but lists 'shard-00000.h5'"),
        (lambda index: index["metadata"].update(class_counts=[3, 4]), "lists 1 classes but counts the samples of 2"),
    ],
)
def test_damaged_or_foreign_indexes_are_refused(tmp_path, change, message):
    write(tmp_path, [3, 4])
    rewrite_index(tmp_path, change)
    with pytest.raises(FormatError, match=message):
        read_index(tmp_path)


def test_an_index_that_is_not_json_is_refused_naming_it(tmp_path):
    (tmp_path / INDEX_NAME).write_bytes(b'{"format": "fastd')
    with pytest.raises(FormatError, match=f"{INDEX_NAME}' is not valid JSON"):
        read_index(tmp_path)


@pytest.mark.parametrize("size", [0, 1, (4 << 20) - 1, (4 << 20) + 7])
def test_file_checksum_is_the_crc32_of_all_the_bytes(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert file_checksum(path) == f"{zlib.crc32(data):08x}"


def test_shard_names_sort_in_shard_order_up_to_100000_shards():
    names = [shard_name(k, "hdf5") for k in (0, 9, 10, 99999)]
    assert names == sorted(names) and names[0] == "shard-00000.h5" and shard_name(100000, "arrow").endswith("0.arrow")


def test_an_index_or_column_write_that_fails_midway_leaves_no_partial_file_and_no_file(tmp_path):
    # A conversion stopped by SIGTERM while it wrote its index left index.json.<pid>.partial behind: whatever raises
    # inside the write (here the values themselves, part of the way in), the partial file goes and no file is made
    from fastdata.formats.shards import write_column, write_json_atomically

    with pytest.raises(TypeError):
        write_json_atomically(str(tmp_path / "index.json"), {"a": [1, 2, 3], "b": object()})
    with pytest.raises(ValueError):
        write_column(str(tmp_path), "labels", np.array(["not", "ints"]))
    assert os.listdir(tmp_path) == []
