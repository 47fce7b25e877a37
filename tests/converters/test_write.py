"""fastdata.write: images from every kind of input, the schema told from records, and records that do not fit."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from support import overwrite, run_cli

from fastdata import Field, OptionError, SampleError, make_loader, open_dataset, write
from fastdata.codecs.images import ImageSpec, decode_jpeg, encode_jpeg, load_image, prepare_pixels
from fastdata.formats import read_records
from fastdata.info import describe
from fastdata.verify import verify


def _photo(rng, width, height, mode):
    """A smooth image (JPEG-friendly) of ``mode`` with some noise, as a PIL image."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], -1)
    rgb = np.clip(rgb + rng.integers(-8, 8, rgb.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(rgb)
    if mode == "RGBA":
        alpha = Image.fromarray((x * 255 // max(1, width - 1)).astype(np.uint8))
        image = image.convert("RGBA")
        image.putalpha(alpha)
        return image
    return image.convert(mode)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    """Images of many sizes, aspect ratios, modes and formats on disk: ``[path]``."""
    folder = tmp_path_factory.mktemp("record-images")
    rng = np.random.default_rng(7)
    cases = [(64, 48, "RGB", "JPEG"), (17, 90, "L", "PNG"), (120, 33, "RGBA", "PNG"), (40, 40, "P", "GIF"),
             (31, 57, "CMYK", "JPEG"), (200, 150, "RGB", "WEBP"), (9, 9, "RGB", "BMP"), (50, 70, "I;16", "PNG")]
    paths = []
    for number, (width, height, mode, kind) in enumerate(cases):
        path = folder / f"image{number}.{kind.lower()}"
        _photo(rng, width, height, "L" if mode == "I;16" else mode).save(path, format=kind)
        if mode == "I;16":  # a 16-bit grey PNG
            with Image.open(path) as grey:
                wide = np.asarray(grey).astype(np.uint16) * 257
            Image.fromarray(wide).save(path)
        paths.append(path)
    return paths


def _expected(path, size):
    """The pixels the image converter stores for ``path`` at ``size``: uint8 ``[3, H, W]``."""
    return load_image(path, ImageSpec(*size)).transpose(2, 0, 1)


@pytest.mark.parametrize("given_as", ["path", "bytes", "pil", "array"])
@pytest.mark.parametrize("ext", ["h5", "arrow"])
def test_raw_images_are_the_pixels_the_image_converter_stores(tmp_path, image_files, given_as, ext):
    def value(path):
        if given_as == "path":
            return str(path)
        if given_as == "bytes":
            return path.read_bytes()
        with Image.open(path) as image:
            image.load()
            return image if given_as == "pil" else _rgb(path)

    size = (24, 32)
    out = tmp_path / f"images.{ext}"
    usable = [path for path in image_files if given_as != "array" or _rgb(path) is not None]
    write(({"image": value(path), "label": number} for number, path in enumerate(usable)), out,
          schema={"image": Field("image", size=size), "label": "int"})
    batch = open_dataset(out).read_batch(np.arange(len(usable)))
    assert batch["image"].shape == (len(usable), 3, *size)
    for row, path in enumerate(usable):
        # an array has no mode, EXIF or transparency of its own: it is the RGB pixels as given
        expected = _expected_from_array(path, size) if given_as == "array" else _expected(path, size)
        np.testing.assert_array_equal(batch["image"][row].numpy(), expected)


def _rgb(path):
    """The RGB pixels of ``path`` as uint8 ``[H, W, 3]``; None for a 16-bit image, which no uint8 array holds."""
    with Image.open(path) as image:
        return None if image.mode in ("I;16", "I") else np.asarray(image.convert("RGB"))


def _expected_from_array(path, size):
    return prepare_pixels(Image.fromarray(_rgb(path)), ImageSpec(*size)).transpose(2, 0, 1)


@pytest.mark.parametrize("storage", ["jpeg", "png"])
def test_encoded_images_decode_per_batch_to_the_stored_pixels(tmp_path, image_files, storage):
    size = (20, 28)
    out = tmp_path / "encoded.arrow"
    quality = {"quality": 85} if storage == "jpeg" else {}
    write(({"image": str(path)} for path in image_files), out,
          schema={"image": Field("image", size=size, storage=storage, **quality)})
    dataset = open_dataset(out)
    batch = dataset.read_batch(np.arange(len(image_files))[::-1])
    for row, path in enumerate(image_files[::-1]):
        expected = _expected(path, size)
        if storage == "jpeg":  # what the stored JPEG (quality 85) decodes to
            pixels = np.ascontiguousarray(expected.transpose(1, 2, 0))
            expected = decode_jpeg(encode_jpeg(pixels, 85)).transpose(2, 0, 1)
        np.testing.assert_array_equal(batch["image"][row].numpy(), expected)
        np.testing.assert_array_equal(dataset[len(image_files) - 1 - row]["image"].numpy(), expected)


def test_the_schema_is_told_from_the_first_records(tmp_path):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8))
    records = [{"label": 1, "weight": 0.5, "caption": "ok", "raw": b"\x01", "ids": [], "boxes": [],
                "meta": {"id": 1}, "emb": np.zeros(3, np.float16), "picture": image},
               {"label": 2, "weight": 1.0, "caption": "é", "raw": b"", "ids": [3, 4], "boxes": [[1, 2, 3, 4]],
                "meta": [1, "x"], "emb": np.ones(3, np.float16), "picture": image}]
    out = tmp_path / "told.h5"
    write(records, out)
    _, fields, _ = read_records(out)
    assert {name: field.type for name, field in fields.items()} == {
        "label": "int", "weight": "float", "caption": "str", "raw": "bytes", "ids": "tokens", "boxes": "ragged",
        "meta": "json", "emb": "array", "picture": "image"}
    assert fields["boxes"].shape == (4,) and fields["emb"].dtype == "float16" and fields["picture"].size == (12, 16)
    item = open_dataset(out)[1]
    assert item["ids"].tolist() == [3, 4] and item["boxes"].tolist() == [[1, 2, 3, 4]] and item["meta"] == [1, "x"]


def test_a_type_that_cannot_be_told_asks_for_a_schema(tmp_path):
    with pytest.raises(OptionError, match=r"cannot tell the type of field 'ids'.*pass schema=\{'ids': \.\.\.\}"):
        write([{"ids": []}, {"ids": None}], tmp_path / "x.h5")
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.parametrize("bad, message", [
    ({"label": 1.5, "caption": "x"}, r"record 2: field 'label' \(int\) should be an integer, got float 1.5"),
    ({"label": 2**63, "caption": "x"}, "does not fit int64"),
    ({"label": 1}, r"record 2: lacks field\(s\) 'caption'"),
    ({"label": 1, "caption": "x", "extra": 0}, r"record 2: has field\(s\) 'extra' the schema does not"),
    ({"label": 1, "caption": b"x"}, r"field 'caption' \(str\) should be text \(str\), got bytes"),
    ({"label": 1, "caption": "\ud800"}, "cannot be stored as UTF-8"),
    ("not a dict", "record 2: should be a dict"),
])
def test_a_record_that_does_not_fit_is_named_and_nothing_is_written(tmp_path, bad, message):
    records = [{"label": 0, "caption": "a"}, {"label": 1, "caption": "b"}, bad]
    out = tmp_path / "out.arrow"
    with pytest.raises(SampleError, match=message) as raised:
        write(records, out, schema={"label": "int", "caption": "str"})
    assert raised.value.index == 2 and not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("field, value, message", [
    (Field("tokens", dtype="uint16"), [1, 70000], r"holds 1..70000, outside uint16"),
    (Field("tokens"), [1.5], "should hold integers"),
    (Field("array", shape=(2, 2)), np.zeros(4), r"should have shape \[2, 2\], got \[4\].*Field\('ragged'"),
    (Field("ragged", shape=(4,)), [[1, 2, 3]], r"should be rows \[n, 4\], got shape \[1, 3\]"),
    (Field("image", size=(8, 8)), b"not an image", "is not a usable image"),
    (Field("image", size=(8, 8)), np.zeros((4, 4, 2), np.uint8), r"should be uint8 pixels"),
    (Field("json"), {"x": float("nan")}, "is not JSON"),
    (Field("json"), {"x": object()}, "is not JSON"),
])
def test_values_are_never_converted_into_what_they_are_not(tmp_path, field, value, message):
    with pytest.raises(SampleError, match=message):
        write([{"x": value}], tmp_path / "x.h5", schema={"x": field})


@pytest.mark.parametrize("on_error", ["skip", "warn"])
def test_records_left_out_are_listed_in_the_report_and_the_file(tmp_path, on_error):
    records = [{"label": 0}, {"label": "one"}, {"label": 2}, {"label": None}]
    out = tmp_path / "kept.h5"
    if on_error == "warn":
        with pytest.warns(UserWarning) as caught:
            report = write(records, out, on_error=on_error)
        assert [str(warning.message).split(":")[0] for warning in caught] == ["skipped record 1", "skipped record 3"]
    else:
        report = write(records, out, on_error=on_error)
    assert report.num_samples == 2 and [name for name, _ in report.skipped] == ["record 1", "record 3"]
    dataset = open_dataset(out)
    assert dataset.read_batch([0, 1])["label"].tolist() == [0, 2]
    assert [item["path"] for item in dataset.metadata["skipped"]] == ["record 1", "record 3"]
    assert "skipped:     2" in describe(out) and "'record 3'" in describe(out)


def test_an_existing_output_is_kept_unless_overwrite(tmp_path):
    out = tmp_path / "x.h5"
    write([{"label": 1}], out)
    with pytest.raises(FileExistsError):
        write([{"label": 2}], out)
    assert open_dataset(out)[0]["label"] == 1
    write([{"label": 2}], out, overwrite=True)
    assert open_dataset(out)[0]["label"] == 2


@pytest.mark.parametrize("ext", ["h5", "arrow"])
def test_verify_names_the_damaged_records_and_info_describes_the_fields(tmp_path, ext):
    rng = np.random.default_rng(1)
    records = [{"image": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), "caption": f"<{i:03d}>" + "x" * 500,
                "label": i} for i in range(40)]
    out = tmp_path / f"records.{ext}"
    write(records, out, schema={"image": Field("image", size=(16, 16), storage="jpeg"), "caption": "str",
                                "label": "int"})
    assert verify(out).ok
    text = describe(out)
    assert "records of 3 named fields" in text and "image: image (size=[16, 16], storage=jpeg" in text
    overwrite(out, _file_offset(out, b"<030>"), b"X")
    report = verify(out)
    assert not report.ok and 30 in report.damaged_samples.tolist()
    assert "column 'caption': checksum mismatch" in str(report)
    quick = verify(out, quick=True)
    assert not quick.ok and "values" not in [problem.check for problem in quick.problems]


def _file_offset(path, needle):
    data = path.read_bytes()
    assert data.count(needle) == 1
    return data.index(needle)


def test_cli_info_and_verify_read_a_record_file(tmp_path):
    out = tmp_path / "records.arrow"
    write([{"caption": "x", "label": 1}], out)
    result = run_cli("info", str(out))
    assert result.exit_code == 0 and "caption: str" in result.output
    result = run_cli("verify", str(out))
    assert result.exit_code == 0 and "ok" in result.output


def test_a_png_image_field_is_lossless(tmp_path):
    pixels = np.random.default_rng(3).integers(0, 256, (10, 14, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    out = tmp_path / "png.h5"
    write([{"image": buffer.getvalue()}], out, schema={"image": Field("image", size=(10, 14), storage="png")})
    np.testing.assert_array_equal(open_dataset(out)[0]["image"].numpy(), pixels.transpose(2, 0, 1))


def _record_of(path):
    """A record made from an input on a worker (fn=): a top-level function, so a pool can run it."""
    if "image3" in str(path):
        raise ValueError("this input is unusable")
    return {"image": str(path), "name": path.name, "size": path.stat().st_size}


_PAIRS = {"image": Field("image", size=(24, 20), storage="jpeg"), "name": "str", "size": "int"}


@pytest.mark.parametrize("ext", ["h5", "arrow"])
@pytest.mark.integration
def test_the_file_is_the_same_bytes_for_any_number_of_workers_and_on_dask(tmp_path, image_files, ext, monkeypatch):
    inputs = image_files * 70  # 560 records: three tasks of records on workers
    monkeypatch.setattr("fastdata.converters.records._INFERRED_FROM", 8)
    reports = {}
    for workers in (1, 2):
        reports[workers] = write(inputs, tmp_path / f"{workers}.{ext}", _PAIRS, fn=_record_of, workers=workers,
                                 on_error="skip")
    distributed = pytest.importorskip("distributed")
    records = [{"image": str(path), "name": path.name, "size": path.stat().st_size} for path in inputs]
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0") as cluster:
        with distributed.Client(cluster) as client:
            write(records, tmp_path / f"dask.{ext}", _PAIRS, executor=client)
            write(records, tmp_path / f"here.{ext}", _PAIRS)
    assert (tmp_path / f"1.{ext}").read_bytes() == (tmp_path / f"2.{ext}").read_bytes()
    assert (tmp_path / f"dask.{ext}").read_bytes() == (tmp_path / f"here.{ext}").read_bytes()
    assert reports[1].num_samples == reports[2].num_samples == 560 - 70
    assert reports[2].skipped[:2] == [("record 3", "fn raised ValueError: this input is unusable"),
                                      ("record 11", "fn raised ValueError: this input is unusable")]
    dataset = open_dataset(tmp_path / f"2.{ext}")
    assert dataset.read_batch([0, 3, 489])["name"] == ["image0.jpeg", "image4.jpeg", "image7.png"]


def test_a_function_workers_cannot_run_is_refused_before_any_work(tmp_path, image_files):
    with pytest.raises(OptionError, match="fn should be a top-level function to run on workers"):
        write(image_files * 40, tmp_path / "x.h5", _PAIRS, fn=lambda path: _record_of(path), workers=2)
    with pytest.raises(OptionError, match="workers should be a positive integer"):
        write(image_files, tmp_path / "x.h5", _PAIRS, workers=0)
    assert not (tmp_path / "x.h5").exists()


def _luma(rgb_chw):
    """The grey pixels PIL makes of RGB ``[3, H, W]``: ``[H, W]``."""
    return np.asarray(Image.fromarray(np.ascontiguousarray(rgb_chw.transpose(1, 2, 0)), "RGB").convert("L"))


@pytest.mark.parametrize("storage", ["raw", "jpeg", "png"])
@pytest.mark.parametrize("ext", ["h5", "arrow"])
def test_grey_image_fields_hold_one_channel_the_luma_of_the_stored_pixels(tmp_path, image_files, storage, ext):
    size = (20, 24)
    out = tmp_path / f"grey.{ext}"
    write([{"image": path} for path in image_files], out, {"image": Field("image", size=size, storage=storage,
                                                                          mode="L")})
    dataset = open_dataset(out)
    batch = dataset.read_batch(np.arange(len(image_files))[::-1])["image"]
    assert batch.shape == (len(image_files), 1, *size) and batch.dtype == torch.uint8
    columns, _, _ = read_records(out)
    for row, path in enumerate(image_files[::-1]):
        expected = _luma(_expected(path, size))
        if storage == "jpeg":  # lossy: the stored JPEG decodes to the same pixels in PIL, near the luma
            index = len(image_files) - 1 - row
            data = columns["image"].values[columns["image"].offsets[index] : columns["image"].offsets[index + 1]]
            with Image.open(io.BytesIO(data.tobytes())) as img:
                assert img.mode == "L"
                np.testing.assert_array_equal(batch[row, 0].numpy(), np.asarray(img))
            assert np.abs(batch[row, 0].numpy().astype(int) - expected).mean() < 4
        else:
            np.testing.assert_array_equal(batch[row, 0].numpy(), expected)
    assert dataset[0]["image"].shape == (1, *size)
    assert verify(out).ok and f"image image uint8[1,{size[0]},{size[1]}] {storage}" in repr(dataset)


def test_a_grey_source_keeps_its_own_values(tmp_path):
    pixels = np.random.default_rng(5).integers(0, 256, (14, 10), dtype=np.uint8)
    write([{"image": Image.fromarray(pixels, "L")}], tmp_path / "grey.h5",
          {"image": Field("image", size=(14, 10), mode="L")})
    np.testing.assert_array_equal(open_dataset(tmp_path / "grey.h5")[0]["image"][0].numpy(), pixels)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_grey_batches_go_through_workers_and_the_device_pipeline(tmp_path, image_files, num_workers):
    out = tmp_path / "grey.arrow"
    write([{"image": path, "id": index} for index, path in enumerate(image_files * 3)], out,
          {"image": Field("image", size=(16, 16), storage="jpeg", mode="L"), "id": "int"})
    plain = list(make_loader(open_dataset(out), 4, shuffle=True, seed=1))
    loader = make_loader(open_dataset(out), 4, shuffle=True, seed=1, num_workers=num_workers, device="cpu",
                         normalize=((0.5,), (0.25,)))
    try:
        for raw, batch in zip(plain, loader, strict=True):
            assert batch["image"].shape == (len(raw["id"]), 1, 16, 16) and torch.equal(batch["id"], raw["id"])
            torch.testing.assert_close(batch["image"], (raw["image"].float() / 255 - 0.5) / 0.25)
    finally:
        loader.close()


def test_an_image_mode_other_than_rgb_or_grey_is_refused(tmp_path):
    with pytest.raises(OptionError, match=r"image field 'image': mode should be one of \('RGB', 'L'\), got 'CMYK'"):
        write([{"image": np.zeros((4, 4, 3), np.uint8)}], tmp_path / "x.h5",
              {"image": Field("image", size=(4, 4), mode="CMYK")})
