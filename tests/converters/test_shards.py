"""Sharded image conversion: the plan, the same bytes on every engine, resume, parts and the index."""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import NUM_CLASSES, PER_CLASS, folder_listing, one_error_line, run_cli, stored_images

from fastdata import OptionError, OutputExistsError, SampleError, convert_imagefolder
from fastdata.converters.shards import label_runs, labels_of_runs, part_tasks, samples_per_shard, task_bounds
from fastdata.formats import read_packed
from fastdata.formats.shards import file_checksum, read_index

NUM_SAMPLES = NUM_CLASSES * PER_CLASS
FILE_KEYS = ("checksums", "format", "format_version")  # what a container adds to a file's metadata


def folder_bytes(root):
    """``{relative path: bytes}`` of every file under ``root`` but the lock files (which hold nothing)."""
    return {name: (root / name).read_bytes() for name in folder_listing(root)
            if (root / name).is_file() and not name.endswith("lock")}


def inodes(root, pin=None):
    """``{shard file name: inode}`` of the finished shards in ``root``.

    With ``pin`` (a new folder), each file is also hard-linked there, so that its inode
    cannot be reused by a file written later.
    """
    found = {name: os.stat(root / name).st_ino for name in os.listdir(root) if name.startswith("shard-")}
    if pin is not None:
        os.mkdir(pin)
        for name in found:
            os.link(root / name, pin / name)
    return found


# ---------------------------------------------------------------- the plan


@settings(max_examples=100, deadline=None)
@given(num_inputs=st.integers(0, 20_000), shard_size=st.integers(1, 1 << 34), sample_bytes=st.integers(1, 1 << 24),
       parts=st.integers(1, 9))
def test_tasks_cover_the_inputs_in_order_and_parts_split_them(num_inputs, shard_size, sample_bytes, parts):
    per_shard = samples_per_shard(shard_size, sample_bytes)
    bounds = task_bounds(num_inputs, per_shard)
    assert per_shard == max(1, shard_size // sample_bytes)
    assert bounds[0] == 0 and bounds[-1] == num_inputs and bounds.dtype == np.int64
    sizes = np.diff(bounds)
    assert (sizes > 0).all() and (sizes[:-1] == per_shard).all() and (sizes <= per_shard).all()
    runs = [part_tasks(len(sizes), (i, parts)) for i in range(parts)]
    assert sorted(k for run in runs for k in run) == list(range(len(sizes)))
    assert all(k % parts == i for i, run in enumerate(runs) for k in run)


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "64MB"])
def test_bad_shard_size_is_refused(source_root, tmp_path, sharded_options, bad):
    with pytest.raises(OptionError, match="shard_size"):
        convert_imagefolder(source_root, tmp_path / "out", **{**sharded_options(), "shard_size": bad})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [(2, 2), (-1, 2), (0, 0), (0.5, 2)])
def test_bad_part_is_refused_before_any_work(source_root, tmp_path, sharded_options, bad):
    with pytest.raises(OptionError, match="part should be"):
        convert_imagefolder(source_root, tmp_path / "out", part=bad, **sharded_options())
    assert not (tmp_path / "out").exists()


def test_overwrite_with_a_part_is_refused(source_root, tmp_path, sharded_options):
    with pytest.raises(OptionError, match="other parts"):
        convert_imagefolder(source_root, tmp_path / "out", part=(0, 2), overwrite=True, **sharded_options())
    assert not (tmp_path / "out").exists()


def test_shard_options_with_one_file_are_refused(source_root, tmp_path):
    with pytest.raises(OptionError, match="shard folder"):
        convert_imagefolder(source_root, tmp_path / "out.h5", shard_size=1 << 20, progress=False)
    with pytest.raises(OptionError, match="disagrees"):
        convert_imagefolder(source_root, tmp_path / "out.h5", format="arrow", progress=False)


# ---------------------------------------------------------------- the same folder on every engine


@pytest.mark.parametrize("storage", ["raw", "jpeg"])
@pytest.mark.parametrize("container", ["hdf5", "arrow"])
@pytest.mark.slow
def test_shard_folder_is_the_same_bytes_with_two_workers(source_root, tmp_path, sharded_reference, sharded_options,
                                                         container, storage):
    out = tmp_path / "out"
    report = convert_imagefolder(source_root, out, workers=2, **sharded_options(container, storage))
    assert report.path == os.fspath(out) and report.num_samples == NUM_SAMPLES
    assert folder_bytes(out) == folder_bytes(sharded_reference(container, storage))
    assert read_index(out).num_shards >= 5  # several shards, so the workers shared them


@pytest.mark.parametrize("make", [lambda: ThreadPoolExecutor(2), lambda: ProcessPoolExecutor(2)],
                         ids=["threads", "processes"])
def test_shard_folder_is_the_same_bytes_on_an_executor(source_root, tmp_path, sharded_reference, sharded_options,
                                                       make):
    with make() as executor:
        convert_imagefolder(source_root, tmp_path / "out", executor=executor, **sharded_options("arrow", "jpeg"))
    assert folder_bytes(tmp_path / "out") == folder_bytes(sharded_reference("arrow", "jpeg"))


def test_a_relative_source_converts_on_workers_that_run_in_another_folder(source_root, tmp_path, monkeypatch,
                                                                          sharded_reference, sharded_options):
    # A Dask cluster's workers run in their own folder: README's "--dask" line names its source "imagenet/train".
    monkeypatch.chdir(source_root.parent)
    with ProcessPoolExecutor(2, initializer=os.chdir, initargs=(tmp_path,)) as executor:
        convert_imagefolder(source_root.name, tmp_path / "out", executor=executor, **sharded_options())
    assert folder_bytes(tmp_path / "out") == folder_bytes(sharded_reference())


@pytest.mark.integration
def test_shard_folder_is_the_same_bytes_on_a_dask_cluster(source_root, tmp_path, sharded_reference, sharded_options):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0") as cluster:
        with distributed.Client(cluster) as client:
            convert_imagefolder(source_root, tmp_path / "out", executor=client, **sharded_options())
            workers = client.run(os.getpid)
    assert len(set(workers.values()) - {os.getpid()}) == 2  # real worker processes
    assert folder_bytes(tmp_path / "out") == folder_bytes(sharded_reference())


@pytest.mark.slow  # ~10 s: a cluster and a CLI process start
@pytest.mark.integration
def test_cli_converts_on_a_dask_scheduler(source_root, tmp_path, sharded_reference, sharded_cli_options):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0") as cluster:
        done = subprocess.run([sys.executable, "-m", "fastdata", "convert", "imagefolder", os.fspath(source_root),
                               os.fspath(tmp_path / "out"), "--dask", cluster.scheduler_address,
                               *sharded_cli_options("arrow", "jpeg")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert folder_bytes(tmp_path / "out") == folder_bytes(sharded_reference("arrow", "jpeg"))


# ---------------------------------------------------------------- what the shards hold


@pytest.mark.parametrize("storage", ["raw", "jpeg"])
@pytest.mark.parametrize("container", ["hdf5", "arrow"])
def test_shards_hold_the_single_file_samples_and_metadata(sharded_reference, packed_files, container, storage):
    root = sharded_reference(container, storage)
    index = read_index(root)
    images, labels, metadata = stored_images(packed_files(container, storage))
    parts = [stored_images(index.path(k)) for k in range(index.num_shards)]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), images)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), labels)
    assert index.metadata == {key: value for key, value in metadata.items() if key not in FILE_KEYS}
    for k, (_, _, shard) in enumerate(parts):
        start, stop = int(index.starts[k]), int(index.starts[k + 1])
        assert shard["shard"] == {"number": k, "inputs": [start, stop], "conversion": index.conversion}
        assert (index.numbers[k], index.inputs[k], len(index.conversion)) == (k, [start, stop], 16)
        assert shard["num_samples"] == stop - start
        dataset_only = ("class_counts", "mean", "std", "source", "skipped", "shard", "num_samples")
        assert {key: v for key, v in shard.items() if key not in dataset_only + FILE_KEYS} == {
            key: v for key, v in index.metadata.items() if key not in dataset_only}
    assert index.checksums == [file_checksum(index.path(k)) for k in range(index.num_shards)]


@pytest.mark.parametrize("storage", ["raw", "jpeg"])
@pytest.mark.parametrize("container", ["hdf5", "arrow"])
def test_open_dataset_reads_the_folder_as_the_single_file(sharded_reference, packed_files, container, storage):
    import torch

    from fastdata import open_dataset

    folder, single = open_dataset(sharded_reference(container, storage)), open_dataset(packed_files(container, storage))
    assert len(folder) == len(single) == NUM_SAMPLES and folder.metadata == {
        key: value for key, value in single.metadata.items() if key not in FILE_KEYS}
    spanning = [23, 3, 4, 5, 11, 0, 4]  # unsorted, repeated, across shards
    for (image, label), (want, want_label) in zip(folder.__getitems__(spanning), single.__getitems__(spanning)):
        assert torch.equal(image, want) and label == want_label


def test_skipped_inputs_are_in_the_index_and_an_all_skipped_shard_is_not_written(source_copy, tmp_path,
                                                                                 sharded_options):
    for i in range(10):  # inputs 6-15: shard 2 (inputs 10-14) has no usable image
        (source_copy / "class_0" / f"zz_bad_{i}.jpg").write_bytes(b"not a jpeg")
    out, single = tmp_path / "out", tmp_path / "single.h5"
    convert_imagefolder(source_copy, out, workers=2, **sharded_options())
    convert_imagefolder(source_copy, single, size=sharded_options()["size"], workers=1, progress=False)
    index = read_index(out)
    assert index.metadata == {k: v for k, v in read_packed(single)[1].items() if k not in FILE_KEYS}
    assert len(index.metadata["skipped"]) == 10 and index.num_samples == NUM_SAMPLES
    assert "shard-00002.h5" not in os.listdir(out) and "shard-00002.h5" not in index.names
    assert [read_packed(index.path(k))[1]["shard"]["inputs"] for k in range(3)] == [[0, 5], [5, 10], [15, 20]]


def test_on_error_raise_stops_at_the_bad_image(source_copy, tmp_path, sharded_options):
    (source_copy / "class_1" / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(SampleError, match="broken.jpg"):
        convert_imagefolder(source_copy, tmp_path / "out", workers=1, on_error="raise", **sharded_options())
    assert not (tmp_path / "out" / "index.json").exists()


def test_on_error_warn_warns_for_each_skipped_image(source_copy, tmp_path, sharded_options):
    (source_copy / "class_1" / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.warns(UserWarning, match="broken.jpg"):
        convert_imagefolder(source_copy, tmp_path / "out", workers=2, on_error="warn", **sharded_options())


# ---------------------------------------------------------------- existing folders, resume


def test_finished_folder_is_kept_unless_overwritten(source_root, tmp_path, sharded_reference, sharded_options):
    out = tmp_path / "out"
    shutil.copytree(sharded_reference(), out)
    before = inodes(out, pin=tmp_path / "pinned")
    with pytest.raises(OutputExistsError, match="finished shard folder.*--overwrite"):
        convert_imagefolder(source_root, out, **sharded_options())
    report = convert_imagefolder(source_root, out, resume=True, **sharded_options())  # nothing to do
    assert report.num_samples == NUM_SAMPLES and inodes(out) == before
    (out / ".labels.npy.4242.partial").write_bytes(b"left by a writer killed mid-write")
    convert_imagefolder(source_root, out, overwrite=True, workers=2, **sharded_options())
    assert folder_bytes(out) == folder_bytes(sharded_reference())
    assert not (out / ".labels.npy.4242.partial").exists()
    assert not set(inodes(out).values()) & set(before.values())


def test_unfinished_folder_needs_resume_and_resume_redoes_only_what_is_missing(source_root, tmp_path,
                                                                                sharded_reference, sharded_options):
    out = tmp_path / "out"
    shutil.copytree(sharded_reference(), out)
    os.remove(out / "index.json")
    with open(out / "shard-00001.h5", "r+b") as f:  # damaged: one byte flipped in the pixels
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.remove(out / "shard-00003.h5")  # missing
    os.remove(out / ".fastdata" / "shard-00002.json")  # finished, but not recorded
    (out / ".shard-00004.0badcafe-123-456.partial.h5").write_bytes(b"half")  # left by a killed conversion
    (out / ".fastdata" / "shard-00004.json.123.partial").write_text('{"half":')
    before = inodes(out, pin=tmp_path / "pinned")
    with pytest.raises(OutputExistsError, match="unfinished.*--resume"):
        convert_imagefolder(source_root, out, **sharded_options())
    convert_imagefolder(source_root, out, resume=True, workers=2, **sharded_options())
    assert folder_bytes(out) == folder_bytes(sharded_reference())
    after = inodes(out)
    assert {name for name in after if after[name] != before.get(name)} == {
        "shard-00001.h5", "shard-00002.h5", "shard-00003.h5"}


@pytest.mark.parametrize(("change", "named"), [
    ({"size": 24}, "size"),
    ({"resize": "pad"}, "resize"),
    ({"storage": "jpeg", "shard_size": 15360}, "storage"),
    ({"format": "arrow"}, "format"),
    ({"shard_size": 4096}, "shard_size"),
])
def test_resume_with_other_settings_is_refused_naming_them(source_root, tmp_path, sharded_reference, sharded_options,
                                                           change, named):
    out = tmp_path / "out"
    shutil.copytree(sharded_reference(), out)
    os.remove(out / "index.json")
    with pytest.raises(OptionError, match=rf"other settings \(.*\b{named}: recorded"):
        convert_imagefolder(source_root, out, resume=True, **{**sharded_options(), **change})
    assert folder_bytes(out) == {k: v for k, v in folder_bytes(sharded_reference()).items() if k != "index.json"}


def test_resume_after_the_source_changed_is_refused(source_copy, tmp_path, sharded_options):
    out = tmp_path / "out"
    convert_imagefolder(source_copy, out, part=(0, 2), workers=1, **sharded_options())
    victim = source_copy / "class_2" / sorted(os.listdir(source_copy / "class_2"))[0]
    os.utime(victim, ns=(0, 0))
    with pytest.raises(OptionError, match="source_files: recorded"):
        convert_imagefolder(source_copy, out, resume=True, **sharded_options())


def test_a_shard_folder_inside_the_source_is_refused(source_copy, sharded_options):
    with pytest.raises(OptionError, match="inside the source"):
        convert_imagefolder(source_copy, source_copy / "shards", **sharded_options())
    assert not (source_copy / "shards").exists()


def test_a_folder_of_other_files_is_refused(source_root, tmp_path, sharded_options):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="notes.txt"):
        convert_imagefolder(source_root, out, overwrite=True, **sharded_options())
    assert os.listdir(out) == ["notes.txt"]


# ---------------------------------------------------------------- parts and the index


def test_index_names_the_shards_a_missing_part_has_not_written(source_root, tmp_path, sharded_reference,
                                                               sharded_options):
    out = tmp_path / "out"
    report = convert_imagefolder(source_root, out, part=(0, 2), workers=1, **sharded_options())
    assert report.num_samples == 14 and not (out / "index.json").exists()  # shards 0, 2, 4: 5 + 5 + 4 images
    result = run_cli("index", out)
    assert result.exit_code == 1
    assert "2 of 5 shards are not finished (shard-00001.h5, shard-00003.h5)" in one_error_line(result)
    convert_imagefolder(source_root, out, part=(1, 2), workers=1, **sharded_options())  # the last part: the index
    assert folder_bytes(out) == folder_bytes(sharded_reference())
    os.remove(out / "index.json")
    assert run_cli("index", out).exit_code == 0
    assert folder_bytes(out) == folder_bytes(sharded_reference())


def test_cli_writes_a_shard_folder(source_root, tmp_path, sharded_reference, sharded_cli_options):
    out = tmp_path / "out"
    result = run_cli("convert", "imagefolder", source_root, out, "--workers", "2", *sharded_cli_options("arrow"))
    assert result.exit_code == 0, result.output
    assert f"wrote '{out}': {NUM_SAMPLES} samples" in result.output
    assert folder_bytes(out) == folder_bytes(sharded_reference("arrow"))
    result = run_cli("convert", "imagefolder", source_root, out, *sharded_cli_options("arrow"))
    assert "--overwrite" in one_error_line(result)


def test_cli_help_says_which_shards_a_part_writes():
    assert "(shards k with k % N == I)" in " ".join(run_cli("convert", "imagefolder", "--help").output.split())


@pytest.mark.parametrize(("option", "message"), [
    (["--part", "2/2"], "--part should be I/N"),
    (["--part", "x"], "--part should be I/N"),
    (["--shard-size", "0"], "positive number of bytes"),
])
def test_cli_bad_shard_options(source_root, tmp_path, option, message):
    result = run_cli("convert", "imagefolder", source_root, tmp_path / "out", "--quiet", *option)
    assert result.exit_code != 0 and message in result.output
    assert not (tmp_path / "out" / "index.json").exists()



@given(st.lists(st.lists(st.integers(0, 5), max_size=40), max_size=6))
def test_label_runs_give_back_every_records_labels_in_order(labels_of_records):
    runs = [label_runs(np.array(labels, dtype=np.int64)) for labels in labels_of_records]
    assert all(count > 0 for record in runs for _, count in record)
    assert all(a[0] != b[0] for record in runs for a, b in zip(record, record[1:])), "runs are maximal"
    flat = [label for labels in labels_of_records for label in labels]
    assert labels_of_runs(runs).tolist() == flat and labels_of_runs(runs).dtype == np.int64


def test_the_labels_file_is_the_shards_labels_and_an_index_without_it_still_reads(sharded_reference, shard_copy):
    import json

    from fastdata import open_dataset

    reference = sharded_reference("hdf5", "jpeg")
    index = read_index(reference)
    assert index.columns["labels"]["name"] == "labels.npy"
    shards = np.concatenate([read_packed(index.path(k))[0].labels for k in range(index.num_shards)])
    assert np.array_equal(np.load(os.path.join(reference, "labels.npy")), shards)
    assert np.array_equal(open_dataset(reference).labels, shards)
    older = shard_copy(reference)  # as written before column files
    listed = json.loads((older / "index.json").read_text())
    del listed["columns"]
    (older / "index.json").write_text(json.dumps(listed))
    os.unlink(older / "labels.npy")
    assert np.array_equal(open_dataset(older).labels, shards)
