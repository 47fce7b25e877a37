"""convert_imagefolder / find_images: same pixels and labels come back, bad inputs, atomic output."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from PIL import Image
from support import (
    FORMATS,
    NUM_CLASSES,
    PER_CLASS,
    STORED_SIZE,
    expected_images,
    folder_listing,
    stored_images,
    write_png_header,
    write_random_png,
)

import fastdata.converters.imagefolder as imagefolder
from fastdata import ConversionReport, FastdataError, SampleError, SourceError, convert_imagefolder
from fastdata.codecs.images import ImageSpec
from fastdata.converters import find_images
from fastdata.formats import read_packed
from fastdata.formats.shards import is_shard_folder

SPEC = ImageSpec(STORED_SIZE, STORED_SIZE)
NUM_SAMPLES = NUM_CLASSES * PER_CLASS


def convert(root, out, **kwargs):
    kwargs.setdefault("size", STORED_SIZE)
    kwargs.setdefault("workers", 1)
    kwargs.setdefault("progress", False)
    return convert_imagefolder(root, out, **kwargs)


# ---------------------------------------------------------------- round trip


def test_round_trip_gives_back_load_image_pixels_and_labels(source_root, packed, storage):
    classes, relpaths, labels = find_images(source_root)
    images, stored_labels, metadata = stored_images(packed)
    assert images.shape == (NUM_SAMPLES, STORED_SIZE, STORED_SIZE, 3)
    assert np.array_equal(images, expected_images(source_root, relpaths, SPEC, storage))
    assert stored_labels.dtype == np.int64
    assert stored_labels.tolist() == labels.tolist() == [c for c in range(NUM_CLASSES) for _ in range(PER_CLASS)]
    assert metadata["classes"] == classes == [f"class_{c}" for c in range(NUM_CLASSES)]
    assert metadata["class_counts"] == [PER_CLASS] * NUM_CLASSES
    assert metadata["num_samples"] == NUM_SAMPLES
    assert metadata["storage"] == storage
    assert metadata["sample_shape"] == [3, STORED_SIZE, STORED_SIZE]
    assert metadata["skipped"] == []


def test_source_fixture_varies_formats_modes_and_sizes(source_root):
    _, relpaths, _ = find_images(source_root)
    kinds, sizes = set(), set()
    for relpath in relpaths:
        with Image.open(source_root / relpath) as img:
            kinds.add((img.format, img.mode))
            sizes.add(img.size)
    assert {"JPEG", "PNG", "BMP", "TIFF", "GIF", "WEBP"} <= {fmt for fmt, _ in kinds}
    assert {"RGB", "L", "P", "RGBA", "CMYK", "I;16"} <= {mode for _, mode in kinds}
    assert len(sizes) == NUM_SAMPLES
    assert min(w / h for w, h in sizes) < 0.5 and max(w / h for w, h in sizes) > 2


def test_jpeg_storage_holds_the_reencoded_bytes(source_root, packed_files):
    from fastdata.codecs.images import encode_jpeg, load_image

    _, relpaths, _ = find_images(source_root)
    columns, metadata = read_packed(packed_files("arrow", "jpeg"))
    assert metadata["preprocessing"]["quality"] == 90
    for index in (0, 7, NUM_SAMPLES - 1):
        stored = columns.samples[columns.offsets[index] : columns.offsets[index + 1]].tobytes()
        assert stored == encode_jpeg(load_image(source_root / relpaths[index], SPEC), 90)


def test_report_describes_the_conversion(source_root, tmp_path):
    out = tmp_path / "photos.h5"
    report = convert(source_root, out)
    assert isinstance(report, ConversionReport)
    assert report.path == os.fspath(out)
    assert report.num_samples == NUM_SAMPLES
    assert report.skipped == []
    assert report.seconds > 0
    assert f"{NUM_SAMPLES} samples" in str(report)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(
    "kwargs",
    [
        {"size": (24, 40), "resize": "pad"},
        {"size": (40, 24), "resize": "stretch", "resample": "nearest"},
        {"size": 16, "resize": "crop", "resample": "lanczos", "storage": "jpeg", "quality": 50},
    ],
    ids=["pad-24x40", "stretch-40x24-nearest", "crop-16-lanczos-jpeg50"],
)
def test_preprocessing_options_round_trip(source_root, tmp_path, fmt, kwargs):
    out = tmp_path / f"out{FORMATS[fmt]}"
    convert(source_root, out, **kwargs)
    size = kwargs["size"]
    height, width = (size, size) if isinstance(size, int) else size
    spec = ImageSpec(height, width, resize=kwargs["resize"], resample=kwargs.get("resample", "bilinear"))
    _, relpaths, _ = find_images(source_root)
    images, _, metadata = stored_images(out)
    storage = kwargs.get("storage", "raw")
    assert np.array_equal(images, expected_images(source_root, relpaths, spec, storage, kwargs.get("quality", 90)))
    assert metadata["sample_shape"] == [3, height, width]
    assert metadata["preprocessing"]["resize"] == kwargs["resize"]
    assert metadata["preprocessing"]["height"] == height and metadata["preprocessing"]["width"] == width


def test_mean_and_std_match_numpy_on_stored_pixels(packed):
    images, _, metadata = stored_images(packed)
    scaled = images.reshape(-1, 3).astype(np.float64) / 255
    assert np.allclose(metadata["mean"], scaled.mean(axis=0), rtol=0, atol=2e-6)
    assert np.allclose(metadata["std"], scaled.std(axis=0), rtol=0, atol=2e-6)


def test_mean_and_std_ignore_skipped_images(source_copy, tmp_path):
    (source_copy / "class_0" / "broken.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "out.arrow"
    convert(source_copy, out)
    images, _, metadata = stored_images(out)
    scaled = images.reshape(-1, 3).astype(np.float64) / 255
    assert np.allclose(metadata["mean"], scaled.mean(axis=0), atol=2e-6)
    assert np.allclose(metadata["std"], scaled.std(axis=0), atol=2e-6)


# ---------------------------------------------------------------- finding images


@pytest.fixture
def messy_root(tmp_path):
    """Classes created out of order, nested folders, hidden and non-image files."""
    rng = np.random.default_rng(0)
    root = tmp_path / "messy"
    files = [
        "b_dogs/x.png",
        "b_dogs/deep/er/still_dog.png",
        "a_cats/z.png",
        "a_cats/A.PNG",
        "a_cats/sub/y.bmp",
        "c_birds/only.png",
        # never images of any class:
        "a_cats/.hidden.png",
        "a_cats/.cache/cached.png",
        "b_dogs/sub/.thumbs/t.png",
        ".hidden_class/h.png",
    ]
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_random_png(path, rng)
    (root / "a_cats" / "notes.txt").write_text("not an image")
    (root / "b_dogs" / "labels.csv").write_text("x,1")
    (root / "b_dogs" / "x.png.bak").write_bytes(b"old")
    (root / "readme.png").write_bytes(b"a file at the top is not a class")
    (root / "LICENSE").write_text("MIT")
    return root


MESSY_RELPATHS = [
    "a_cats/A.PNG",
    "a_cats/sub/y.bmp",
    "a_cats/z.png",
    "b_dogs/deep/er/still_dog.png",
    "b_dogs/x.png",
    "c_birds/only.png",
]


def test_find_images_sorts_classes_and_keeps_only_visible_images(messy_root):
    classes, relpaths, labels = find_images(messy_root)
    assert classes == ["a_cats", "b_dogs", "c_birds"]
    assert relpaths == [os.path.join(*p.split("/")) for p in MESSY_RELPATHS]
    assert labels.dtype == np.int64
    assert labels.tolist() == [0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_nested_images_belong_to_their_top_level_class(messy_root, tmp_path, fmt):
    out = tmp_path / f"messy{FORMATS[fmt]}"
    report = convert(messy_root, out, size=8, resize="stretch", resample="nearest")
    assert report.num_samples == 6 and report.skipped == []
    images, labels, metadata = stored_images(out)
    assert metadata["classes"] == ["a_cats", "b_dogs", "c_birds"]
    assert metadata["class_counts"] == [3, 2, 1]
    assert labels.tolist() == [0, 0, 0, 1, 1, 2]
    spec = ImageSpec(8, 8, "stretch", "nearest")
    assert np.array_equal(images, expected_images(messy_root, MESSY_RELPATHS, spec, "raw"))


def _find_images_with_timeout(root, seconds=20):
    result = {}
    thread = threading.Thread(target=lambda: result.update(found=find_images(root)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "find_images did not return: it is looping over a symlink cycle"
    return result["found"]


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_symlink_loop_to_the_parent_folder_does_not_hang(tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "loop"
    (root / "cats" / "sub").mkdir(parents=True)
    (root / "dogs").mkdir()
    for name in ("cats/a.png", "cats/sub/b.png", "dogs/c.png"):
        write_random_png(root / name, rng)
    os.symlink(root / "cats", root / "cats" / "sub" / "up")  # cats/sub/up -> cats
    os.symlink(root / "cats", root / "cats" / "self")  # cats/self -> cats
    classes, relpaths, labels = _find_images_with_timeout(root)
    assert classes == ["cats", "dogs"]
    assert relpaths == [
        os.path.join("cats", "a.png"),
        os.path.join("cats", "sub", "b.png"),
        os.path.join("dogs", "c.png"),
    ]
    assert labels.tolist() == [0, 0, 1]


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_symlink_loop_to_the_root_terminates(tmp_path):
    rng = np.random.default_rng(2)
    root = tmp_path / "loop"
    for name in ("cats/a.png", "dogs/b.png"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        write_random_png(root / name, rng)
    os.symlink(root, root / "cats" / "root")
    os.symlink(root, root / "dogs" / "root")
    classes, relpaths, _ = _find_images_with_timeout(root)
    assert classes == ["cats", "dogs"]
    assert len(relpaths) == len(set(relpaths)) < 10


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symlinks")
def test_symlinked_class_folder_is_followed(tmp_path, source_root):
    root = tmp_path / "linked"
    root.mkdir()
    os.symlink(source_root / "class_2", root / "linked_class")
    classes, relpaths, _ = find_images(root)
    assert classes == ["linked_class"]
    assert len(relpaths) == PER_CLASS


# ---------------------------------------------------------------- nothing left out without a word


# Formats Pillow opens that a fixed list of extensions once left out.
OTHER_FORMATS = {"a.tga": "RGB", "b.ico": "RGBA", "c.pbm": "1", "d.jfif": "RGB", "e.dib": "RGB", "f.pcx": "RGB"}


def test_every_extension_pillow_opens_is_converted(tmp_path):
    rng = np.random.default_rng(4)
    root = tmp_path / "formats"
    (root / "other").mkdir(parents=True)
    for name, mode in OTHER_FORMATS.items():
        pixels = rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
        Image.fromarray(pixels, "RGB").convert(mode).save(root / "other" / name)
    (root / "other" / "g.PBM").write_bytes((root / "other" / "c.pbm").read_bytes())
    _, relpaths, _ = find_images(root)
    assert sorted(os.path.basename(p) for p in relpaths) == sorted([*OTHER_FORMATS, "g.PBM"])
    out = tmp_path / "out.h5"
    report = convert(root, out, size=16)
    assert report.num_samples == len(OTHER_FORMATS) + 1 and report.skipped == []
    images, _, _ = stored_images(out)
    assert np.array_equal(images, expected_images(root, relpaths, ImageSpec(16, 16), "raw"))


def coco_set(root, count=6):
    """Write a COCO-style detection set: ``root/images/*.jpg`` and ``root/annotations.json`` (boxes, categories)."""
    rng = np.random.default_rng(5)
    (root / "images").mkdir(parents=True)
    images, annotations = [], []
    for index in range(count):
        height, width = int(rng.integers(20, 60)), int(rng.integers(20, 60))
        name = f"{index:012d}.jpg"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(root / "images" / name)
        images.append({"id": index, "file_name": name, "height": height, "width": width})
        annotations += [{"id": 10 * index + box, "image_id": index, "category_id": 1 + box % 2,
                         "bbox": [1.0, 2.0, width / 2, height / 3], "area": width * height / 6, "iscrowd": 0}
                        for box in range(index % 3)]
    coco = {"info": {"description": "a test set"}, "licenses": [], "images": images, "annotations": annotations,
            "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}]}
    (root / "annotations.json").write_text(json.dumps(coco))
    return root


def test_a_detection_set_is_refused_not_converted_as_one_class(tmp_path):
    # see NOTE [annotations beside the images] in imagefolder.py: it converted as one class "images", exit 0
    root = coco_set(tmp_path / "coco")
    with pytest.raises(SourceError, match="annotations.json.*COCO-style annotations.*move the annotations out"):
        convert(root, tmp_path / "out.h5", size=16)
    assert not (tmp_path / "out.h5").exists()
    with pytest.raises(SourceError, match="COCO-style annotations"):
        find_images(root)
    (root / "annotations.json").rename(tmp_path / "annotations.json")  # moved out: the images alone convert
    report = convert(root, tmp_path / "out.h5", size=16)
    assert report.num_samples == 6 and stored_images(tmp_path / "out.h5")[2]["classes"] == ["images"]


def test_other_json_beside_the_class_folders_is_counted_as_left_out(source_root, tmp_path):
    root = tmp_path / "with_json"
    root.mkdir()
    for name in os.listdir(source_root):
        os.symlink(source_root / name, root / name)
    (root / "classes.json").write_text(json.dumps({"classes": sorted(os.listdir(source_root)), "images": 3}))
    report = convert(root, tmp_path / "out.h5", size=8)
    assert report.ignored == {"outside class folders": 1} and report.skipped == []


MESSY_IGNORED = {
    ".bak": 1,
    ".csv": 1,
    ".txt": 1,
    "hidden": 4,  # a_cats/.hidden.png, a_cats/.cache/, b_dogs/sub/.thumbs/, .hidden_class/
    "outside class folders": 2,  # readme.png, LICENSE
}


def test_files_left_out_are_counted_by_kind(messy_root, tmp_path):
    out = tmp_path / "messy.arrow"
    report = convert(messy_root, out, size=8)
    assert report.ignored == MESSY_IGNORED
    assert stored_images(out)[2]["source"]["ignored"] == MESSY_IGNORED
    first_line = str(report).splitlines()[0]
    assert first_line.endswith(
        "0 skipped, 9 ignored (.bak: 1, .csv: 1, .txt: 1, hidden: 4, outside class folders: 2)"
    ), first_line


def test_cli_summary_names_the_files_left_out(messy_root, tmp_path):
    from click.testing import CliRunner

    from fastdata.cli import main

    result = CliRunner().invoke(
        main, ["convert", "imagefolder", os.fspath(messy_root), os.fspath(tmp_path / "m.h5"), "--size", "8", "--quiet"]
    )
    assert result.exit_code == 0, result.output
    assert "9 ignored (.bak: 1, .csv: 1, .txt: 1, hidden: 4, outside class folders: 2)" in result.output


def test_class_folder_without_images_says_what_it_holds(source_copy, tmp_path):
    (source_copy / "class_9").mkdir()
    (source_copy / "class_9" / "notes.txt").write_text("no images here")
    (source_copy / "class_9" / "clip.mp4").write_bytes(b"not an image")
    with pytest.raises(SourceError, match=r"'class_9' .* has no image files \(it holds 1 \.mp4, 1 \.txt\)"):
        convert(source_copy, tmp_path / "out.h5")


def _drop_file_permission_override():
    """Run in the child before exec: a root child loses CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH.

    Root reads any folder whatever its mode; without these two capabilities
    it obeys the mode bits like any user, so a folder of mode 000 is really
    unreadable to it.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


CONVERT_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from fastdata import FastdataError, convert_imagefolder

    root, out, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    probe = options.pop("probe", None)
    if probe is not None:  # is the folder really unreadable to this process?
        try:
            os.listdir(probe)
        except PermissionError:
            pass
        else:
            print(json.dumps({"readable": True}))
            sys.exit(0)
    try:
        report = convert_imagefolder(root, out, size=16, progress=False, **options)
    except FastdataError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    else:
        print(json.dumps({"num_samples": report.num_samples, "skipped": report.skipped, "text": str(report)}))
    """
)


def convert_in_child(root, out, unprivileged=False, probe=None, timeout=120, **options):
    """Convert in a child process (killed with its workers after ``timeout``); return its report as a dict.

    ``unprivileged``: the child obeys file modes even as root (see
    _drop_file_permission_override); ``probe``: a folder that must be
    unreadable to the child, or the test is skipped.
    """
    root_user = unprivileged and os.geteuid() == 0
    options = json.dumps({**options, "probe": None if probe is None else os.fspath(probe)})
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", CONVERT_SCRIPT, os.fspath(root), os.fspath(out), options],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=_drop_file_permission_override if root_user else None,
        )
    except subprocess.SubprocessError as exc:  # prctl refused (root without CAP_SETPCAP)
        pytest.skip(f"cannot drop root's file permission override here: {exc}")
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail(f"the conversion did not finish in {timeout}s ({options})")
    assert child.returncode == 0, stderr
    result = json.loads(stdout)
    if result.get("readable"):
        pytest.skip(f"cannot make {probe} unreadable to the conversion here")
    return result


@pytest.fixture
def locked_root(source_copy):
    """source_copy with class_0/locked (3 more images) made unreadable; the mode is restored at teardown."""
    rng = np.random.default_rng(5)
    locked = source_copy / "class_0" / "locked"
    locked.mkdir()
    for index in range(3):
        write_random_png(locked / f"{index}.png", rng)
    locked.chmod(0)
    yield source_copy
    locked.chmod(0o755)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.integration
def test_unreadable_nested_folder_is_reported_as_skipped(locked_root, tmp_path, workers):
    locked = locked_root / "class_0" / "locked"
    result = convert_in_child(locked_root, tmp_path / "out.h5", unprivileged=True, probe=locked, workers=workers)
    assert result["num_samples"] == NUM_SAMPLES
    assert len(result["skipped"]) == 1
    path, reason = result["skipped"][0]
    assert path == os.path.join("class_0", "locked")
    assert "folder cannot be read" in reason and "Permission denied" in reason
    assert "1 skipped" in result["text"] and "skipped 'class_0/locked': folder cannot be read" in result["text"]


@pytest.mark.integration
def test_unreadable_nested_folder_raises_with_on_error_raise(locked_root, tmp_path):
    locked = locked_root / "class_0" / "locked"
    result = convert_in_child(locked_root, tmp_path / "out.h5", unprivileged=True, probe=locked, on_error="raise")
    assert result["error"] == "SourceError"
    assert "'class_0/locked'" in result["message"] and "Permission denied" in result["message"]
    assert os.listdir(tmp_path) == ["photos"]


@pytest.mark.integration
def test_unreadable_class_folder_raises_naming_it(source_copy, tmp_path):
    folder = source_copy / "class_2"
    folder.chmod(0)
    try:
        result = convert_in_child(source_copy, tmp_path / "out.h5", unprivileged=True, probe=folder)
    finally:
        folder.chmod(0o755)
    assert result["error"] == "SourceError"
    assert "class folder 'class_2'" in result["message"] and "cannot be read (Permission denied)" in result["message"]
    assert os.listdir(tmp_path) == ["photos"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.integration
def test_fifo_named_like_an_image_is_skipped_not_waited_on(source_copy, tmp_path, workers):
    os.mkfifo(source_copy / "class_1" / "pipe.jpg")
    result = convert_in_child(source_copy, tmp_path / "out.arrow", timeout=60, workers=workers)
    assert result["num_samples"] == NUM_SAMPLES
    assert result["skipped"] == [
        [os.path.join("class_1", "pipe.jpg"), "OSError: not a regular file but a FIFO (named pipe); left unopened"]
    ]


def test_sockets_and_devices_named_like_images_are_skipped_with_their_kind(source_copy, tmp_path, monkeypatch):
    import socket

    monkeypatch.chdir(source_copy / "class_1")  # a socket path must be short
    server = socket.socket(socket.AF_UNIX)
    server.bind("socket.png")
    os.symlink(os.devnull, "null.jpg")
    try:
        report = convert(source_copy, tmp_path / "out.h5", workers=2)
    finally:
        server.close()
    assert report.num_samples == NUM_SAMPLES
    assert report.skipped == [
        (os.path.join("class_1", "null.jpg"), "OSError: not a regular file but a character device; left unopened"),
        (os.path.join("class_1", "socket.png"), "OSError: not a regular file but a socket; left unopened"),
    ]


# ---------------------------------------------------------------- any size


@pytest.fixture(scope="module")
def random_sizes_root(tmp_path_factory):
    """240 smooth images in 3 classes: 1 to 1200 px on a side, aspect ratios 1:20 to 20:1, JPEG and PNG.

    One in three has a side of exactly 32, 64 or 224 px, the stored sizes the
    test converts to (the case a float crop box once got wrong).
    """
    rng = np.random.default_rng(7)
    root = tmp_path_factory.mktemp("sizes") / "random"
    for index in range(240):
        long_side = int(rng.integers(1, 1201))
        short_side = max(1, round(long_side / rng.uniform(1, 20)))
        size = [long_side, short_side][:: 1 if rng.random() < 0.5 else -1]
        if index % 3 == 0:
            size[int(rng.integers(0, 2))] = int(rng.choice([32, 64, 224]))
        folder = root / f"class_{index % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        field = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
        img = Image.fromarray(field, "RGB").resize(tuple(size), Image.Resampling.BILINEAR)
        img.save(folder / f"{index:03d}{'.jpg' if index % 4 else '.png'}")
    return root


@pytest.mark.parametrize("size", [32, 64, 224])
def test_images_of_any_size_convert_with_none_skipped(random_sizes_root, tmp_path, size):
    report = convert(random_sizes_root, tmp_path / "out.h5", size=size)
    assert report.skipped == [] and report.num_samples == 240


# ---------------------------------------------------------------- determinism


@pytest.mark.slow
def test_output_is_byte_identical_for_any_number_of_workers(tmp_path):
    # 300 inputs, so that worker processes get chunks of several images each.
    root = tmp_path / "many"
    rng = np.random.default_rng(3)
    for label in range(3):
        (root / f"class_{label}").mkdir(parents=True)
        for index in range(100):
            write_random_png(root / f"class_{label}" / f"{index:03d}.png", rng, size=(20, 14))
    (root / "class_1" / "050_broken.png").write_bytes(b"\x89PNG not really")
    outputs = {}
    for workers in (1, 2):
        for fmt, ext in FORMATS.items():
            for storage in ("raw", "jpeg"):
                out = tmp_path / f"w{workers}-{storage}{ext}"
                report = convert(root, out, size=16, workers=workers, storage=storage)
                assert report.num_samples == 300 and len(report.skipped) == 1
                outputs[workers, fmt, storage] = out.read_bytes()
        if workers == 1:
            time.sleep(1.1)  # a stored timestamp would differ
    for fmt in FORMATS:
        for storage in ("raw", "jpeg"):
            assert outputs[1, fmt, storage] == outputs[2, fmt, storage], (fmt, storage)
    _, relpaths, _ = find_images(root)
    relpaths.remove(os.path.join("class_1", "050_broken.png"))
    images, _, _ = stored_images(tmp_path / "w2-raw.h5")
    assert np.array_equal(images, expected_images(root, relpaths, ImageSpec(16, 16), "raw"))


# ---------------------------------------------------------------- bad inputs


@pytest.fixture
def bad_root(source_copy):
    """source_copy plus five unusable files in class_1 (sorted names first: the bombs)."""
    folder = source_copy / "class_1"
    good = (folder / "img_00000.jpg").read_bytes()
    (folder / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (folder / "random.jpg").write_bytes(np.random.default_rng(0).bytes(3000))
    (folder / "text.png").write_text("this is not a PNG\n" * 20)
    write_png_header(folder / "bomb.png", 20000, 20000)  # 4e8 pixels: DecompressionBombError
    write_png_header(folder / "bomb_warn.png", 10000, 10000)  # 1e8 pixels: only a warning in Pillow
    return source_copy


BAD_REASONS = {
    "bomb.png": "DecompressionBomb",
    "bomb_warn.png": "DecompressionBomb",
    "random.jpg": "cannot identify image file",
    "text.png": "cannot identify image file",
    "truncated.jpg": "truncated",
}


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bad_images_are_skipped_with_a_reason(bad_root, tmp_path, workers, fmt):
    out = tmp_path / f"out{FORMATS[fmt]}"
    report = convert(bad_root, out, workers=workers, on_error="skip")
    expected_paths = [os.path.join("class_1", name) for name in sorted(BAD_REASONS)]
    assert [path for path, _ in report.skipped] == expected_paths
    for (path, reason), name in zip(report.skipped, sorted(BAD_REASONS)):
        assert BAD_REASONS[name] in reason, (path, reason)
    assert report.num_samples == NUM_SAMPLES
    images, labels, metadata = stored_images(out)
    assert metadata["skipped"] == [{"path": path, "reason": reason} for path, reason in report.skipped]
    assert metadata["class_counts"] == [PER_CLASS] * NUM_CLASSES
    assert metadata["source"]["num_inputs"] == NUM_SAMPLES + len(BAD_REASONS)
    # The good images are all there, in order, with their labels.
    _, relpaths, all_labels = find_images(bad_root)
    kept = [i for i, p in enumerate(relpaths) if os.path.basename(p) not in BAD_REASONS]
    assert labels.tolist() == all_labels[kept].tolist()
    assert np.array_equal(images, expected_images(bad_root, [relpaths[i] for i in kept], SPEC, "raw"))


def test_bad_images_warn_with_on_error_warn(bad_root, tmp_path):
    with pytest.warns(UserWarning) as record:
        report = convert(bad_root, tmp_path / "out.h5", on_error="warn")
    messages = [str(w.message) for w in record]
    assert len(messages) == len(BAD_REASONS)
    for name in BAD_REASONS:
        assert any(name in message for message in messages), name
    assert len(report.skipped) == len(BAD_REASONS)


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_image_raises_with_on_error_raise_and_leaves_nothing(bad_root, tmp_path, workers):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("already here")
    with pytest.raises(SampleError, match="bomb.png") as info:
        convert(bad_root, out_dir / "out.h5", workers=workers, on_error="raise")
    assert info.value.path == os.path.join("class_1", "bomb.png")
    assert info.value.index == PER_CLASS  # first input of class_1
    assert "on_error" in str(info.value)
    assert folder_listing(out_dir) == ["keep.txt"]


def test_truncated_jpeg_alone_raises_naming_it(source_copy, tmp_path):
    good = (source_copy / "class_3" / "img_00002.jpg").read_bytes()
    (source_copy / "class_3" / "img_00002.jpg").write_bytes(good[: len(good) // 2])
    with pytest.raises(SampleError, match="img_00002.jpg") as info:
        convert(source_copy, tmp_path / "out.arrow", on_error="raise")
    assert info.value.path == os.path.join("class_3", "img_00002.jpg")
    assert info.value.index == 3 * PER_CLASS + 2
    assert os.listdir(tmp_path) == ["photos"]


# ---------------------------------------------------------------- unusable sources


def test_missing_source_folder(tmp_path):
    with pytest.raises(SourceError, match="is not a folder"):
        convert(tmp_path / "nowhere", tmp_path / "out.h5")
    assert os.listdir(tmp_path) == []


def test_empty_source_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no class folders"):
        convert(tmp_path / "empty", tmp_path / "out.h5")
    assert os.listdir(tmp_path) == ["empty"]


def test_source_folder_without_class_folders(tmp_path):
    root = tmp_path / "flat"
    root.mkdir()
    write_random_png(root / "a.png", np.random.default_rng(0))
    (root / ".git").mkdir()
    with pytest.raises(SourceError, match="no class folders"):
        convert(root, tmp_path / "out.h5")
    assert sorted(os.listdir(tmp_path)) == ["flat"]


def test_class_folder_without_images(source_copy, tmp_path):
    (source_copy / "class_9").mkdir()
    (source_copy / "class_9" / "notes.txt").write_text("no images here")
    with pytest.raises(SourceError, match="class_9"):
        convert(source_copy, tmp_path / "out.h5")
    assert os.listdir(tmp_path) == ["photos"]


@pytest.mark.parametrize("workers", [1, 2])
def test_class_with_only_corrupt_images(source_copy, tmp_path, workers):
    (source_copy / "class_9").mkdir()
    (source_copy / "class_9" / "a.jpg").write_bytes(b"garbage")
    (source_copy / "class_9" / "b.png").write_text("garbage")
    with pytest.raises(SourceError, match="class_9") as info:
        convert(source_copy, tmp_path / "out.arrow", workers=workers)
    assert "no usable image" in str(info.value)
    assert os.listdir(tmp_path) == ["photos"]


# ---------------------------------------------------------------- output path


def test_existing_output_is_not_overwritten(source_root, tmp_path):
    out = tmp_path / "out.h5"
    out.write_bytes(b"precious")
    before = os.stat(out)
    with pytest.raises(FileExistsError, match="overwrite"):
        convert(source_root, out)
    assert out.read_bytes() == b"precious"
    assert os.stat(out).st_mtime_ns == before.st_mtime_ns
    assert os.listdir(tmp_path) == ["out.h5"]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_existing_output_is_replaced_with_overwrite(source_root, tmp_path, fmt):
    out = tmp_path / f"out{FORMATS[fmt]}"
    out.write_bytes(b"old")
    report = convert(source_root, out, overwrite=True)
    assert report.num_samples == NUM_SAMPLES
    _, labels, _ = stored_images(out)
    assert len(labels) == NUM_SAMPLES
    assert os.listdir(tmp_path) == [out.name]


@pytest.mark.parametrize("name", ["out.npz", "out", "out.h5.tmp", "out.parquet"])
def test_output_without_a_packed_extension_is_a_shard_folder(source_root, tmp_path, name):
    convert(source_root, tmp_path / name)
    assert is_shard_folder(tmp_path / name)
    assert os.listdir(tmp_path) == [name]


def test_uppercase_and_hdf5_extensions_are_accepted(source_root, tmp_path):
    convert(source_root, tmp_path / "a.hdf5")
    convert(source_root, tmp_path / "b.ARROW")
    assert stored_images(tmp_path / "a.hdf5")[2]["num_samples"] == NUM_SAMPLES
    assert stored_images(tmp_path / "b.ARROW")[2]["num_samples"] == NUM_SAMPLES


def test_relative_output_path(source_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = convert(source_root, "out.arrow")
    assert report.path == "out.arrow"
    assert os.listdir(tmp_path) == ["out.arrow"]


def test_missing_output_folder(source_root, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert(source_root, tmp_path / "nowhere" / "out.h5")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"storage": "png"}, "storage should be one of"),
        ({"on_error": "ignore"}, "on_error should be one of"),
        ({"quality": 0}, "quality should be in 1..100"),
        ({"quality": 101}, "quality should be in 1..100"),
        ({"resize": "fit"}, "resize should be one of"),
        ({"size": 0}, "size should be positive"),
        ({"workers": 0}, "workers should be a positive integer"),
    ],
)
def test_bad_options_raise_value_error_and_leave_nothing(source_root, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        convert(source_root, tmp_path / "out.h5", **kwargs)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- atomic output


def _raise(exc):
    def fail(*args, **kwargs):
        raise exc

    return fail


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_interrupted_write_leaves_nothing(source_root, tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(imagefolder, "write_packed", _raise(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        convert(source_root, tmp_path / f"out{FORMATS[fmt]}")
    assert os.listdir(tmp_path) == []


def test_interrupted_write_keeps_the_old_output_with_overwrite(source_root, tmp_path, monkeypatch):
    out = tmp_path / "out.h5"
    out.write_bytes(b"previous")
    monkeypatch.setattr(imagefolder, "write_packed", _raise(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        convert(source_root, out, overwrite=True)
    assert os.listdir(tmp_path) == ["out.h5"]
    assert out.read_bytes() == b"previous"


def test_interruption_while_workers_run_leaves_nothing(source_root, tmp_path, monkeypatch):
    appended = []

    def append_then_interrupt(self, index, payload):
        appended.append(index)
        if len(appended) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(imagefolder._RawSink, "append", append_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(source_root, tmp_path / "out.arrow", workers=2)
    assert os.listdir(tmp_path) == []


def test_full_disk_is_reported_and_leaves_nothing(source_root, tmp_path, monkeypatch):
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(imagefolder, "write_packed", _raise(full))
    with pytest.raises(FastdataError, match="space") as info:
        convert(source_root, tmp_path / "out.h5")
    assert info.value.__cause__ is full
    assert os.listdir(tmp_path) == []


def test_other_os_errors_propagate_and_leave_nothing(source_root, tmp_path, monkeypatch):
    monkeypatch.setattr(imagefolder, "write_packed", _raise(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError) as info:
        convert(source_root, tmp_path / "out.h5")
    assert info.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []


KILLER_SCRIPT = textwrap.dedent(
    """
    import os
    import signal
    import sys

    from fastdata.converters import imagefolder

    _real_prepare = imagefolder._prepare_image


    def _prepare_or_die(task, **kwargs):
        # Runs in the worker processes (forked, or this module is their __main__).
        if task[1].endswith(os.path.join("class_2", "img_00003.jpg")):
            os.kill(os.getpid(), signal.SIGKILL)
        return _real_prepare(task, **kwargs)


    imagefolder._prepare_image = _prepare_or_die

    if __name__ == "__main__":
        from fastdata import FastdataError, convert_imagefolder

        try:
            convert_imagefolder(sys.argv[1], sys.argv[2], size=16, workers=2, progress=False)
        except FastdataError as exc:
            print("FastdataError:", exc)
            sys.exit(3)
        print("finished without an error")
    """
)


@pytest.mark.integration
def test_killed_worker_raises_and_leaves_nothing(source_root, tmp_path):
    script = tmp_path / "kill_one_worker.py"
    script.write_text(KILLER_SCRIPT)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    done = subprocess.run(
        [sys.executable, os.fspath(script), os.fspath(source_root), os.fspath(out_dir / "out.h5")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "FastdataError:" in done.stdout and "worker process died" in done.stdout
    assert folder_listing(out_dir) == []



def test_conversion_leaves_no_thread_running(source_root, tmp_path):
    # A lingering thread (tqdm's monitor) would stop the next conversion from
    # forking its workers (see NOTE [worker start]).
    before = threading.active_count()
    for index in range(2):
        convert_imagefolder(source_root, tmp_path / f"out{index}.h5", size=16, workers=2, progress=True)
    assert threading.active_count() == before


# ---------------------------------------------------------------- quiet C libraries


@pytest.fixture
def odd_tiffs_root(source_copy):
    """source_copy plus two damaged TIFFs in class_2: a Group 4 one that decodes, an LZW one that does not."""
    rng = np.random.default_rng(6)
    folder = source_copy / "class_2"
    Image.fromarray(rng.integers(0, 2, (64, 64), dtype=np.uint8) * 255).convert("1").save(
        folder / "fax.tif", compression="group4"
    )
    data = bytearray((folder / "fax.tif").read_bytes())
    data[8:300] = bytes(b ^ 0x5A for b in data[8:300])  # bad code words in the strip
    (folder / "fax.tif").write_bytes(data)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(folder / "lzw.tif", compression="tiff_lzw")
    data = bytearray((folder / "lzw.tif").read_bytes())
    data[100:3000] = rng.integers(0, 256, 2900, dtype=np.uint8).tobytes()  # codes not yet in the table
    (folder / "lzw.tif").write_bytes(data)
    return source_copy


@pytest.mark.parametrize("workers", [1, 2])
def test_libtiff_messages_stay_off_the_terminal(odd_tiffs_root, tmp_path, capfd, workers):
    capfd.readouterr()
    report = convert(odd_tiffs_root, tmp_path / "out.h5", workers=workers)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert report.num_samples == NUM_SAMPLES + 1  # fax.tif decodes, with warnings
    [(path, reason)] = report.skipped
    assert path == os.path.join("class_2", "lzw.tif")
    assert reason.startswith("OSError: decoder error") and "(C library: " in reason, reason


def test_stderr_works_again_after_a_quiet_decode(odd_tiffs_root, tmp_path, capfd):
    convert(odd_tiffs_root, tmp_path / "out.h5")
    capfd.readouterr()
    os.write(2, b"still here\n")
    assert capfd.readouterr().err == "still here\n"
