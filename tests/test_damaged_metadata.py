"""Damaged metadata is named, never a bare KeyError / TypeError or an h5py traceback (issue 27).

A converted shard folder's index.json mutated every way (keys dropped, values of
another type, the bytes cut short) and an HDF5 file's checksum group damaged:
`fastdata info`, `fastdata verify` and the loader each say which file and field.
"""

import json
import os
import re
import shutil

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import one_error_line, private_copy, rewrite_metadata, run_cli

from fastdata import FastdataError, FormatError, open_dataset
from fastdata.formats.shards import read_index
from fastdata.info import describe
from fastdata.verify import verify

_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40), st.floats(allow_nan=False), st.text(max_size=4),
                    st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                             max_size=2))


def json_paths(value, path=(), limit=40):
    """Every path (a tuple of keys and list positions) into the JSON ``value``; at most ``limit`` items of a list."""
    paths = [path] if path else []
    items = value.items() if isinstance(value, dict) else enumerate(value[:limit]) if isinstance(value, list) else ()
    for key, item in items:
        paths += json_paths(item, (*path, key), limit)
    return paths


def mutated(index, path, action, value):
    """Return a copy of ``index`` with the item at ``path`` dropped ("drop") or replaced by ``value`` ("set")."""
    index = json.loads(json.dumps(index))
    parent = index
    for key in path[:-1]:
        parent = parent[key]
    if action == "drop":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return index


def read_everything(root):
    """Run what reads an index: info, verify (its report as text), and the loader's first and last samples."""
    describe(root, all_skipped=True)
    report = verify(root, quick=True)
    str(report)
    dataset = open_dataset(root)
    if len(dataset):
        dataset[0], dataset[len(dataset) - 1]
    return report


@pytest.fixture(params=["raw", "text"])
def folder(request, shard_converted, tmp_path):
    """A private copy of a converted shard folder (hdf5) of images or text; returns ``(root, its index)``."""
    root = tmp_path / "folder"
    shutil.copytree(shard_converted("hdf5", request.param), root)
    return root, json.loads((root / "index.json").read_text())


def test_the_intact_folder_reads(folder):
    root, _ = folder
    assert read_everything(root).ok


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.slow
def test_any_damaged_index_is_named_never_a_bare_error(folder, data):
    # Before: 81 of 297 hand-picked cases raised KeyError, TypeError, AttributeError or ValueError from deep inside.
    root, index = folder
    path = root / "index.json"
    damage = data.draw(st.sampled_from(["drop", "set", "truncate"]))
    if damage == "truncate":
        text = json.dumps(index).encode()
        path.write_bytes(text[: data.draw(st.integers(0, len(text) - 1))])
    else:
        where = data.draw(st.sampled_from(json_paths(index)))
        path.write_text(json.dumps(mutated(index, where, damage, data.draw(_VALUES) if damage == "set" else None)))
    try:
        report = read_everything(root)
    except FastdataError as exc:
        assert os.fspath(root) in str(exc)  # the index, a shard or a column file of this folder
    else:
        assert report.ok or os.fspath(root) in str(report)


@pytest.mark.parametrize("value", [None, "x", [1]])
def test_a_text_index_with_a_bad_pad_id_is_named(shard_converted, tmp_path, value):
    # hypothesis found pad_id None raising a bare TypeError from the token decoder
    root = tmp_path / "folder"
    shutil.copytree(shard_converted("hdf5", "text"), root)
    index = json.loads((root / "index.json").read_text())
    index["metadata"]["tokenizer"]["pad_id"] = value
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(FastdataError, match="tokenizer.pad_id"):
        read_everything(root)


@pytest.mark.parametrize(("damage", "named"), [
    (lambda index: index["metadata"].pop("kind"), "field metadata.kind is missing"),
    (lambda index: index.__setitem__("metadata", None), "field metadata should be an object, got None"),
    (lambda index: index["shards"][0].__setitem__("bytes", "x"), "field shards[0].bytes should be a non-negative"),
    (lambda index: index["metadata"].__setitem__("class_counts", 3), "field metadata.class_counts should be a list"),
    (lambda index: index["metadata"].__setitem__("source", "x"), "field metadata.source should be an object"),
    (lambda index: index["metadata"]["skipped"].append({"path": 1}), "field metadata.skipped[0].path should be"),
])
def test_a_malformed_field_is_named_with_what_to_do(folder, damage, named):
    root, index = folder
    if "metadata.skipped" in named:
        index["metadata"]["skipped"].clear()
    damage(index)
    (root / "index.json").write_text(json.dumps(index))
    for read in (describe, open_dataset):
        with pytest.raises(FormatError, match=re.escape(named)) as caught:
            read(root)
        assert repr(os.fspath(root / "index.json")) in str(caught.value) and "fastdata index" in str(caught.value)
    report = verify(root)
    assert not report.ok and report.problems[0].check == "index" and named in report.problems[0].message


@pytest.mark.parametrize("command", ["info", "verify"])
def test_the_cli_names_a_damaged_index_in_one_line(folder, command):
    root, index = folder
    del index["metadata"]["num_samples"]
    (root / "index.json").write_text(json.dumps(index))
    result = run_cli(command, root)
    assert result.exit_code == 1 and "Traceback" not in result.output
    text = one_error_line(result) if command == "info" else result.output
    assert repr(os.fspath(root / "index.json")) in text and "field metadata.num_samples is missing" in text


# ---------------------------------------------------------------- one packed file's metadata


@pytest.mark.parametrize("fmt", ["hdf5", "arrow"])
@pytest.mark.parametrize(("change", "named"), [
    (lambda metadata: metadata.pop("mean"), "field mean is missing"),  # info: KeyError 'mean' before
    (lambda metadata: metadata.pop("classes"), "field classes is missing"),  # verify: KeyError 'classes' before
    (lambda metadata: metadata.update(class_counts="6,6"), "field class_counts should be a list"),
    (lambda metadata: metadata.update(skipped=[{"path": None}]), "field skipped[0].path should be text, got None"),
])
def test_a_packed_file_with_damaged_metadata_is_named(packed_files, tmp_path, fmt, change, named):
    path = rewrite_metadata(private_copy(packed_files(fmt, "raw"), tmp_path, "damaged"), change)
    for command in ("info", "verify"):
        result = run_cli(command, path)
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert repr(os.fspath(path)) in result.output and named in result.output
        assert 're-run "fastdata convert"' in result.output
    if "missing" not in named:  # a field of the wrong type is refused when the file is opened, too
        with pytest.raises(FormatError, match=re.escape(named)):
            open_dataset(path)


# ---------------------------------------------------------------- an HDF5 file's checksum group


def _replace_checksums(f):
    del f["checksums"]
    f.create_dataset("checksums", data=np.arange(3))


def _group_for_a_column(f):
    del f["checksums"]["labels"]
    f["checksums"].create_group("labels")


def _float_checksums(f):
    values = f["checksums"]["samples"][()]
    del f["checksums"]["samples"]
    f["checksums"].create_dataset("samples", data=values.astype(np.float64))


def _two_dimensional(f):
    values = f["checksums"]["labels"][()]
    del f["checksums"]["labels"]
    f["checksums"].create_dataset("labels", data=np.stack([values, values]))


@pytest.mark.parametrize("damage", [_replace_checksums, _group_for_a_column, _float_checksums, _two_dimensional])
def test_a_damaged_checksum_group_is_reported_naming_the_file(packed_files, tmp_path, damage):
    # Before: verify printed h5py's TypeError / IndexError traceback.
    path = private_copy(packed_files("hdf5", "raw"), tmp_path, "damaged")
    with h5py.File(path, "r+") as f:
        damage(f)
    result = run_cli("verify", path)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{os.fspath(path)!r}: DAMAGED" in result.output
    assert f"checksum: {os.fspath(path)!r}:" in result.output and "the file is damaged" in result.output
    assert "labels" in verify(path).checked  # the other checks still ran


def test_a_byte_flipped_in_an_object_header_is_reported_not_raised(packed_files, tmp_path):
    # Before: flips here raised KeyError ("unable to determine object type"), RuntimeError ("bad heap free
    # list") or AttributeError (a Datatype where a dataset goes) out of h5py. Flips in the root group's heap can
    # crash h5py itself (one byte of 1,680 scanned): those are not tried.
    source = packed_files("hdf5", "raw")
    with h5py.File(source) as f:
        headers = [h5py.h5o.get_info(f[name].id).addr
                   for name in ("samples", "labels", "checksums", "checksums/samples", "checksums/labels")]
    original, path = source.read_bytes(), tmp_path / "flipped.h5"
    for at in (addr + step for addr in headers for step in range(48)):
        damaged = bytearray(original)
        damaged[at] ^= 0xFF
        path.write_bytes(bytes(damaged))
        report = verify(path)  # raised nothing
        assert report.ok or repr(os.fspath(path)) in str(report), at


@pytest.mark.parametrize("dtype", ["0\x1b", "xx", "i9", "[('a', 'i4')]"])
def test_a_dtype_numpy_cannot_parse_is_a_damaged_index(folder, dtype):
    # "0\x1b" made numpy raise ValueError where other bad text raises TypeError: a bare error before (hypothesis)
    root, index = folder
    index["metadata"]["sample_dtype"] = dtype
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="sample_dtype"):
        read_index(root)
