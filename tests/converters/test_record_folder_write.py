"""fastdata.write into a shard folder: the same bytes on Dask and in parts, resumed after a kill, redone if damaged."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support import assert_same_batches, assert_same_files, run_cli, wait_for

from fastdata import Field, OptionError, OutputExistsError, SampleError, open_dataset, write
from fastdata.formats.shards import read_index
from fastdata.verify import verify

SCHEMA = {"id": "int", "caption": "str", "tokens": Field("tokens"), "emb": Field("array", shape=(6,))}


def _records(count, seed=0):
    rng = np.random.default_rng(seed)
    return [{"id": index, "caption": "é" * int(rng.integers(0, 60)),
             "tokens": rng.integers(0, 500, index % 17).tolist(), "emb": np.full(6, index, np.float32)}
            for index in range(count)]


def _record_of(number):
    """A record made from an input on a worker (fn=): a top-level function, so a pool can run it."""
    if number % 97 == 5:
        raise ValueError(f"input {number} is unusable")
    return {"id": number, "caption": "x" * (number % 31), "tokens": list(range(number % 11)),
            "emb": np.full(6, number, np.float32)}


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A folder written at once, in this process: what every other way of writing it must equal."""
    out = tmp_path_factory.mktemp("whole") / "folder"
    write(list(range(900)), out, SCHEMA, fn=_record_of, shard_size=6_000, on_error="skip")
    return out


@pytest.mark.integration
def test_the_folder_is_the_same_bytes_on_a_dask_cluster(tmp_path, whole):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0") as cluster:
        with distributed.Client(cluster) as client:
            write(list(range(900)), tmp_path / "dask", SCHEMA, fn=_record_of, shard_size=6_000, on_error="skip",
                  executor=client)
    assert_same_files(tmp_path / "dask", whole)
    assert read_index(whole).num_shards > 8


def test_parts_write_their_own_shards_and_the_last_one_writes_the_index(tmp_path, whole):
    out = tmp_path / "parts"
    reports = [write(iter(range(900)), out, SCHEMA, fn=_record_of, shard_size=6_000, on_error="skip", part=(i, 3),
                     workers=1 + i % 2)
               for i in (2, 0, 1)]
    assert_same_files(out, whole)
    assert sum(report.num_samples for report in reports[:2]) < read_index(whole).num_samples
    assert reports[2].num_samples == read_index(whole).num_samples == 900 - 10
    assert [path for path, _ in reports[2].skipped] == [f"record {i}" for i in range(5, 900, 97)]


def test_a_part_of_other_settings_or_other_inputs_is_refused(tmp_path):
    out = tmp_path / "parts"
    write(list(range(200)), out, SCHEMA, fn=_record_of, shard_size=6_000, part=(0, 2), on_error="skip")
    with pytest.raises(OptionError, match="shard_size: recorded 6000, now 7000"):
        write(list(range(200)), out, SCHEMA, fn=_record_of, shard_size=7_000, part=(1, 2), on_error="skip")
    with pytest.raises(OptionError, match="first_inputs: recorded"):
        write(list(range(1, 201)), out, SCHEMA, fn=_record_of, shard_size=6_000, part=(1, 2), on_error="skip")
    with pytest.raises(OutputExistsError, match="an unfinished conversion; pass --resume"):
        write(list(range(200)), out, SCHEMA, fn=_record_of, shard_size=6_000, on_error="skip")
    with pytest.raises(OptionError, match="overwrite would remove the shards of the other parts"):
        write(list(range(200)), out, SCHEMA, fn=_record_of, part=(1, 2), overwrite=True)
    with pytest.raises(OptionError, match="resume and part need a shard folder, not the file"):
        write(list(range(200)), tmp_path / "one.h5", SCHEMA, fn=_record_of, resume=True)
    assert not (out / "index.json").exists()


_KILLED = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from fastdata import Field, write
    sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]
    from test_record_folder_write import SCHEMA, _record_of

    def slow(number):
        if number >= 400:
            time.sleep(60)  # killed here: shards 0-3 are finished, the rest not
        return _record_of(number)

    write(list(range(900)), sys.argv[1], SCHEMA, fn=slow, shard_size=6_000, on_error="skip")
""")


@pytest.mark.integration
def test_a_killed_conversion_resumes_keeping_its_finished_shards(tmp_path, whole):
    out = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-c", _KILLED, str(out), os.path.dirname(__file__)])
    try:
        wait_for(lambda: (out / ".fastdata" / "shard-00003.json").exists() or process.poll() is not None,
                 "the first shards")
        assert process.poll() is None
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert not (out / "index.json").exists()
    kept = {name: os.stat(out / name).st_ino for name in os.listdir(out) if name.startswith("shard-")}
    assert len(kept) >= 4
    with pytest.raises(OutputExistsError, match="pass --resume"):
        write(list(range(900)), out, SCHEMA, fn=_record_of, shard_size=6_000, on_error="skip")
    report = write(list(range(900)), out, SCHEMA, fn=_record_of, shard_size=6_000, on_error="skip", resume=True,
                   workers=2)
    assert report.num_samples == 890 and not report.finished
    assert {name: os.stat(out / name).st_ino for name in kept} == kept  # kept, not written again
    assert_same_files(out, whole)
    indices = np.random.default_rng(1).permutation(890)[:300]
    assert_same_batches(open_dataset(out).read_batch(indices), open_dataset(whole).read_batch(indices))


def test_a_finished_folder_resumed_redoes_only_its_damaged_shards(tmp_path):
    out = tmp_path / "again"
    write(_records(500), out, SCHEMA, shard_size=5_000)
    assert write(_records(500), out, SCHEMA, shard_size=5_000, resume=True).finished
    index = read_index(out)
    (out / index.names[1]).unlink()
    with open(out / index.names[3], "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 8)
    untouched = os.stat(out / index.names[2]).st_ino
    report = write(_records(500), out, SCHEMA, shard_size=5_000, resume=True)
    assert sorted(name for name, _ in report.redone) == [index.names[1], index.names[3]]
    assert os.stat(out / index.names[2]).st_ino == untouched and verify(out).ok
    write(_records(500), tmp_path / "fresh", SCHEMA, shard_size=5_000)
    assert_same_files(out, tmp_path / "fresh")


def test_a_record_that_does_not_fit_stops_a_folder_with_its_index(tmp_path):
    records = _records(300)
    records[250]["id"] = 2.5
    with pytest.raises(SampleError, match="record 250: field 'id' \\(int\\) should be an integer"):
        write(records, tmp_path / "bad", SCHEMA, shard_size=5_000, workers=2)
    assert not (tmp_path / "bad" / "index.json").exists()
    assert not [name for name in os.listdir(tmp_path / "bad") if name.endswith(".partial.h5")]


def test_an_empty_set_of_records_is_an_empty_folder_of_its_schema(tmp_path):
    write([], tmp_path / "empty", SCHEMA)
    dataset = open_dataset(tmp_path / "empty")
    assert len(dataset) == 0 and read_index(tmp_path / "empty").num_shards == 0


def test_cli_parts_and_resume_of_a_table(tmp_path):
    table = tmp_path / "rows.csv"
    table.write_text("id,caption\n" + "".join(f"{i},text {'y' * (i % 23)}\n" for i in range(400)))
    out = tmp_path / "parts"
    for part in ("1/2", "0/2"):
        result = run_cli("convert", "table", table, out, "--shard-size", "2000", "--part", part, "--quiet")
        assert result.exit_code == 0, result.output
    write_whole = run_cli("convert", "table", table, tmp_path / "whole", "--shard-size", "2000", "--quiet")
    assert write_whole.exit_code == 0, write_whole.output
    assert_same_files(out, tmp_path / "whole")
    (out / "index.json").unlink()
    indexed = run_cli("index", out)
    assert indexed.exit_code == 0 and "400 samples" in indexed.output, indexed.output
    assert_same_files(out, tmp_path / "whole")
    again = run_cli("convert", "table", table, out, "--shard-size", "2000", "--resume", "--quiet")
    assert again.exit_code == 0 and "already finished" in again.output, again.output


def test_a_folder_written_to_s3_is_the_local_folder_byte_for_byte(tmp_path, whole, s3_server, monkeypatch):
    from test_remote_convert import folder_bytes, remote_bytes

    monkeypatch.setenv("FASTDATA_CACHE", str(tmp_path / "cache"))  # the staging folder
    url = s3_server.bucket() + "/records/"
    report = write(list(range(900)), url, SCHEMA, fn=_record_of, shard_size=6_000, on_error="skip", workers=2,
                   storage_options=s3_server.storage_options)
    assert report.num_samples == 890
    assert remote_bytes(url, s3_server.storage_options) == folder_bytes(whole)
    dataset = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path / "read")
    assert_same_batches(dataset.read_batch(np.arange(0, 890, 7)), open_dataset(whole).read_batch(np.arange(0, 890, 7)))
    with pytest.raises(OptionError, match="a URL output is written as a shard folder"):
        write(list(range(9)), s3_server.bucket() + "/one.h5", SCHEMA, fn=_record_of,
              storage_options=s3_server.storage_options)


def test_cli_converts_a_table_to_s3(tmp_path, s3_server, monkeypatch):
    from test_remote_convert import remote_bytes, storage_args

    monkeypatch.setenv("FASTDATA_CACHE", str(tmp_path / "cache"))
    table = tmp_path / "rows.jsonl"
    table.write_text("".join(f'{{"id": {i}, "caption": "line {i} ü"}}\n' for i in range(120)))
    url = s3_server.bucket() + "/table"
    result = run_cli("convert", "table", table, url, "--shard-size", "1000", "--quiet", *storage_args(s3_server))
    assert result.exit_code == 0, result.output
    assert "index.json" in remote_bytes(url, s3_server.storage_options)
    dataset = open_dataset(url, storage_options=s3_server.storage_options, cache_dir=tmp_path / "read")
    assert dataset.read_batch([0, 119])["caption"] == ["line 0 ü", "line 119 ü"] and dataset.shard_index.num_shards > 1
