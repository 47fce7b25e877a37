"""Shared fixtures: tiny synthetic image folders and the packed files made from them.

Session-scoped files are read by many tests and never modified; a test that
needs to change a file copies it into its own ``tmp_path`` first.
"""

import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import settings
from support import (
    FORMATS,
    KINDS,
    NUM_CLASSES,
    PER_CLASS,
    SOURCE_SIZE,
    STORAGES,
    STORED_SIZE,
    TEXT_NUM_UNSUP,
    TEXT_PER_CLASS,
)

from fastdata import convert_imagefolder, convert_text
from fastdata.measure.synthetic import make_imagefolder, make_text_corpus

# No wall-clock deadline on property tests: these machines are shared and noisy (a 1,157-sample block order
# took 250 ms against hypothesis's default 200 in a CI run), and speed belongs in benchmarks/.
settings.register_profile("fastdata", deadline=None)
settings.load_profile("fastdata")

# A shell without job control starts background commands with SIGINT ignored, and children inherit
# that: run so (``bash .ci/run &``), every "Ctrl-C during conversion" test saw its converter finish.
# A handler here is reset to the default in every child started by the tests.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Fixtures that start a real component, a server on loopback or a tmpfs mounted as a small disk: every test
# that uses one, directly or through another fixture (remote_shards, s3_env, ...), is marked integration, so
# plain pytest, the edit loop, leaves it out.
COMPONENT_FIXTURES = {"s3_server", "http_server", "small_disk"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if COMPONENT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


# The edit loop starts no server, process group or process of the test's own (COMPONENTS): a test not marked
# integration that does fails, naming what it started. Processes that fastdata or benchmarks/ start for
# their own work (a `git rev-parse` of a benchmark record, a benchmark's fresh process) are theirs, not the
# test's, and pass; so do worker pools and forked loaders.
COMPONENTS = {"checked": False}
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
OWN_CODE = tuple(os.path.join(os.path.dirname(TESTS_DIR), name) + os.sep for name in ("fastdata", "benchmarks"))


def _started_by_the_test():
    """Whether the innermost caller outside the standard library is test code (not fastdata, a benchmark, a library)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(TESTS_DIR + os.sep):
            return True
        if name.startswith(OWN_CODE) or "site-packages" in name:
            return False
        frame = frame.f_back
    return False


def _refuse(started):
    raise RuntimeError(f"this test starts {started} but is not marked integration: mark it "
                       "@pytest.mark.integration (plain pytest, the edit loop, leaves such tests to CI)")


def _refuse_components(event, args):
    if not COMPONENTS["checked"]:
        return
    if event == "subprocess.Popen" and _started_by_the_test():
        command = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        _refuse(f"a process ({' '.join(map(str, command))[:120]})")
    elif event == "socket.bind" and isinstance(args[1], tuple):  # a TCP server (not a forkserver's unix socket)
        _refuse(f"a server on {args[1]}")


sys.addaudithook(_refuse_components)


@pytest.fixture(autouse=True)
def components_only_in_integration(request, monkeypatch):
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    if "torch.distributed" in sys.modules:  # a process group: gloo binds in C++, out of the audit hook's sight
        monkeypatch.setattr(sys.modules["torch.distributed"], "init_process_group",
                            lambda *args, **kwargs: _refuse("a process group"))
    COMPONENTS["checked"] = True
    try:
        yield
    finally:
        COMPONENTS["checked"] = False


@pytest.fixture(autouse=True)
def restore_sigterm():
    # The CLI's main(), run in-process by CliRunner, installs a SIGTERM
    # handler for its own process; keep pytest's. A test that leaves signals
    # blocked fails: every later test's children would inherit the mask and
    # outlive SIGTERM (seen once in CI: five signal tests failed far after the
    # test that leaked it). SIGINT's handler is kept too: LitData's optimize,
    # once run in the pytest process, left one that ends the process with
    # os._exit(0), and a later signal test's SIGINT ended a CI run there with
    # exit status 0, 200 tests unrun and no summary.
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    left = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if left != mask:
        pytest.fail(f"the test left signals {sorted(map(str, set(left) - set(mask)))} blocked in pytest's "
                    "main thread (restored)")


@pytest.fixture
def fork_hook(monkeypatch):
    """Run ``hook.in_child()`` first thing in every process os.fork starts during the test; pids in ``hook.pids``.

    Processes multiprocessing forks (pools, executors, DataLoader workers)
    come from os.fork. ``in_child`` is None (nothing runs) until the test
    sets it, e.g. to ``support.sigterm_after(delay)``.
    """
    hook = SimpleNamespace(in_child=None, pids=[])
    fork = os.fork

    def hooked_fork():
        pid = fork()
        if pid == 0 and hook.in_child is not None:
            hook.in_child()
        elif pid:
            hook.pids.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", hooked_fork)
    return hook


@pytest.fixture(scope="session")
def source_root(tmp_path_factory):
    """A clean ImageFolder tree: 4 classes x 6 photo-like images (read-only).

    Sizes 29 to 333 px on a side, aspect ratios 1:4 to 4:1; ``img_0000{0,2,3,5}``
    are JPEGs (RGB, CMYK, L), ``img_0000{1,4}`` PNG (RGBA, 16-bit, P), BMP,
    TIFF (CMYK, L), GIF and WebP: see make_imagefolder(vary=True).
    """
    root = tmp_path_factory.mktemp("source") / "photos"
    make_imagefolder(root, NUM_CLASSES, PER_CLASS, size=SOURCE_SIZE, seed=0, vary=True)
    return root


@pytest.fixture
def source_copy(source_root, tmp_path):
    """A private, writable copy of ``source_root`` for tests that add bad files."""
    root = tmp_path / "photos"
    shutil.copytree(source_root, root)
    return root


@pytest.fixture(scope="session")
def packed_files(source_root, tmp_path_factory):
    """Return ``get(fmt, storage) -> path`` of ``source_root`` converted once per session."""
    folder = tmp_path_factory.mktemp("packed")
    cache = {}

    def get(fmt, storage="raw"):
        if (fmt, storage) not in cache:
            out = folder / f"photos-{storage}{FORMATS[fmt]}"
            convert_imagefolder(source_root, out, size=STORED_SIZE, storage=storage, workers=1, progress=False)
            cache[fmt, storage] = out
        return cache[fmt, storage]

    return get


@pytest.fixture(scope="session")
def small_photos(tmp_path_factory):
    """A 2 x 6 folder of 80x60 JPEGs and its raw .h5 and jpeg .arrow files at 16 px: ``(root, {storage: path})``.

    Read-only, for the measuring tests: copy a file before writing beside it.
    """
    folder = tmp_path_factory.mktemp("small-photos")
    root = make_imagefolder(folder / "photos", 2, 6, size=(80, 60))
    files = {}
    for storage, ext in (("raw", ".h5"), ("jpeg", ".arrow")):
        files[storage] = folder / f"photos-{storage}{ext}"
        convert_imagefolder(root, files[storage], size=16, storage=storage, workers=1, progress=False)
    return root, files


@pytest.fixture(params=list(FORMATS))
def fmt(request):
    return request.param


@pytest.fixture(params=STORAGES)
def storage(request):
    return request.param


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def packed(packed_files, fmt, storage):
    """The session's packed file for every format x storage pair."""
    return packed_files(fmt, storage)


# ---------------------------------------------------------------- text


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory):
    """``root`` of an IMDB-like tree: train/neg, train/pos (12 reviews each), train/unsup (4); read-only."""
    root = tmp_path_factory.mktemp("text") / "reviews"
    make_text_corpus(root, per_class=TEXT_PER_CLASS, num_unsup=TEXT_NUM_UNSUP, seed=0)
    return root


@pytest.fixture(scope="session")
def packed_text(text_corpus, tmp_path_factory):
    """Return ``get(fmt) -> path`` of ``text_corpus/train`` converted once per session (words tokenizer)."""
    folder = tmp_path_factory.mktemp("packed_text")
    cache = {}

    def get(fmt):
        if fmt not in cache:
            out = folder / f"reviews{FORMATS[fmt]}"
            convert_text(text_corpus / "train", out, workers=1, progress=False)
            cache[fmt] = out
        return cache[fmt]

    return get


@pytest.fixture(params=list(FORMATS))
def text_fmt(request):
    return request.param


@pytest.fixture
def small_disk(tmp_path):
    """Return ``mount(size, read_only=False) -> folder``: a tmpfs of ``size`` bytes, unmounted at teardown.

    Mounting needs root; the test is skipped where it is not allowed.
    """
    mounted = []

    def mount(size, read_only=False):
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", os.fspath(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}); needs root")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "--lazy", os.fspath(folder)], check=False)


@pytest.fixture(scope="session")
def textshard_source(tmp_path_factory):
    """A JSON Lines corpus of 40 labeled reviews; inputs 0, 17 and 39 are empty (skipped); read-only."""
    from fastdata.measure.synthetic import make_reviews, write_text_file

    texts, labels = make_reviews(40, seed=3)
    for index in (0, 17, 39):
        texts[index] = " "
    return write_text_file(tmp_path_factory.mktemp("textshard") / "reviews.jsonl", texts, labels)


# ---------------------------------------------------------------- shard folders


SHARD_COUNTS = (1, 5, 1, 7, 3, 1, 6)  # samples per shard, repeated as needed: 1-sample shards between larger ones
_FILE_KEYS = ("checksums", "format", "format_version")  # what the container writes into each file's metadata


def _shard_columns(columns, start, stop):
    """Return the Columns of samples ``start:stop`` of ``columns``, offsets made relative."""
    from fastdata.formats import Columns

    labels = columns.labels[start:stop]
    if not columns.ragged:
        return Columns(columns.samples[start:stop], labels)
    offsets = columns.offsets[start : stop + 1]
    return Columns(columns.samples[offsets[0] : offsets[-1]], labels, offsets - offsets[0])


def _shard_metadata(metadata, columns, number, start, stop):
    """A shard's metadata per the contract: per-sample facts, its own count and lengths, its place."""
    keep = ("kind", "storage", "sample_shape", "sample_dtype", "classes", "preprocessing", "tokenizer")
    shard = {key: metadata[key] for key in keep if key in metadata}
    shard.update(num_samples=stop - start, shard={"number": number, "inputs": [start, stop]})
    if columns.ragged and metadata["kind"] == "text":
        lengths = [int(n) for n in (columns.offsets[1:] - columns.offsets[:-1])]
        shard["lengths"] = {"min": min(lengths), "max": max(lengths), "num_tokens": sum(lengths)}
    return shard


def _split_into_shards(path, root, counts=SHARD_COUNTS, container=None):
    """Cut the packed file at ``path`` into a shard folder ``root`` of ``counts`` samples per shard (cycled).

    Follows the shard contract of fastdata.formats.shards: shard files of
    consecutive samples, then ``index.json`` with the file's metadata.
    """
    import itertools

    from fastdata.formats import format_of, read_packed, write_packed
    from fastdata.formats.shards import file_checksum, shard_name, write_index

    container = container or format_of(path)
    columns, metadata = read_packed(path)
    os.makedirs(root)
    shards, start = [], 0
    for number, count in enumerate(itertools.cycle(counts)):
        if start >= columns.num_samples:
            break
        stop = min(start + count, columns.num_samples)
        part = _shard_columns(columns, start, stop)
        name = shard_name(number, container)
        write_packed(os.path.join(root, name), part, _shard_metadata(metadata, part, number, start, stop))
        size = os.path.getsize(os.path.join(root, name))
        shards.append({"name": name, "num_samples": stop - start, "bytes": size,
                       "crc32": file_checksum(os.path.join(root, name))})
        start = stop
    dataset = {key: value for key, value in metadata.items() if key not in _FILE_KEYS}
    write_index(root, container, dataset, {"split_from": os.path.basename(path), "counts": list(counts)}, shards)
    return root


@pytest.fixture(scope="session")
def shard_split():
    """Return ``split(path, root, counts=SHARD_COUNTS) -> root``: a packed file cut into a shard folder."""
    return _split_into_shards


@pytest.fixture(scope="session")
def shard_single(packed_files, packed_text):
    """Return ``get(fmt, storage) -> path``: the session's packed file of images ("raw", "jpeg") or "text"."""
    return lambda fmt, storage: packed_text(fmt) if storage == "text" else packed_files(fmt, storage)


@pytest.fixture(scope="session")
def shard_folders(shard_single, tmp_path_factory):
    """Return ``get(fmt, storage) -> folder``: ``shard_single(fmt, storage)`` in SHARD_COUNTS shards; read-only."""
    folder = tmp_path_factory.mktemp("shards")
    cache = {}

    def get(fmt, storage="raw"):
        if (fmt, storage) not in cache:
            cache[fmt, storage] = _split_into_shards(shard_single(fmt, storage), folder / f"{storage}-{fmt}")
        return cache[fmt, storage]

    return get


_TEXT_SHARD_BYTES = 3000  # about 5 reviews of text_corpus a shard


@pytest.fixture(scope="session")
def shard_converted(sharded_reference, text_corpus, tmp_path_factory):
    """Return ``get(fmt, storage) -> folder``: the converters' shard folder of ``shard_single(fmt, storage)``'s source.

    Images: ``sharded_reference``; "text": ``text_corpus/train`` as ``packed_text`` converts it, in shards. Read-only.
    """
    folder = tmp_path_factory.mktemp("shard-converted")
    cache = {}

    def get(fmt, storage="raw"):
        if storage != "text":
            return sharded_reference(fmt, storage)
        if fmt not in cache:
            cache[fmt] = folder / f"text-{fmt}"
            convert_text(text_corpus / "train", cache[fmt], format=fmt, shard_size=_TEXT_SHARD_BYTES, workers=1,
                         progress=False)
        return cache[fmt]

    return get


@pytest.fixture
def shard_copy(tmp_path):
    """Return ``copy(folder) -> folder``: a private, writable copy of a shard folder, for tests that damage it."""
    def copy(folder):
        target = tmp_path / f"copy-{os.path.basename(folder)}"
        shutil.copytree(folder, target)
        return target

    return copy


# ---------------------------------------------------------------- sharded image conversions


_SHARDED_BYTES = {"raw": 5 * 3 * STORED_SIZE * STORED_SIZE, "jpeg": 4000}  # about 5 images of source_root a shard


@pytest.fixture(scope="session")
def sharded_options():
    """Return ``options(container="hdf5", storage="raw") -> dict``: convert_imagefolder keywords, ~5 images a shard."""
    def options(container="hdf5", storage="raw"):
        return {"size": STORED_SIZE, "storage": storage, "format": container, "shard_size": _SHARDED_BYTES[storage],
                "progress": False}

    return options


@pytest.fixture(scope="session")
def sharded_cli_options():
    """Return ``options(container="hdf5", storage="raw") -> list``: the same settings as ``fastdata convert`` takes."""
    def options(container="hdf5", storage="raw"):
        return ["--size", str(STORED_SIZE), "--storage", storage, "--format", container,
                "--shard-size", str(_SHARDED_BYTES[storage]), "--quiet"]

    return options


@pytest.fixture(scope="session")
def sharded_reference(source_root, sharded_options, tmp_path_factory):
    """Return ``get(container, storage) -> folder``: ``source_root`` converted to shards on one process; read-only."""
    folder = tmp_path_factory.mktemp("sharded")
    cache = {}

    def get(container="hdf5", storage="raw"):
        if (container, storage) not in cache:
            out = folder / f"{storage}-{container}"
            convert_imagefolder(source_root, out, workers=1, **sharded_options(container, storage))
            cache[container, storage] = out
        return cache[container, storage]

    return get


# ---------------------------------------------------------------- one sample per class


@pytest.fixture(scope="session")
def labeled_files(tmp_path_factory):
    """Return ``get(num_samples, sharded=False) -> path``: tiny images, one per class, as raw .h5; read-only.

    Every sample has its own label, so a batch's labels say which samples it
    holds. ``sharded``: the same file cut into a shard folder of SHARD_COUNTS.
    """
    folder = tmp_path_factory.mktemp("labeled")
    cache = {}

    def get(num_samples, sharded=False):
        if num_samples not in cache:
            root = make_imagefolder(folder / f"src{num_samples}", num_samples, 1, size=(8, 8))
            cache[num_samples] = folder / f"labeled{num_samples}.h5"
            convert_imagefolder(root, cache[num_samples], size=8, storage="raw", workers=1, progress=False)
        if sharded and (num_samples, "shards") not in cache:
            cache[num_samples, "shards"] = _split_into_shards(cache[num_samples], folder / f"labeled{num_samples}")
        return cache[num_samples, "shards"] if sharded else cache[num_samples]

    return get


# ---------------------------------------------------------------- storage servers


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on a free loopback port (storage.servers.S3Server): ``.endpoint``, ``.env``,
    ``.storage_options``, ``.bucket() -> "s3://<fresh bucket>"``. Skipped without moto or s3fs."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    from storage.servers import S3Server

    server = S3Server()
    yield server
    server.close()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """``s3_server`` with its AWS_* variables set, for code paths (and subprocesses) given no storage_options."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture
def http_server(tmp_path):
    """A plain HTTP server with Range support serving ``tmp_path`` (``.root``, ``.url``, ``.url_of(path)``)."""
    from storage.servers import HTTPServer

    server = HTTPServer(tmp_path)
    yield server
    server.close()


@pytest.fixture(scope="session")
def remote_shards(s3_server, sharded_reference):
    """Return ``get(container="hdf5", storage="raw") -> (local folder, "s3://bucket/train")``: ``sharded_reference``
    (about 5 shards) uploaded once per session to a fresh bucket of ``s3_server``; read-only."""
    from storage.servers import upload

    cache = {}

    def get(container="hdf5", storage="raw"):
        if (container, storage) not in cache:
            local = sharded_reference(container, storage)
            url = upload(local, s3_server.bucket() + "/train", s3_server.storage_options)
            cache[container, storage] = local, url
        return cache[container, storage]

    return get
