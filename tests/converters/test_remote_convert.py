"""Shard conversions to a URL (s3:// on a local moto server): the local folder's bytes, resume, parts, Dask, text."""

import os
import posixpath

import pytest
from support import folder_listing, one_error_line, run_cli, wait_for
from test_shard_faults import WORKERS, alive, children, fastdata, slow_convert

from fastdata import OptionError, OutputExistsError, convert_imagefolder, convert_text
from fastdata.converters.upload import RemoteFolder
from fastdata.formats.shards import read_index
from fastdata.storage.urls import filesystem

NUM_SHARDS = 5  # of sharded_reference


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A private cache root (staging folders under uploads/), also for the subprocesses and Dask workers."""
    monkeypatch.setenv("FASTDATA_CACHE", os.fspath(tmp_path / "cache"))
    return tmp_path / "cache"


def folder_bytes(root):
    """``{relative path: bytes}`` of every file under ``root`` but the lock files (which hold nothing)."""
    return {name: (root / name).read_bytes() for name in folder_listing(root)
            if (root / name).is_file() and not name.endswith("lock")}


def remote_bytes(url, storage_options):
    """``{relative path: bytes}`` of every object under ``url``."""
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache()
    return {posixpath.relpath(name, path): fs.cat_file(name) for name in fs.find(path)}


def storage_args(server):
    return [arg for key, value in server.storage_options.items() for arg in ("--storage-option", f"{key}={value}")]


def staging_files(url):
    """The files left in this machine's staging folder of ``url`` (lock files aside)."""
    root = RemoteFolder(url).staging()
    return [name for name in folder_listing(root) if not name.endswith("lock") and name != ".fastdata"]


def versions(server, url):
    """``{key relative to url: number of versions}`` in a bucket with versioning on: one per PUT."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    pages = server.client().get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix)
    counts = {}
    for page in pages:
        for version in page.get("Versions", []):
            key = posixpath.relpath(version["Key"], prefix)
            counts[key] = counts.get(key, 0) + 1
    return counts


def versioned_bucket(server):
    url = server.bucket()
    server.client().put_bucket_versioning(Bucket=url.removeprefix("s3://"),
                                          VersioningConfiguration={"Status": "Enabled"})
    return url


# ---------------------------------------------------------------- the same folder, remote


@pytest.mark.parametrize(("container", "storage", "workers"), [("hdf5", "raw", 2), ("arrow", "jpeg", 1)])
def test_a_conversion_to_s3_is_the_local_folder_byte_for_byte(source_root, s3_server, sharded_reference,
                                                              sharded_options, container, storage, workers):
    url = s3_server.bucket() + "/train/"
    report = convert_imagefolder(source_root, url, workers=workers, storage_options=s3_server.storage_options,
                                 **sharded_options(container, storage))
    assert report.path == url.rstrip("/") and report.num_samples == 24
    assert remote_bytes(url, s3_server.storage_options) == folder_bytes(sharded_reference(container, storage))
    assert staging_files(url) == []  # every shard uploaded, then removed here


def test_a_finished_url_is_kept_unless_overwritten_and_other_files_are_never_replaced(source_root, s3_server,
                                                                                     sharded_reference,
                                                                                     sharded_options):
    options = {**sharded_options(), "storage_options": s3_server.storage_options, "workers": 1}
    url = s3_server.bucket() + "/train"
    convert_imagefolder(source_root, url, **options)
    with pytest.raises(OutputExistsError, match="is a finished shard folder; pass --overwrite"):
        convert_imagefolder(source_root, url, **options)
    assert convert_imagefolder(source_root, url, resume=True, **options).num_samples == 24  # done: nothing to do
    with pytest.raises(OptionError, match="other settings"):
        convert_imagefolder(source_root, url, resume=True, **{**options, "size": 16})
    convert_imagefolder(source_root, url, overwrite=True, **{**options, "size": 16})
    assert read_index(sharded_reference()).metadata != remote_index(url, s3_server)["metadata"]
    other = s3_server.bucket()
    filesystem(other, s3_server.storage_options)[0].pipe_file(other.removeprefix("s3://") + "/notes.txt", b"mine")
    with pytest.raises(OutputExistsError, match="holds other files"):
        convert_imagefolder(source_root, other, overwrite=True, **options)
    with pytest.raises(OptionError, match="shard folder; drop the .h5"):
        convert_imagefolder(source_root, url + "/train.h5", storage_options=s3_server.storage_options)
    with pytest.raises(OptionError, match="storage_options are for a URL"):
        convert_imagefolder(source_root, "train.h5", storage_options=s3_server.storage_options)


def remote_index(url, server):
    import json

    return json.loads(remote_bytes(url, server.storage_options)["index.json"])


# ---------------------------------------------------------------- the index last, resume


def test_the_index_is_uploaded_only_once_every_shard_is_there(source_root, s3_server, sharded_reference,
                                                              sharded_options):
    url = s3_server.bucket() + "/train"
    options = {**sharded_options(), "storage_options": s3_server.storage_options, "workers": 1}
    convert_imagefolder(source_root, url, part=(0, 2), **options)
    held = remote_bytes(url, s3_server.storage_options)
    assert "index.json" not in held
    assert sorted(name for name in held if name.startswith("shard-")) == ["shard-00000.h5", "shard-00002.h5",
                                                                          "shard-00004.h5"]
    done = run_cli("index", url, *storage_args(s3_server))
    assert done.exit_code == 1 and "2 of 5 shards are not finished" in one_error_line(done)
    convert_imagefolder(source_root, url, part=(1, 2), **options)  # the last part writes the index
    assert remote_bytes(url, s3_server.storage_options) == folder_bytes(sharded_reference())
    assert run_cli("index", url, *storage_args(s3_server)).exit_code == 0  # the index again, the same


def test_resume_after_kill_9_uploads_only_the_missing_shards(source_root, tmp_path, s3_server, sharded_reference,
                                                             sharded_cli_options):
    url = versioned_bucket(s3_server) + "/train"
    records = lambda: [n for n in versions(s3_server, url) if n.startswith(".fastdata/shard-")]  # noqa: E731
    with slow_convert(tmp_path, 0.15, source_root, url, sharded_cli_options(), *storage_args(s3_server)) as child:
        wait_for(lambda: records() or child.poll() is not None, "a finished shard")
        workers = children(child.pid)  # the forkserver (fsspec's thread ruled out fork) and the resource tracker
        child.kill()
        child.communicate(timeout=60)  # returns once every holder of its pipes, the pool's workers too, is gone
    wait_for(lambda: not any(map(alive, workers)), "the workers to die with their parent", seconds=30)
    before = versions(s3_server, url)
    kept = [name.replace(".fastdata/", "").replace(".json", ".h5") for name in records()]
    assert "index.json" not in before and 0 < len(kept) < NUM_SHARDS  # the kill came mid-run
    done = fastdata("convert", "imagefolder", source_root, url, "--workers", WORKERS, "--resume",
                    *sharded_cli_options(), *storage_args(s3_server))
    assert done.returncode == 0, done.stderr
    assert remote_bytes(url, s3_server.storage_options) == folder_bytes(sharded_reference())
    after = versions(s3_server, url)
    uploaded = {name: after[name] - before.get(name, 0) for name in after if name.startswith("shard-")}
    assert all(uploaded[name] == 0 for name in kept)  # the recorded shards stayed
    assert sorted(name for name, count in uploaded.items() if count) == sorted(set(uploaded) - set(kept))
    assert all(count <= 1 for count in uploaded.values())  # each missing shard uploaded once


# ---------------------------------------------------------------- Dask, text


def test_a_dask_cluster_converts_to_s3_as_the_local_pool_does(source_root, tmp_path, s3_env, sharded_options):
    distributed = pytest.importorskip("distributed")
    local = tmp_path / "local"
    convert_imagefolder(source_root, local, workers=2, **sharded_options("arrow", "jpeg"))
    url = s3_env.bucket() + "/train"
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0") as cluster:
        with distributed.Client(cluster) as client:  # the workers find the server in their environment
            convert_imagefolder(source_root, url, executor=client, **sharded_options("arrow", "jpeg"))
            workers = client.run(os.getpid)
    assert len(set(workers.values()) - {os.getpid()}) == 2  # real worker processes uploaded the shards
    assert remote_bytes(url, s3_env.storage_options) == folder_bytes(local)
    assert staging_files(url) == []


@pytest.mark.parametrize("container", ["hdf5", "arrow"])
def test_text_converts_to_s3_as_to_a_local_folder(text_corpus, s3_server, shard_converted, container):
    local = shard_converted(container, "text")
    url = s3_server.bucket() + "/reviews/"
    shard_size = read_index(local).settings["shard_size"]
    options = {"format": container, "shard_size": shard_size, "workers": 1, "progress": False,
               "storage_options": s3_server.storage_options}
    report = convert_text(text_corpus / "train", url, **options)
    assert report.path == url and read_index(local).num_shards > 1
    assert remote_bytes(url, s3_server.storage_options) == folder_bytes(local)
    assert staging_files(url) == []
    with pytest.raises(OutputExistsError, match="finished shard folder"):
        convert_text(text_corpus / "train", url, **options)
    done = run_cli("convert", "text", text_corpus / "train", url, "--format", container, "--shard-size", shard_size,
                   "--workers", 1, "--quiet", "--overwrite", *storage_args(s3_server))
    assert done.exit_code == 0, done.output
    assert remote_bytes(url, s3_server.storage_options) == folder_bytes(local)


def test_cli_refuses_a_storage_option_without_a_value(source_root, tmp_path):
    done = run_cli("convert", "imagefolder", source_root, "s3://bucket/train", "--storage-option", "anon")
    assert done.exit_code == 1 and "--storage-option should be KEY=VALUE" in one_error_line(done)
    done = run_cli("index", tmp_path / "missing")
    assert done.exit_code == 1 and "is not a folder" in one_error_line(done)


def test_a_file_url_is_written_as_the_local_folder(source_root, tmp_path, sharded_reference, sharded_options):
    pytest.importorskip("fsspec")
    convert_imagefolder(source_root, f"file://{tmp_path}/out", workers=1, **sharded_options())
    assert folder_bytes(tmp_path / "out") == folder_bytes(sharded_reference())  # folders made for the records
