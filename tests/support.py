"""Plain helpers and constants shared by the tests (fixtures live in conftest.py)."""

import json
import multiprocessing
import os
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from fastdata.reading.shuffles import CACHE_SHARE

NUM_CLASSES = 4
PER_CLASS = 6
SOURCE_SIZE = (120, 90)  # (width, height) the source images vary around
STORED_SIZE = 32  # stored height and width

FORMATS = {"hdf5": ".h5", "arrow": ".arrow"}
STORAGES = ("raw", "jpeg")
KINDS = ("raw", "jpeg", "text")  # what a packed file holds: raw or JPEG images, or tokens
TEXT_PER_CLASS = 12  # reviews per class in the text corpus fixture
TEXT_NUM_UNSUP = 4


def memory_short_of(nbytes):
    """The memory available to pretend for data of ``nbytes`` bytes: just too little for them to stay in the page
    cache (NOTE [auto shuffle] in shuffles.py), room for windows that hold up to ``nbytes`` (NOTE [window room])."""
    return int(nbytes / CACHE_SHARE) - 1


def planned(loader, epoch):
    """The batches ``loader`` reads in ``epoch``, from its order (each sorted, as a loader reads it)."""
    order = loader.sampler.order
    return [np.sort(order.batch(epoch, step)) for step in range(order.num_steps)]


def walk_windows(dataset, reads, epoch, look=None):
    """Read every step of ``epoch`` of ``reads.order`` from ``dataset`` as a WindowAhead wants ``reads``' windows.

    Checks that a step's Parts come from the windows exactly where it lies in the two wanted, and that the
    dataset counts its read as from the windows exactly then; ``look(parts, indices)`` sees those Parts before
    they are released. Returns ``[(indices, images, labels, from_windows)]`` (numpy arrays), a step each.
    """
    from fastdata.errors import FastPathWarning
    from fastdata.reading.windows import WindowAhead

    order, read_ahead, steps = reads.order, WindowAhead(reads), []
    read_ahead.start(epoch, 0)
    for step in range(order.num_steps):
        read_ahead.advance(step)
        start, stop = order.step_positions(step)
        indices = order.batch(epoch, step)
        parts = reads.parts(indices)
        assert (parts is not None) == (order.window_of(epoch, stop - 1) <= order.window_of(epoch, start) + 1), step
        if parts is not None:
            try:
                if look is not None:
                    look(parts, indices)
            finally:
                parts.release()
        before = dataset.read_paths()["windows"]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "a batch .* lies outside the block order's windows", FastPathWarning)
            images, labels = dataset.read_batch(indices)
        assert (parts is None) == (dataset.read_paths()["windows"] == before), step
        steps.append((indices, images.numpy(), labels.numpy(), parts is not None))
    return steps


def folder_listing(folder):
    """Return every name under ``folder`` (hidden ones included), relative and sorted."""
    names = []
    for parent, subfolders, files in os.walk(folder):
        for name in subfolders + files:
            names.append(os.path.relpath(os.path.join(parent, name), folder))
    return sorted(names)


def assert_same_files(folder, other):
    """Assert two folders hold the same names and every file the same bytes (hidden ones included, locks aside)."""
    names = [name for name in folder_listing(folder) if not name.endswith("lock")]
    assert names == [name for name in folder_listing(other) if not name.endswith("lock")]
    for name in names:
        if os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name), "rb") as mine, open(os.path.join(other, name), "rb") as theirs:
                assert mine.read() == theirs.read(), name


def write_random_png(path, rng, size=(12, 10)):
    """Write a small random RGB PNG (cheap, lossless) and return its pixels [H, W, 3]."""
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(path)
    return pixels


def write_png_header(path, width, height):
    """Write a tiny PNG whose IHDR claims ``width`` x ``height`` RGB pixels (no pixel data).

    Pillow checks the claimed size against MAX_IMAGE_PIXELS when it opens the
    file, so a huge claim is a decompression bomb costing a few bytes on disk.
    """
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b""))


def stored_images(path):
    """Read every stored image of a packed file as uint8 ``[N, H, W, 3]`` (format layer only)."""
    from fastdata.codecs.images import decode_jpeg
    from fastdata.formats import read_packed

    columns, metadata = read_packed(path)
    if metadata["storage"] == "raw":
        return np.asarray(columns.samples).transpose(0, 2, 3, 1).copy(), np.asarray(columns.labels).copy(), metadata
    images = [
        decode_jpeg(columns.samples[columns.offsets[i] : columns.offsets[i + 1]].tobytes())
        for i in range(columns.num_samples)
    ]
    return np.stack(images), np.asarray(columns.labels).copy(), metadata


def expected_images(root, relpaths, spec, storage, quality=90):
    """What a converter should store for ``relpaths``: load_image, and a JPEG round trip for jpeg."""
    from fastdata.codecs.images import decode_jpeg, encode_jpeg, load_image

    images = []
    for relpath in relpaths:
        pixels = load_image(os.path.join(root, relpath), spec)
        if storage == "jpeg":
            pixels = decode_jpeg(encode_jpeg(pixels, quality))
        images.append(pixels)
    return np.stack(images)


# ---------------------------------------------------------------- text


def read_texts(root, relpaths):
    """Return the text of each ``root/relpath``, read as the converter reads it."""
    texts = []
    for relpath in relpaths:
        with open(os.path.join(root, relpath), encoding="utf-8-sig") as f:
            texts.append(f.read())
    return texts


def stored_sequences(path):
    """Return ``(list of int64 id arrays, labels int64 [N], metadata)`` through the format layer."""
    from fastdata.formats import read_packed

    columns, metadata = read_packed(path)
    values, offsets = np.asarray(columns.samples), np.asarray(columns.offsets)
    sequences = [values[offsets[i] : offsets[i + 1]].astype(np.int64) for i in range(columns.num_samples)]
    return sequences, np.asarray(columns.labels).copy(), metadata


def train_hf_tokenizer(texts, path, model="wordlevel"):
    """Train a tiny Hugging Face tokenizer on ``texts`` in memory and save it to ``path``."""
    hf = pytest.importorskip("tokenizers")
    if model == "bpe":
        tokenizer = hf.Tokenizer(hf.models.BPE(unk_token="[UNK]"))
        trainer = hf.trainers.BpeTrainer(vocab_size=400, special_tokens=["[PAD]", "[UNK]"])
    else:
        tokenizer = hf.Tokenizer(hf.models.WordLevel(unk_token="[UNK]"))
        trainer = hf.trainers.WordLevelTrainer(min_frequency=2, special_tokens=["[PAD]", "[UNK]"])
    tokenizer.normalizer = hf.normalizers.Lowercase()
    tokenizer.pre_tokenizer = hf.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(os.fspath(path))
    return path


EOD = "<|endoftext|>"


def word_corpus(root):
    """Convert 240 documents of 1 to 400 words (no labels), tokenized by a tokenizer trained here with ``EOD``, into
    ``root/docs.h5`` and the shard folder ``root/docs`` (shards of 4,000 ids); return the end-of-document id."""
    hf = pytest.importorskip("tokenizers")
    from fastdata import convert_text

    rng = np.random.default_rng(3)
    words = [f"w{number}" for number in range(300)]
    texts = [" ".join(rng.choice(words, int(rng.choice([1, 2, 7, 40, 400])))) for _ in range(240)]
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    tokenizer = hf.Tokenizer(hf.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = hf.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, hf.trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", EOD]))
    tokenizer.save(str(root / "tok.json"))
    convert_text(src, root / "docs.h5", tokenizer=root / "tok.json", label_field=None, progress=False)
    convert_text(src, root / "docs", tokenizer=root / "tok.json", label_field=None, progress=False, shard_size=4000)
    return tokenizer.token_to_id(EOD)


# ---------------------------------------------------------------- worker memory probes

MB = 1024  # in kB, the unit of /proc


def memory_kb():
    """This process's (RssAnon, Private_Dirty) in kB, from /proc."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                values["anon"] = int(line.split()[1])
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                values["private"] = int(line.split()[1])
    return values["anon"], values["private"]


class ProbeMixin:
    """Adds a third batch element ``[pid, RssAnon kB, Private_Dirty kB]`` measured after the read."""

    def read_batch(self, indices, *args, **kwargs):
        batch = super().read_batch(indices, *args, **kwargs)
        return (*batch, torch.tensor([os.getpid(), *memory_kb()], dtype=torch.int64))


def growth_per_worker(batches):
    """``{pid: (RssAnon growth, Private_Dirty growth)}`` in kB, first to last probed batch.

    ``batches`` are tuples whose last element is a ProbeMixin probe.
    """
    readings = {}
    for batch in batches:
        probe = batch[-1]
        readings.setdefault(int(probe[0]), []).append((int(probe[1]), int(probe[2])))
    return {pid: (v[-1][0] - v[0][0], v[-1][1] - v[0][1]) for pid, v in readings.items()}


# ---------------------------------------------------------------- damaged files


def column_regions(path):
    """Return ``{column name: (file offset, nbytes)}`` of the stored columns of a packed file.

    Found from where the format layer maps each array (``/proc/self/maps``),
    so it holds for any container.
    """
    from fastdata.formats import read_packed
    from fastdata.formats.layout import stored_columns

    columns, _ = read_packed(path, check=False)
    real = os.path.realpath(path)
    regions = {}
    for name, array in stored_columns(columns).items():
        mapped, offset = mapped_at(array.__array_interface__["data"][0])
        if mapped == real:
            regions[name] = (offset, array.nbytes)
    return regions


def mapped_at(address):
    """Return ``(file, offset)``: the file mapped at ``address`` in this process and its byte there; else Nones."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < stop and len(fields) == 6:
                return fields[5].strip(), address - start + int(fields[2], 16)
    return None, None


def raises_in_workers(loader, error, match):
    """Iterate a torch DataLoader with workers until it raises ``error`` matching ``match``; then end its workers.

    The iterator is held in a reference cycle of the reraised error; left to the garbage collector, its queues
    may go first, and its workers then wait out 5 s each (MP_STATUS_CHECK_INTERVAL) in whichever later test
    the collector runs (two tests stalled 10 s in the edit loop).
    """
    batches = iter(loader)
    try:
        with pytest.raises(error, match=match):
            list(batches)
    finally:
        batches._shutdown_workers()


def private_copy(path, tmp_path, name="copy"):
    """Copy a session file into ``tmp_path`` (same extension) for a test that damages or replaces it."""
    import shutil

    copy = tmp_path / f"{name}{os.path.splitext(path)[1]}"
    shutil.copyfile(path, copy)
    return copy


def overwrite(path, offset, data):
    """Write ``data`` into the file at ``offset`` in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def truncate_elsewhere(path, size):
    """Truncate the file to ``size`` bytes from another process, as another program would.

    In a process that reads it, truncate(2) of a leased file is interrupted (NOTE [read leases]).
    """
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", "import os, sys; os.truncate(sys.argv[1], int(sys.argv[2]))",
                    os.fspath(path), str(size)], check=True, timeout=60)


def rewrite_index(root, change):
    """Rewrite ``root/index.json`` as ``change(index)`` leaves the parsed JSON object (in place)."""
    import json

    path = os.path.join(root, "index.json")
    with open(path) as f:
        index = json.load(f)
    change(index)
    with open(path, "w") as f:
        json.dump(index, f)


def downgrade_to_version1(path):
    """Rewrite a packed file as format version 1 wrote it: no checksums, ``format_version`` 1."""
    def version1(metadata):
        del metadata["checksums"]
        metadata["format_version"] = 1

    return rewrite_metadata(path, version1, drop_checksums=True)


def rewrite_metadata(path, change, drop_checksums=False):
    """Rewrite the stored metadata of the packed file at ``path`` as ``change(metadata)`` leaves it (in place).

    ``drop_checksums``: remove HDF5's checksum group too (Arrow's are in the metadata).
    """
    import json

    import h5py
    import pyarrow as pa

    from fastdata.formats.layout import METADATA_KEY

    path = os.fspath(path)
    if path.endswith(".h5"):
        with h5py.File(path, "r+") as f:
            metadata = json.loads(f.attrs[METADATA_KEY])
            change(metadata)
            if drop_checksums:
                del f["checksums"]
            f.attrs[METADATA_KEY] = json.dumps(metadata)
        return path
    with pa.memory_map(path, "r") as source:
        table = pa.ipc.open_file(source).read_all()
    metadata = json.loads(table.schema.metadata[METADATA_KEY.encode()])
    change(metadata)
    kept = {} if drop_checksums else dict(table.schema.metadata)
    table = table.replace_schema_metadata({**kept, METADATA_KEY.encode(): json.dumps(metadata).encode()})
    with pa.OSFile(path + ".tmp", "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(path + ".tmp", path)
    return path


def run_cli(*args):
    """Run ``fastdata ARGS`` in this process through click's CliRunner; exceptions other than exit propagate."""
    from click.testing import CliRunner

    from fastdata.cli import main

    return CliRunner().invoke(main, [str(arg) for arg in args], catch_exceptions=False)


def one_error_line(result):
    """Return the one ``Error: ...`` line a failed command printed; fail if it printed more or a traceback."""
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def start_methods(*methods):
    """``methods`` as pytest params: fork in the edit loop; spawn and forkserver (seconds each) marked slow."""
    available = multiprocessing.get_all_start_methods()
    return [method if method == "fork" else pytest.param(method, marks=pytest.mark.slow)
            for method in methods if method in available]


def free_port():
    """Return a TCP port on 127.0.0.1 that nothing listens on (now)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, what, seconds=120):
    """Poll ``condition()`` until it is true and return its value; fail after ``seconds``."""
    import time

    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)
    return value


def sigterm_after(delay):
    """Return a fork hook (the fork_hook fixture) sending SIGTERM to the new process ``delay`` s after its fork.

    The process signals itself (0: at once, before the code that forked it
    goes on), so any moment of its start is hit: before, during or after its
    initializer, however late the OS first runs it. A DataLoader worker
    killed by a SIGTERM that is not its parent's dies by the signal, which
    torch reports at once (its parent's makes it exit 0, noticed 5 s later).
    """
    import signal
    import threading

    def hook():
        if delay == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

    return hook


def returning_sigterm_handler():
    """Give this process a SIGTERM handler that returns, as a test runner's or a training script's may.

    Forked children inherit it (NOTE [forked SIGTERM] in fastdata/_processes.py); the autouse
    restore_sigterm fixture puts the previous handler back.
    """
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: None)


def still_running(pids, seconds):
    """Return those of ``pids`` still running after waiting up to ``seconds`` for them to end.

    A zombie (ended, not yet reaped by its parent) counts as ended; nothing
    is reaped here, so multiprocessing still sees each exit code.
    """
    import time

    import psutil

    def running(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + seconds
    while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.005)
    return left


def descendants():
    """Return the pids of this process's running descendants.

    Zombies are left out, and so are multiprocessing's own helpers (its
    resource tracker and forkserver), which live as long as this process.
    """
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            helper = child.ppid() == os.getpid() and any(
                name in " ".join(child.cmdline()) for name in ("resource_tracker", "forkserver"))
            if not helper and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def assert_same_batches(a, b):
    """Assert that dict batches ``a`` and ``b`` hold the same keys, tensors (exactly) and lists."""
    assert set(a) == set(b)
    for name in a:
        if isinstance(a[name], torch.Tensor):
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
        else:
            assert a[name] == b[name]
