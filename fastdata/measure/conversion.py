"""What a conversion costs besides time: the disk its output folder takes at its peak, the memory of its processes.

A conversion is measured from outside: it runs as a subprocess (a
``fastdata convert`` command or a script) while a thread of this process
samples the output folder and the subprocess's process tree every
``interval`` seconds. See NOTE [watched from outside].

NOTE [watched from outside]: a sampling thread inside the converting
process would change what it measures: the converters fork their workers
only while the process runs one thread, and start them from a forkserver
otherwise (NOTE [worker start] in converters/parallel.py).

The plain ``multiprocessing.Pool`` baseline decodes and resizes as the
images section's does (``baselines.load_resized``), and keeps nothing.
"""

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import partial

from fastdata._optional import require
from fastdata.codecs.images import encode_jpeg
from fastdata.measure.baselines import load_resized, plain_pool, pooled


def folder_usage(root):
    """Return ``(bytes, allocated)`` of every file under ``root``, hidden and half-written ones included.

    ``bytes`` sums the files' sizes, ``allocated`` the disk blocks they hold
    (less for sparse files). Files that vanish meanwhile are left out.
    """
    size = allocated = 0
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return 0, 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                inner = folder_usage(entry.path)
                size, allocated = size + inner[0], allocated + inner[1]
            elif entry.is_file(follow_symlinks=False):
                stat = entry.stat(follow_symlinks=False)
                size, allocated = size + stat.st_size, allocated + stat.st_blocks * 512
        except FileNotFoundError:  # renamed or removed since the listing
            continue
    return size, allocated


def tree_rss(pid):
    """Return ``(rss of pid, [rss of each descendant])`` in bytes; ``(None, [])`` once ``pid`` is gone."""
    psutil = require("psutil", "bench", "measuring the memory of a process tree")
    try:
        process = psutil.Process(pid)
        own, children = process.memory_info().rss, process.children(recursive=True)
    except psutil.Error:
        return None, []
    found = []
    for child in children:
        try:
            found.append(child.memory_info().rss)
        except psutil.Error:  # exited since the listing
            continue
    return own, found


@dataclass
class Peaks:
    """The largest readings of a watched conversion, in bytes.

    Attributes:
        disk: allocated bytes of the output folder.
        disk_bytes: summed file sizes of the output folder.
        driver_rss: RSS of the watched process.
        worker_rss: RSS of its largest descendant (a worker) at any reading.
        total_rss: RSS of the process and all its descendants together.
        descendants: most descendants (workers) seen at once.
        readings: readings taken.
    """

    disk: int = 0
    disk_bytes: int = 0
    driver_rss: int = 0
    worker_rss: int = 0
    total_rss: int = 0
    descendants: int = 0
    readings: int = 0

    def add(self, usage, rss):
        (size, allocated), (own, children) = usage, rss
        self.disk, self.disk_bytes = max(self.disk, allocated), max(self.disk_bytes, size)
        if own is not None:
            self.driver_rss = max(self.driver_rss, own)
            self.worker_rss = max(self.worker_rss, *children, 0)
            self.total_rss = max(self.total_rss, own + sum(children))
            self.descendants = max(self.descendants, len(children))
        self.readings += 1

    def to_dict(self):
        return asdict(self)


@dataclass
class Watched:
    """A finished watched run: exit status, wall seconds, output, peaks and whether it was killed."""

    returncode: int
    seconds: float
    stdout: str
    stderr: str
    peaks: Peaks = field(default_factory=Peaks)
    killed: bool = False

    def json(self):
        """Return the last stdout line parsed as JSON (what a measuring script prints)."""
        return json.loads(self.stdout.strip().splitlines()[-1])


def run_watched(command, folder, *, interval=0.05, kill_when=None, timeout=None, env=None, cwd=None):
    """Run ``command`` while sampling ``folder`` and its process tree every ``interval`` s; return Watched.

    Args:
        command: argv of the subprocess (started in a new process group).
        folder: the output folder to sample (it may not exist yet).
        kill_when: called with the folder at each reading; once it returns
            true, the whole process group gets SIGKILL (a crash half-way).
        timeout: seconds before the process group is killed and TimeoutError raised.
    """
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env=env, cwd=cwd)
    peaks, stop, killed = Peaks(), threading.Event(), threading.Event()

    def sample():
        while not stop.is_set():
            peaks.add(folder_usage(folder), tree_rss(process.pid))
            if kill_when is not None and not killed.is_set() and kill_when(folder):
                killed.set()
                _kill_group(process)
            stop.wait(interval)

    sampler = threading.Thread(target=sample, name="fastdata-watch", daemon=True)
    sampler.start()
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        _kill_group(process)
        process.communicate()
        raise TimeoutError(f"{command[:3]}... ran past {timeout} s and was killed") from exc
    finally:
        stop.set()
        sampler.join()
    seconds = time.perf_counter() - started
    peaks.add(folder_usage(folder), (None, []))
    return Watched(process.returncode, seconds, stdout, stderr, peaks, killed.is_set())


def _kill_group(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the workers with it
    except ProcessLookupError:
        pass


def count_shards(folder, extension):
    """Return how many finished shard files (``shard-*<extension>``, not hidden) ``folder`` holds."""
    try:
        return sum(name.startswith("shard-") and name.endswith(extension) for name in os.listdir(folder))
    except FileNotFoundError:
        return 0


def pool_decode_count(paths, size, workers, quality=None):
    """Decode and resize every path on a plain ``multiprocessing.Pool`` keeping nothing; return how many.

    The conversion work with no writing and no pixels sent back: an upper
    bound for a script without fastdata. With ``quality`` each image is also
    encoded as JPEG at that quality, as a conversion to jpeg storage must.
    Pool start-up is included.
    """
    chunksize = max(1, min(64, len(paths) // (workers * 8)))
    with plain_pool(workers) as pool:
        return sum(pooled(pool, partial(_decode_only, size=size, quality=quality), paths, chunksize, ordered=False))


def _decode_only(path, size, quality):
    pixels = load_resized(path, size)
    if quality is not None:
        encode_jpeg(pixels, quality)
    return 1
