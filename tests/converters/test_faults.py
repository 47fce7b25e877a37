"""Conversion faults, in real processes: full disks, kills and signals, racing and unwritable outputs."""

import errno
import glob
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner
from support import FORMATS, folder_listing, wait_for

from fastdata import FastdataError, convert_imagefolder, convert_text
from fastdata.cli import main
from fastdata.converters.staging import SignalWatch, staged_output
from fastdata.formats import read_packed
from fastdata.measure.synthetic import make_reviews, write_text_file

CLI = [sys.executable, "-m", "fastdata"]

# The CLI with every image taking DELAY more seconds, so a test can act while it runs.
SLOW_CLI_SCRIPT = textwrap.dedent(
    """
    import os
    import time

    from fastdata.converters import imagefolder

    _real_prepare = imagefolder._prepare_image


    def _slow_prepare(task, **kwargs):
        time.sleep(float(os.environ["DELAY"]))
        return _real_prepare(task, **kwargs)


    imagefolder._prepare_image = _slow_prepare

    if __name__ == "__main__":
        from fastdata.cli import main

        main()
    """
)


def fastdata(*args):
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=300)


def slow_fastdata(tmp_path, delay, *args, **popen):
    script = tmp_path / "slow_fastdata.py"
    script.write_text(SLOW_CLI_SCRIPT)
    command = [sys.executable, os.fspath(script)] + [str(a) for a in args]
    return subprocess.Popen(command, env={**os.environ, "DELAY": str(delay)}, text=True, **popen)


def process_state(pid):
    """Return ``(parent pid, state letter)`` of a process from /proc, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return int(fields[1]), fields[0]


def children(pid):
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        state = process_state(int(name))
        if state is not None and state[0] == pid:
            found.append(int(name))
    return found


def running(pid):
    state = process_state(pid)
    return state is not None and state[1] != "Z"


# ---------------------------------------------------------------- full disk


@pytest.mark.parametrize("workers", [1, 2])
def test_full_disk_with_raw_storage_is_reported_and_leaves_nothing(source_root, small_disk, workers):
    disk = small_disk(1 << 20)  # the raw rows need 24 x 3 x 160 x 160 bytes = 1.8 MB
    done = fastdata("convert", "imagefolder", source_root, disk / "out.h5", "--size", "160",
                    "--workers", workers, "--quiet")
    assert done.returncode == 1, done.stderr
    assert "Error: no space left on the device" in done.stderr
    assert folder_listing(disk) == []


@pytest.mark.parametrize("ext", FORMATS.values())
def test_full_disk_during_the_final_write_is_reported_and_leaves_nothing(source_root, small_disk, ext):
    disk = small_disk(1 << 20)  # room for the 0.7 MB of raw rows, not for the file written from them too
    with pytest.raises(FastdataError, match="no space left on the device") as info:
        convert_imagefolder(source_root, disk / f"out{ext}", size=100, workers=1, progress=False)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert folder_listing(disk) == []


def test_full_disk_while_numbering_the_vocabulary_is_reported_and_leaves_nothing(tmp_path, small_disk):
    texts, labels = make_reviews(300, seed=5)
    src = write_text_file(tmp_path / "reviews.jsonl", texts, labels)
    convert_text(src, tmp_path / "probe.h5", workers=1, progress=False)
    num_tokens = read_packed(tmp_path / "probe.h5")[1]["lengths"]["num_tokens"]
    # Room for the 4-byte provisional ids, not for the 2-byte final ids beside them.
    disk = small_disk(5 * num_tokens)
    done = fastdata("convert", "text", src, disk / "out.h5", "--workers", "1", "--quiet")
    assert done.returncode == 1, done.stderr
    assert "Error: no space left on the device" in done.stderr
    assert folder_listing(disk) == []


# ---------------------------------------------------------------- killed, interrupted


@pytest.mark.integration  # a subprocess killed, signalled or raced
def test_killed_conversion_takes_its_workers_along_and_the_next_run_cleans_up(source_root, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ("convert", "imagefolder", source_root, out_dir / "out.h5", "--workers", "2", "--quiet")
    with slow_fastdata(tmp_path, 1, *args) as child:
        workers = wait_for(lambda: len(children(child.pid)) >= 2 and children(child.pid), "the workers")
        wait_for(lambda: os.listdir(out_dir), "the staging folder")
        child.kill()
    assert len(os.listdir(out_dir)) == 1  # the dead conversion's staging folder
    wait_for(lambda: not any(map(running, workers)), "the workers to die with their parent", seconds=30)
    done = fastdata("convert", "imagefolder", source_root, out_dir / "out.h5", "--size", "16", "--quiet")
    assert done.returncode == 0, done.stderr
    assert folder_listing(out_dir) == ["out.h5"]


def test_a_running_conversions_staging_folder_is_kept(source_root, tmp_path):
    with staged_output(tmp_path / "first.h5") as (staging, staged_path):
        convert_imagefolder(source_root, tmp_path / "second.h5", size=16, workers=1, progress=False)
        assert os.path.isdir(staging)
        open(staged_path, "wb").close()
    assert folder_listing(tmp_path) == ["first.h5", "second.h5"]


@pytest.mark.integration  # a subprocess killed, signalled or raced
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_during_the_final_hdf5_write_aborts_and_leaves_nothing(source_root, tmp_path, signum):
    # 24 raw 1400x1400 images: a 141 MB file, written in 64 MB slices.
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = CLI + ["convert", "imagefolder", os.fspath(source_root), os.fspath(out_dir / "out.h5"),
                  "--size", "1400", "--workers", "1", "--quiet"]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:

        def writing():  # the staged file holds more than its header: the pixels are being written
            return any(os.path.getsize(path) > 1 << 20 for path in glob.glob(f"{out_dir}/.out.h5.*/out.h5"))

        wait_for(lambda: writing() or child.poll() is not None, "the final write")
        child.send_signal(signum)
        output, _ = child.communicate(timeout=120)
    assert child.returncode == (1 if signum == signal.SIGINT else 128 + signum), output
    assert "Traceback" not in output and "Exception ignored" not in output, output
    assert folder_listing(out_dir) == [], output


def test_a_signal_that_c_code_turned_into_another_error_still_stops_with_the_signal():
    # h5py's type conversion caught the handler's SystemExit and raised a TypeError (a CI run, stop 15)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with pytest.raises(SystemExit) as stopped, SignalWatch():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                signal.sigtimedwait([], 0.01)  # the handler runs on the next bytecode
            except BaseException as exc:
                raise TypeError("Operation not defined for data type class") from exc
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert isinstance(stopped.value.__cause__, TypeError)


# ---------------------------------------------------------------- outputs


@pytest.mark.integration  # a subprocess killed, signalled or raced
def test_concurrent_conversions_to_one_output_one_wins_the_other_fails_cleanly(source_root, tmp_path):
    out = tmp_path / "out" / "out.h5"
    out.parent.mkdir()
    sizes = (16, 24)
    racers = [slow_fastdata(tmp_path, 0.05, "convert", "imagefolder", source_root, out, "--size", size,
                            "--workers", "1", "--quiet", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for size in sizes]
    outputs = [racer.communicate(timeout=300) for racer in racers]
    codes = [racer.returncode for racer in racers]
    assert sorted(codes) == [0, 1], outputs
    winner, loser = codes.index(0), codes.index(1)
    assert "already exists" in outputs[loser][1], outputs[loser]
    assert folder_listing(out.parent) == ["out.h5"]
    assert read_packed(out)[1]["sample_shape"] == [3, sizes[winner], sizes[winner]]


def test_unwritable_output_folder_is_a_one_line_error(source_root, tmp_path, small_disk):
    if os.geteuid() == 0:  # root writes through permission bits, not through a read-only mount
        folder = small_disk(1 << 20, read_only=True)
    else:
        folder = tmp_path / "locked"
        folder.mkdir(mode=0o555)
    with pytest.raises(FastdataError, match=f"cannot write in the output folder '{folder}'"):
        convert_imagefolder(source_root, folder / "out.h5", size=16, workers=1, progress=False)
    result = CliRunner().invoke(main, ["convert", "imagefolder", os.fspath(source_root), os.fspath(folder / "out.h5")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert result.output.startswith("Error: cannot write in the output folder"), result.output
    assert len(result.output.strip().splitlines()) == 1


def test_text_output_that_is_its_own_source_is_refused(tmp_path):
    texts, labels = make_reviews(8, seed=2)
    packed = tmp_path / "s.arrow"
    convert_text(write_text_file(tmp_path / "s.jsonl", texts, labels), packed, workers=1, progress=False)
    before = packed.read_bytes()
    alias = tmp_path / "alias.arrow"
    os.link(packed, alias)
    # An output is a packed file, and a packed file is refused as a text source before any output is made
    # (NOTE [binary] in textsources.py); staging's own "is the source" check stays behind it.
    for out in (packed, alias):
        with pytest.raises(ValueError, match="is an Arrow IPC file, not text"):
            convert_text(packed, out, overwrite=True, workers=1, progress=False)
    result = CliRunner().invoke(main, ["convert", "text", os.fspath(packed), os.fspath(packed), "--overwrite"])
    assert result.exit_code == 1 and result.output.startswith("Error: "), result.output
    assert "is an Arrow IPC file, not text" in result.output
    assert packed.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["alias.arrow", "s.arrow", "s.jsonl"]
