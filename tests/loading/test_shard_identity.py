"""A shard is never read as another (NOTE [shard identity]): swapped, duplicated, foreign or misindexed shards,
a classes list cut short and an edited container are refused at open or first read, and `verify` says so too."""

import os
import re
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import FORMATS, NUM_CLASSES, PER_CLASS, SOURCE_SIZE, rewrite_index, rewrite_metadata

from fastdata import convert_imagefolder, make_loader, open_dataset
from fastdata.errors import FormatError
from fastdata.formats import read_packed
from fastdata.formats.shards import INDEX_NAME, file_checksum, read_index
from fastdata.measure.synthetic import make_imagefolder
from fastdata.verify import verify


@pytest.fixture(scope="module")
def other_conversion(sharded_options, tmp_path_factory):
    """``get(fmt) -> folder``: other photos converted with the settings of ``shard_converted(fmt, "raw")``."""
    root = tmp_path_factory.mktemp("other")
    source = make_imagefolder(root / "photos", NUM_CLASSES, PER_CLASS, size=SOURCE_SIZE, seed=1, vary=True)
    cache = {}

    def get(fmt):
        if fmt not in cache:
            cache[fmt] = root / fmt
            convert_imagefolder(source, cache[fmt], workers=1, **sharded_options(fmt, "raw"))
        return cache[fmt]

    return get


def swap_files(root, a, b):
    names = read_index(root).names
    shutil.move(root / names[a], root / "swap")
    shutil.move(root / names[b], root / names[a])
    shutil.move(root / "swap", root / names[b])


def swap_names(index, a, b):
    """Swap what two index records say of their files (name, size, crc32), not their place."""
    shards = index["shards"]
    for key in ("name", "bytes", "crc32"):
        shards[a][key], shards[b][key] = shards[b][key], shards[a][key]


def read_everything(root):
    dataset = open_dataset(root)
    return dataset.read_batch(np.arange(len(dataset)))


def assert_refused(root, match, at_open=False):
    """Open and read all of ``root``: FormatError matching ``match``, at open_dataset if ``at_open``."""
    if at_open:
        with pytest.raises(FormatError, match=match):
            open_dataset(root)
        return
    dataset = open_dataset(root)
    with pytest.raises(FormatError, match=match):
        dataset.read_batch(np.arange(len(dataset)))


def assert_verify_names(root, check, text):
    for quick in (False, True):
        report = verify(root, quick=quick)
        assert not report.ok and any(p.check == check and text in p.message for p in report.problems), str(report)


# ---------------------------------------------------------------- each case, on the converters' folders


@pytest.mark.parametrize("kind", ["raw", "text"])
def test_the_converters_record_the_conversion_and_place_of_every_shard(shard_converted, fmt, kind):
    root = shard_converted(fmt, kind)
    index = read_index(root)
    assert re.fullmatch("[0-9a-f]{16}", index.conversion)
    for shard in range(index.num_shards):
        place = read_packed(index.path(shard))[1]["shard"]
        assert place == {"number": index.numbers[shard], "inputs": index.inputs[shard], "conversion": index.conversion}
        assert place["number"] == shard and place["inputs"][0] >= int(index.starts[shard])  # skipped inputs


def test_equal_size_shards_swapped_on_disk_are_refused_naming_both_places(shard_converted, shard_copy, fmt):
    root = shard_copy(shard_converted(fmt, "raw"))
    index = read_index(root)
    assert index.sizes[0] == index.sizes[1] and (np.diff(index.starts)[:2] == 5).all()
    swap_files(root, 0, 1)  # samples 0-4 and 5-9: class 0 and classes 0-1
    name = re.escape(repr(os.fspath(root / index.names[0])))
    assert_refused(root, f"{name} is shard 1 \\(inputs 5-9\\) of conversion {index.conversion}, where "
                         f"{INDEX_NAME} lists shard 0 \\(inputs 0-4\\) of conversion {index.conversion}.*fastdata "
                         "verify")
    assert_verify_names(root, "shard", "is shard 1 (inputs 5-9)")


def test_a_shard_copied_from_another_conversion_of_the_same_settings_is_refused(shard_converted, other_conversion,
                                                                                 shard_copy, fmt):
    root, other = shard_copy(shard_converted(fmt, "raw")), read_index(other_conversion(fmt))
    index = read_index(root)
    assert other.sizes[2] == index.sizes[2] and other.conversion != index.conversion
    shutil.copyfile(other.path(2), root / index.names[2])
    rewrite_index(root, lambda entries: entries["shards"][2].update(crc32=other.checksums[2]))  # as if re-indexed
    assert_refused(root, f"is shard 2 \\(inputs 10-14\\) of conversion {other.conversion}, where {INDEX_NAME} "
                         f"lists shard 2 \\(inputs 10-14\\) of conversion {index.conversion}")
    assert_verify_names(root, "shard", f"of conversion {other.conversion}")


def test_index_records_whose_files_are_swapped_are_refused_at_first_read(shard_converted, shard_copy, fmt):
    root = shard_copy(shard_converted(fmt, "raw"))
    rewrite_index(root, lambda index: swap_names(index, 1, 3))
    dataset = open_dataset(root)
    assert len(dataset.read_batch(np.arange(5))[0]) == 5  # shard 0 is its own
    with pytest.raises(FormatError, match="shard-00003.* is shard 3 .*lists shard 1 "):
        dataset.read_batch(np.arange(5, 10))
    assert_verify_names(root, "shard", "is shard 3 (inputs 15-19)")


@pytest.mark.parametrize("change", ["reordered", "duplicated"])
def test_index_records_reordered_or_listed_twice_are_refused_at_open(shard_converted, shard_copy, fmt, change):
    root = shard_copy(shard_converted(fmt, "raw"))

    def edit(index):
        shards = index["shards"]
        moved = [shards[1], shards[0]] if change == "reordered" else [shards[0], shards[0]]
        shards[:2] = [{**entry, "start": 5 * k} for k, entry in enumerate(moved)]  # equal counts: starts add up

    rewrite_index(root, edit)
    listed = "shard 0 after shard 1" if change == "reordered" else "shard 0 after shard 0"
    assert_refused(root, f"{INDEX_NAME}' lists {listed} \\(entry 1\\): its shards are out of order or listed "
                         "twice.*fastdata index", at_open=True)
    assert_verify_names(root, "index", "out of order or listed twice")


def test_a_classes_list_cut_short_is_refused_at_open(shard_converted, shard_copy, fmt):
    root = shard_copy(shard_converted(fmt, "raw"))
    rewrite_index(root, lambda index: index["metadata"].update(classes=index["metadata"]["classes"][:2]))
    assert_refused(root, "lists 2 classes but counts the samples of 4: its classes list is damaged", at_open=True)
    assert_verify_names(root, "index", "lists 2 classes but counts the samples of 4")


def test_a_classes_list_cut_short_with_its_counts_is_refused_at_first_read(shard_converted, shard_copy, fmt):
    root = shard_copy(shard_converted(fmt, "raw"))
    rewrite_index(root, lambda index: index["metadata"].update(classes=index["metadata"]["classes"][:2],
                                                            class_counts=index["metadata"]["class_counts"][:2]))
    assert_refused(root, "shard-00000.* differs from the dataset in classes: shard 0 ")
    with pytest.raises(FormatError, match=r"labels\.npy' holds labels outside -1..1, the classes .*samples 12-23"):
        _ = open_dataset(root).labels  # from the column file, no shard opened
    assert_verify_names(root, "shard", "differs from the dataset in classes")
    labels = [p for p in verify(root).problems if p.check == "labels"]
    assert labels and "outside -1..1" in labels[0].message and verify(root).damaged_samples[-1] == 23


def test_an_index_naming_the_other_container_is_refused_at_open(shard_converted, shard_copy, fmt):
    root = shard_copy(shard_converted(fmt, "raw"))
    other = {"hdf5": "arrow", "arrow": "hdf5"}[fmt]
    rewrite_index(root, lambda index: index.update(container=other))
    assert_refused(root, f"says its shards are {other} files, but lists 'shard-00000{FORMATS[fmt]}', named as {fmt} "
                         f'files are: the index was edited or damaged. Set its "container" back to "{fmt}"',
                   at_open=True)
    assert_verify_names(root, "index", f'Set its "container" back to "{fmt}"')


# ---------------------------------------------------------------- folders written before the identity


def strip_identity(root):
    """Make ``root`` as a conversion before NOTE [shard identity] wrote it: no conversion id, index without numbers."""
    index = read_index(root)
    sizes = {}
    for name in index.names:
        rewrite_metadata(root / name, lambda metadata: metadata["shard"].pop("conversion"))
        sizes[name] = os.path.getsize(root / name), file_checksum(root / name)

    def edit(entries):
        entries.pop("conversion")
        for entry in entries["shards"]:
            entry.pop("number"), entry.pop("inputs")
            entry["bytes"], entry["crc32"] = sizes[entry["name"]]

    rewrite_index(root, edit)
    return root


def test_a_folder_written_before_the_identity_reads_and_swaps_are_still_refused(shard_converted, shard_copy, fmt):
    source = shard_converted(fmt, "raw")
    root = strip_identity(shard_copy(source))
    index = read_index(root)
    assert index.conversion is None and index.numbers[1] == 1 and index.inputs[1] is None  # the name's number
    expected = read_everything(source)
    for got, want in zip(read_everything(root), expected):
        assert np.array_equal(got, want)
    assert verify(root).ok, str(verify(root))
    swap_files(root, 0, 1)
    assert_refused(root, "shard-00000.* is shard 1, where index.json lists shard 0 ")


# ---------------------------------------------------------------- any permutation or duplication


@pytest.mark.parametrize("container", list(FORMATS))
@settings(max_examples=30)
@given(mode=st.sampled_from(["files", "entries", "names"]), data=st.data())
def test_any_permutation_or_duplication_of_equal_shards_is_refused(shard_converted, tmp_path_factory, container,
                                                                    mode, data):
    source = shard_converted(container, "raw")
    equal = 4  # shards 0-3 hold 5 samples each (and equal bytes); shard 4 the last 4
    order = data.draw(st.lists(st.integers(0, equal - 1), min_size=equal, max_size=equal), label="order")
    root = tmp_path_factory.mktemp("any") / "folder"
    shutil.copytree(source, root)
    index = read_index(root)
    assert len(set(index.sizes[:equal].tolist())) == 1 and (np.diff(index.starts)[:equal] == 5).all()
    if mode == "files":  # shard k's file holds what shard order[k]'s did
        with tempfile.TemporaryDirectory(dir=root.parent) as saved:
            for name in index.names[:equal]:
                shutil.copyfile(root / name, os.path.join(saved, name))
            for k, name in enumerate(index.names[:equal]):
                shutil.copyfile(os.path.join(saved, index.names[order[k]]), root / name)
    else:
        def edit(entries):
            shards = [dict(entry) for entry in entries["shards"]]
            for k in range(equal):
                moved = shards[order[k]] if mode == "entries" else {
                    **shards[k], **{key: shards[order[k]][key] for key in ("name", "bytes", "crc32")}}
                entries["shards"][k] = {**moved, "start": 5 * k}

        rewrite_index(root, edit)
    if order == list(range(equal)):
        for got, want in zip(read_everything(root), read_everything(source)):
            assert np.array_equal(got, want)
        return
    with pytest.raises(FormatError, match="(listed twice|is shard \\d)"):
        read_everything(root)
    assert not verify(root, quick=True).ok


# ---------------------------------------------------------------- the same checks in workers and at a URL


def test_workers_refuse_a_swapped_shard_as_the_main_process_does(shard_converted, shard_copy, fmt):
    root = shard_copy(shard_converted(fmt, "raw"))
    swap_files(root, 0, 3)
    loader = make_loader(open_dataset(root), batch_size=4, num_workers=2, multiprocessing_context="fork")
    with pytest.raises(Exception, match="is shard 3 \\(inputs 15-19\\).*lists shard 0") as error:
        list(loader)
    assert isinstance(error.value, FormatError), repr(error.value)


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # aiohttp sessions of s3fs closed at exit
def test_a_url_refuses_swapped_records_through_the_same_check(shard_converted, s3_server, tmp_path, fmt):
    from storage.servers import upload

    root = tmp_path / "folder"
    shutil.copytree(shard_converted(fmt, "raw"), root)
    rewrite_index(root, lambda index: swap_names(index, 0, 2))  # sizes and crc32s move too: every fetch checks out
    url = upload(root, s3_server.bucket() + "/swapped", s3_server.storage_options)
    dataset = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path / "cache")
    with pytest.raises(FormatError, match=re.escape(url) + "/shard-00002.* is shard 2 .*lists shard 0 "):
        dataset.read_batch(np.arange(5))
