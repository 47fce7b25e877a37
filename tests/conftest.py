"""Shared fixtures: tiny synthetic image folders and the packed files made from them.

Session-scoped files are read by many tests and never modified; a test that
needs to change a file copies it into its own ``tmp_path`` first.
"""

import os
import shutil
import signal
import subprocess

import pytest
from support import (
    FORMATS,
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


@pytest.fixture(autouse=True)
def restore_sigterm():
    # The CLI's main(), run in-process by CliRunner, installs a SIGTERM
    # handler for its own process; keep pytest's.
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


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
