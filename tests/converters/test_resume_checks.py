"""--resume checks what it keeps (issue 27): a finished shard folder's missing or damaged files are redone and
named; an intact one is reported finished, nothing rewritten; image and text conversions alike."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from support import NUM_CLASSES, PER_CLASS, folder_listing, one_error_line, run_cli

from fastdata import FastdataError, OptionError, convert_imagefolder, convert_text
from fastdata.verify import verify

NUM_SAMPLES = NUM_CLASSES * PER_CLASS
TEXT_SHARD_BYTES = 3000  # as conftest's shard_converted writes text_corpus/train


def snapshot(root):
    """``{relative path: (bytes, inode)}`` of every file under ``root`` but the lock files."""
    return {name: ((root / name).read_bytes(), os.stat(root / name).st_ino) for name in folder_listing(root)
            if (root / name).is_file() and not name.endswith("lock")}


def flip_byte(path, offset=-100):
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        byte = f.read(1)
        f.seek(offset, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def drop_a_field(path):
    index = json.loads(path.read_text())
    del index["metadata"]["num_samples"]
    path.write_text(json.dumps(index))


@pytest.fixture
def image_copy(sharded_reference, tmp_path):
    """A private copy of the converted hdf5 raw shard folder (5 shards), and the pristine one."""
    shutil.copytree(sharded_reference(), tmp_path / "out")
    return tmp_path / "out", sharded_reference()


def resume_images(source_root, out, sharded_cli_options, *extra):
    return run_cli("convert", "imagefolder", source_root, out, "--workers", "1", "--resume", *sharded_cli_options(),
                   *extra)


# ---------------------------------------------------------------- images


def test_an_intact_finished_folder_is_reported_finished_and_nothing_is_rewritten(source_root, image_copy,
                                                                                  sharded_cli_options):
    out, _ = image_copy
    before = snapshot(out)
    result = resume_images(source_root, out, sharded_cli_options)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == result.output.strip().splitlines()[0]  # one line
    assert result.output.startswith(f"{os.fspath(out)!r} is already finished: {NUM_SAMPLES} samples, 0 skipped; "
                                    "every file as its index lists it, nothing rewritten")
    assert "wrote" not in result.output
    assert snapshot(out) == before  # the same bytes in the same files


@pytest.mark.parametrize(("damage", "named"), [
    (lambda out: os.remove(out / "shard-00002.h5"), {"shard-00002.h5": "missing"}),
    (lambda out: flip_byte(out / "shard-00001.h5"), {"shard-00001.h5": "crc32"}),
    (lambda out: os.truncate(out / "shard-00004.h5", 1000), {"shard-00004.h5": "1000 bytes, the index says"}),
    (lambda out: (os.remove(out / "shard-00000.h5"), flip_byte(out / "shard-00003.h5", -2000)),
     {"shard-00000.h5": "missing", "shard-00003.h5": "crc32"}),
    (lambda out: flip_byte(out / "labels.npy", -1), {"labels.npy": "crc32"}),
    (lambda out: drop_a_field(out / "index.json"), {"index.json": "damaged: field metadata.num_samples is missing"}),
])
def test_missing_or_damaged_files_of_a_finished_folder_are_redone_and_named(source_root, image_copy,
                                                                             sharded_cli_options, damage, named):
    # Before: "wrote ...: 24 samples", exit 0, and the shard still missing or damaged.
    out, reference = image_copy
    damage(out)
    before = snapshot(out)
    result = resume_images(source_root, out, sharded_cli_options)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    files = "file" if len(named) == 1 else "files"
    assert lines[0].startswith(f"wrote {os.fspath(out)!r}: {NUM_SAMPLES} samples")
    assert lines[0].endswith(f"; redid {len(named)} missing or damaged {files}")
    assert [line.split(":")[0] for line in lines[1:]] == [f"  redid {name!r}" for name in named]
    assert all(why in line for line, why in zip(lines[1:], named.values()))
    assert verify(out).ok
    after = snapshot(out)
    assert {name: data for name, (data, _) in after.items()} == {name: data for name, (data, _) in
                                                                  snapshot(reference).items()}
    kept = [name for name in before if name.startswith("shard-") and name not in named]
    assert all(after[name][1] == before[name][1] for name in kept)  # intact shards were not written again


def test_a_folder_whose_plan_is_gone_is_named_with_what_to_do(source_root, image_copy, sharded_cli_options):
    out, _ = image_copy
    os.remove(out / "shard-00002.h5")
    os.remove(out / ".fastdata" / "plan.json")
    result = resume_images(source_root, out, sharded_cli_options)
    assert result.exit_code == 1
    line = one_error_line(result)
    assert repr(os.fspath(out)) in line and "'shard-00002.h5' missing" in line and "--overwrite" in line


def test_resume_of_a_finished_folder_with_other_settings_is_refused(source_root, image_copy, sharded_options):
    out, _ = image_copy
    os.remove(out / "shard-00002.h5")
    with pytest.raises(OptionError, match=r"other settings \(.*size: recorded"):
        convert_imagefolder(source_root, out, resume=True, **{**sharded_options(), "size": 24})
    assert not (out / "shard-00002.h5").exists()  # nothing redone under other settings


@pytest.mark.integration
def test_a_resume_in_its_own_process_redoes_a_missing_shard(source_root, image_copy, sharded_cli_options):
    out, reference = image_copy
    os.remove(out / "shard-00003.h5")
    done = subprocess.run([sys.executable, "-m", "fastdata", "convert", "imagefolder", os.fspath(source_root),
                           os.fspath(out), "--workers", "2", "--resume", *sharded_cli_options()],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "redid 'shard-00003.h5': it was missing" in done.stdout
    assert (out / "shard-00003.h5").read_bytes() == (reference / "shard-00003.h5").read_bytes()


# ---------------------------------------------------------------- text, as images


@pytest.fixture
def text_copy(shard_converted, tmp_path):
    shutil.copytree(shard_converted("hdf5", "text"), tmp_path / "out")
    return tmp_path / "out", shard_converted("hdf5", "text")


def resume_text(text_corpus, out, *extra):
    return run_cli("convert", "text", text_corpus / "train", out, "--format", "hdf5", "--shard-size",
                   TEXT_SHARD_BYTES, "--workers", "1", "--quiet", "--resume", *extra)


def test_text_resume_of_an_intact_finished_folder_is_finished_as_for_images(text_corpus, text_copy):
    # Before: "Error: ... already exists; pass --overwrite", where the image converter took it as done.
    out, _ = text_copy
    before = snapshot(out)
    result = resume_text(text_corpus, out)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{os.fspath(out)!r} is already finished: ")
    assert "nothing rewritten" in result.stdout and not result.stderr
    assert snapshot(out) == before


def test_text_resume_converts_a_damaged_folder_again_naming_what_was_damaged(text_corpus, text_copy):
    out, reference = text_copy
    os.remove(out / "shard-00001.h5")
    flip_byte(out / "lengths.npy", -1)
    result = resume_text(text_corpus, out)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].endswith("; converted again whole for 2 missing or damaged files"), result.stdout
    assert lines[1:] == ["  redid 'shard-00001.h5': it was missing",
                         f"  redid 'lengths.npy': it was {lines[2].split('it was ')[1]}"]
    assert "crc32" in lines[2]
    assert {name: data for name, (data, _) in snapshot(out).items()} == {
        name: data for name, (data, _) in snapshot(reference).items()}


def test_text_resume_with_other_settings_or_of_a_file_is_refused(text_corpus, text_copy, tmp_path):
    out, _ = text_copy
    result = resume_text(text_corpus, out, "--max-length", "7")
    assert result.exit_code == 1 and "preprocessing.max_length: recorded None, now 7" in one_error_line(result)
    with pytest.raises(OptionError, match="resume needs a shard folder"):
        convert_text(text_corpus / "train", tmp_path / "one.h5", resume=True, progress=False)


# ---------------------------------------------------------------- at a URL


def test_a_finished_url_with_a_shard_gone_is_refused_naming_it(source_root, s3_server, sharded_options, tmp_path,
                                                               monkeypatch):
    # Before: "done", nothing checked. The listing the resume reads anyway gives each object's size.
    monkeypatch.setenv("FASTDATA_CACHE", os.fspath(tmp_path / "cache"))
    options = {**sharded_options(), "storage_options": s3_server.storage_options, "workers": 1}
    url = s3_server.bucket() + "/train"
    convert_imagefolder(source_root, url, **options)
    assert convert_imagefolder(source_root, url, resume=True, **options).finished
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/shard-00002.h5")
    with pytest.raises(FastdataError, match=rf"'{url}' is damaged \('shard-00002.h5' missing\); convert it again "
                                            "with --overwrite"):
        convert_imagefolder(source_root, url, resume=True, **options)


def test_text_resume_at_a_url_keeps_an_intact_folder_and_converts_a_damaged_one_again(text_corpus, s3_server,
                                                                                      tmp_path, monkeypatch):
    # Before: "is a finished shard folder; pass --overwrite", where the image converter took it as done.
    monkeypatch.setenv("FASTDATA_CACHE", os.fspath(tmp_path / "cache"))
    url = s3_server.bucket() + "/text"
    options = {"format": "hdf5", "shard_size": TEXT_SHARD_BYTES, "workers": 1, "progress": False,
               "storage_options": s3_server.storage_options}
    convert_text(text_corpus / "train", url, **options)
    assert convert_text(text_corpus / "train", url, resume=True, **options).finished
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    s3_server.client().delete_object(Bucket=bucket, Key=f"{prefix}/shard-00001.h5")
    report = convert_text(text_corpus / "train", url, resume=True, **options)
    assert report.redone == [("shard-00001.h5", "missing")] and report.redone_whole and not report.finished
    assert convert_text(text_corpus / "train", url, resume=True, **options).finished
