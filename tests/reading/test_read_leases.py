"""A file truncated or opened for writing while a process reads it: a FormatError, never SIGBUS (NOTE [read leases])."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from fastdata import open_dataset
from fastdata.converters import convert_imagefolder
from fastdata.errors import FormatError
from fastdata.measure.synthetic import make_imagefolder

pytestmark = pytest.mark.integration  # other programs write and truncate the files under a reader

# Before read leases, 10 of these 12 (file, delay) runs of READ_WHILE_TRUNCATED with read_batch died of SIGBUS
# (exit 135): a batch reads or decodes from the map after the per-batch fingerprint check.
DELAYS = [0.1, 0.37, 0.5]

READ_WHILE_TRUNCATED = textwrap.dedent("""
    import os, subprocess, sys, time
    import numpy as np
    from fastdata import FormatError, make_loader, open_dataset

    path, victim, delay, how = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    ds = open_dataset(path)
    assert ds._store.unguarded() is None, ds._store.unguarded()
    rng = np.random.default_rng(0)
    ds.read_batch(np.arange(64))  # mapped and read
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time; time.sleep(float(sys.argv[3])); started = time.monotonic(); "
        "os.truncate(sys.argv[1], int(sys.argv[2])); print(time.monotonic() - started)"),
        victim, str(os.path.getsize(victim) // 2), str(delay)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            if how == "read_batch":
                ds.read_batch(np.sort(rng.choice(len(ds), 256, replace=False)))
            else:
                for _ in make_loader(ds, batch_size=256, shuffle=True):
                    pass
    except FormatError as exc:
        print("FormatError:", exc)
    out, _ = writer.communicate(timeout=60)
    assert writer.returncode == 0
    print("writer waited", float(out))
""")


@pytest.fixture(scope="module")
def leased_sources(tmp_path_factory):
    """1,200 64 px images of varied modes and sizes, ``{name: path}``: raw, JPEG, HDF5, Arrow, a shard folder."""
    folder = tmp_path_factory.mktemp("leases")
    root = make_imagefolder(folder / "photos", 4, 300, size=(96, 80), seed=1, vary=True)
    paths = {}
    for fmt, ext in (("hdf5", ".h5"), ("arrow", ".arrow")):
        for storage in ("raw", "jpeg"):
            paths[f"{fmt}-{storage}"] = folder / f"{storage}{ext}"
            convert_imagefolder(root, paths[f"{fmt}-{storage}"], size=64, storage=storage, workers=1, progress=False)
    paths["shards-raw"] = folder / "shards"
    convert_imagefolder(root, paths["shards-raw"], size=64, storage="raw", workers=1, progress=False,
                        shard_size=1 << 20)
    return paths


def copy_of(source, folder):
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / source.name
    (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
    return target


@pytest.mark.parametrize("how", ["read_batch", "make_loader"])
@pytest.mark.parametrize("name", ["hdf5-raw", "hdf5-jpeg", "arrow-raw", "arrow-jpeg", "shards-raw"])
def test_a_file_truncated_by_another_program_mid_read_is_a_format_error(leased_sources, tmp_path, name, how):
    for delay in DELAYS:
        path = copy_of(leased_sources[name], tmp_path / str(delay))
        victim = sorted(path.glob("shard-*"))[1] if path.is_dir() else path
        done = subprocess.run([sys.executable, "-c", READ_WHILE_TRUNCATED, path, victim, str(delay), how],
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, (delay, done.returncode, done.stdout, done.stderr)  # -7: SIGBUS
        assert f"FormatError: {str(victim)!r}" in done.stdout, (delay, done.stdout)
        waited = float(done.stdout.rsplit("writer waited", 1)[1])
        assert waited < 20, f"the writer waited {waited:.1f} s: the lease was not released after a batch"
        assert os.path.getsize(victim) < os.path.getsize(leased_sources[name] / victim.name if path.is_dir()
                                                         else leased_sources[name])


def test_a_thread_of_the_reading_process_truncates_and_the_next_read_is_refused(leased_sources, tmp_path):
    path = copy_of(leased_sources["hdf5-jpeg"], tmp_path)
    ds = open_dataset(path)
    ds.read_batch(np.arange(16))
    size = os.path.getsize(path)
    writer = threading.Thread(target=os.truncate, args=(path, size // 2))  # waits for the main thread's handler
    writer.start()
    writer.join(60)
    assert not writer.is_alive() and os.path.getsize(path) == size // 2
    with pytest.raises(FormatError, match=f"changed size from {size} to {size // 2} bytes"):
        ds.read_batch(np.arange(16))


def test_opened_for_writing_without_a_change_is_refused_too(leased_sources, tmp_path):
    # what the writer does next is unknown to the reader: the file is not read as what it was
    path = copy_of(leased_sources["arrow-raw"], tmp_path)
    ds = open_dataset(path)
    expected = ds.read_batch(np.arange(8))[0]
    with open(path, "r+b"):  # in this process: open(2) is retried once the handler released the lease
        pass
    with pytest.raises(FormatError, match="was opened for writing or truncated by another program"):
        ds.read_batch(np.arange(8))
    assert (open_dataset(path).read_batch(np.arange(8))[0] == expected).all()  # opened again: read as before


def test_a_process_whose_sigio_has_another_handler_reads_unguarded_and_says_why(leased_sources, tmp_path):
    previous = signal.signal(signal.SIGIO, lambda signum, frame: None)
    try:
        ds = open_dataset(leased_sources["hdf5-raw"])
        assert ds.read_batch(np.arange(4))[0].shape[0] == 4
        assert "SIGIO has another handler" in ds._store.unguarded()
    finally:
        signal.signal(signal.SIGIO, previous)
    ds = open_dataset(leased_sources["hdf5-raw"])
    ds.read_batch(np.arange(4))
    assert ds._store.unguarded() is None


def test_a_read_refused_for_a_breaking_lease_releases_it_at_once(tmp_path):
    # NOTE [a break during leave] in leases.py: the SIGIO handler, run inside leave() after it listed the shards to
    # release, marks the lease breaking but cannot release it; the next read is refused and must release it, or the
    # writer waits for the kernel's lease-break-time (45 s).
    from fastdata.reading.leases import Leases

    path = tmp_path / "leased.bin"
    path.write_bytes(b"x" * 4096)
    leases = Leases({0: str(path)})
    leases.take(0, str(path))
    if leases.unguarded is not None:
        pytest.skip(leases.unguarded)
    assert leases.enter() == {} and leases.leave() is None and 0 in leases._held  # a read keeps its lease
    leases._broken[0] = str(path)  # what the handler leaves behind when it could not take the lock
    assert leases.enter() == {0: str(path)}  # the read is refused...
    assert 0 not in leases._held  # ...and the lease released: a writer goes on now
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # a leased file answers a non-blocking writer EAGAIN
    os.close(fd)
