"""Record sources: files written by the other tools themselves (datasets, webdataset, pyarrow, COCO) convert and
read back equal."""

import csv
import io
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw
from support import run_cli

from fastdata import OptionError, SourceError, open_dataset
from fastdata.codecs.images import ImageSpec, decode_jpeg, encode_jpeg, load_image, load_image_bytes
from fastdata.converters.coco import _placed, convert_coco
from fastdata.converters.recordsources import convert_hf, convert_table, convert_webdataset

SIZE = (24, 32)


def _png(rng, width, height, mode="RGB"):
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def _stored(data):
    """The pixels a raw image field at SIZE stores for encoded image ``data``: uint8 ``[3, H, W]``."""
    return load_image_bytes(data, ImageSpec(*SIZE)).transpose(2, 0, 1)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """``[(path, encoded bytes)]`` of 6 PNGs of several sizes and modes."""
    folder = tmp_path_factory.mktemp("source-photos")
    rng = np.random.default_rng(5)
    photos = []
    for number, (width, height, mode) in enumerate([(40, 30, "RGB"), (13, 50, "L"), (64, 64, "RGBA"),
                                                    (90, 20, "RGB"), (31, 31, "P"), (8, 12, "RGB")]):
        data = _png(rng, width, height, mode)
        path = folder / f"photo{number}.png"
        path.write_bytes(data)
        photos.append((path, data))
    return photos


def test_a_hugging_face_dataset_saved_by_datasets_converts_with_its_features(photos, tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({
        "image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog", "eel"]),
        "caption": datasets.Value("string"), "ids": datasets.Sequence(datasets.Value("int32")),
        "score": datasets.Value("float32")})
    rows = {"image": [str(path) for path, _ in photos], "label": [0, 2, 1, 1, 0, 2],
            "caption": ["a", "ünïcode", "", "x" * 300, "multi\nline", "e"],
            "ids": [[1, 2], [], [3], [4, 5, 6], [7], [2**31 - 1]], "score": [0.5, 1.25, -2.0, 0.0, 3.5, 1e-3]}
    dataset = datasets.Dataset.from_dict(rows, features=features)
    dataset.save_to_disk(str(tmp_path / "hf"))
    report = convert_hf(tmp_path / "hf", tmp_path / "hf.arrow", size=SIZE, progress=False)
    assert report.num_samples == 6 and not report.skipped
    converted = open_dataset(tmp_path / "hf.arrow")
    assert converted.schema["label"].names == ("cat", "dog", "eel") and converted.schema["ids"].type == "tokens"
    batch = converted.read_batch(np.arange(6))
    assert batch["label"].tolist() == rows["label"] and batch["caption"] == rows["caption"]
    assert [batch["ids"][row, : int(length)].tolist() for row, length in enumerate(batch["ids_lengths"])] == rows["ids"]
    np.testing.assert_array_equal(batch["score"].numpy(), np.array(rows["score"], np.float32))
    for row, (_, data) in enumerate(photos):
        np.testing.assert_array_equal(batch["image"][row].numpy(), _stored(data))

    dataset.to_parquet(str(tmp_path / "hf.parquet"))  # the same rows, features in the Parquet schema's metadata
    convert_table(tmp_path / "hf.parquet", tmp_path / "parquet.h5", size=SIZE, progress=False)
    again = open_dataset(tmp_path / "parquet.h5").read_batch(np.arange(6))
    assert again["label"].tolist() == rows["label"] and again["caption"] == rows["caption"]
    np.testing.assert_array_equal(again["image"].numpy(), batch["image"].numpy())

    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(SourceError, match=r"holds the splits 'train', 'test' .a DatasetDict.: convert one split"):
        convert_hf(tmp_path / "splits", tmp_path / "never.h5", progress=False)


def test_a_webdataset_written_by_webdatasets_own_tarwriter_converts(photos, tmp_path):
    webdataset = pytest.importorskip("webdataset")
    samples = [{"__key__": f"sample{number:04d}", "png": data, "cls": number % 3, "txt": f"caption {number} é",
                "json": {"id": number, "tags": ["a"] * number}} for number, (_, data) in enumerate(photos)]
    with webdataset.TarWriter(str(tmp_path / "shard-0.tar")) as sink:
        for sample in samples[:4]:
            sink.write(sample)
    with webdataset.TarWriter(str(tmp_path / "shard-1.tar")) as sink:
        for sample in samples[4:]:
            sink.write(sample)
    report = convert_webdataset([tmp_path / "shard-0.tar", tmp_path / "shard-1.tar"], tmp_path / "wds.h5", size=SIZE,
                                storage="png", progress=False)
    assert report.num_samples == 6
    converted = open_dataset(tmp_path / "wds.h5")
    assert set(converted.schema) == {"__key__", "png", "cls", "txt", "json"}
    batch = converted.read_batch(np.arange(6))
    assert batch["__key__"] == [sample["__key__"] for sample in samples]
    assert batch["cls"].tolist() == [sample["cls"] for sample in samples]
    assert batch["txt"] == [sample["txt"] for sample in samples] and batch["json"] == [s["json"] for s in samples]
    for row, (_, data) in enumerate(photos):
        np.testing.assert_array_equal(batch["png"][row].numpy(), _stored(data))  # PNG storage: lossless


def test_a_parquet_file_written_by_pyarrow_converts_with_its_arrow_types(photos, tmp_path):
    boxes = [np.random.default_rng(n).random((n % 3, 4)).astype(np.float32) for n in range(len(photos))]
    table = pa.table({
        "image": pa.array([data for _, data in photos], pa.binary()),
        "label": pa.array([3, 1, 4, 1, 5, 9], pa.int16()),
        "boxes": pa.array([box.tolist() for box in boxes], pa.list_(pa.list_(pa.float32(), 4))),
        "tokens": pa.array([[1, 2, 3], [], [4], [5, 6], [7], [8]], pa.list_(pa.int32())),
        "caption": pa.array(["a", "b", "c", "d", "e", "f"], pa.large_string()),
        "meta": pa.array([{"k": n} for n in range(6)], pa.struct([("k", pa.int64())])),
    })
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=4)
    convert_table(tmp_path / "rows.parquet", tmp_path / "rows.arrow", image="image", size=SIZE, storage="jpeg",
                  quality=95, progress=False)
    converted = open_dataset(tmp_path / "rows.arrow")
    assert {name: field.type for name, field in converted.schema.items()} == {
        "image": "image", "label": "int", "boxes": "ragged", "tokens": "tokens", "caption": "str", "meta": "json"}
    for index in range(6):
        item = converted[index]
        assert item["label"] == table["label"][index].as_py() and item["meta"] == {"k": index}
        np.testing.assert_array_equal(item["boxes"].numpy(), boxes[index])
        assert item["tokens"].tolist() == table["tokens"][index].as_py()
        pixels = np.ascontiguousarray(_stored(photos[index][1]).transpose(1, 2, 0))
        expected = decode_jpeg(encode_jpeg(pixels, 95)).transpose(2, 0, 1)  # what the stored JPEG decodes to
        np.testing.assert_array_equal(item["image"].numpy(), expected)


def test_a_csv_manifest_of_relative_paths_keeps_text_that_does_not_read_back_as_a_number(photos, tmp_path):
    folder = tmp_path / "set"
    (folder / "images").mkdir(parents=True)
    rows = []
    for number, (path, data) in enumerate(photos):
        (folder / "images" / path.name).write_bytes(data)
        rows.append({"path": f"images/{path.name}", "label": str(number % 2), "zip": f"{number:05d}",
                     "weight": repr(number / 4), "caption": f'he said "{number}", then\nleft'})
    with open(folder / "manifest.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    convert_table(folder / "manifest.csv", tmp_path / "manifest.h5", image="path", size=SIZE, progress=False)
    converted = open_dataset(tmp_path / "manifest.h5")
    assert {name: field.type for name, field in converted.schema.items()} == {
        "path": "image", "label": "int", "zip": "str", "weight": "float", "caption": "str"}
    batch = converted.read_batch(np.arange(len(rows)))
    assert batch["zip"] == [row["zip"] for row in rows] and batch["caption"] == [row["caption"] for row in rows]
    assert batch["label"].tolist() == [number % 2 for number in range(len(rows))]
    for row, (_, data) in enumerate(photos):
        np.testing.assert_array_equal(batch["path"][row].numpy(), _stored(data))
    with pytest.raises(SourceError, match=r"has no column 'picture' .it has 'path', 'label'"):
        convert_table(folder / "manifest.csv", tmp_path / "never.h5", image="picture", progress=False)


def _coco_set(folder, rng):
    """Images of a few sizes, each with red rectangles on white, and their COCO json: ``(json path, boxes)``."""
    images, annotations, boxes_of = [], [], {}
    for image_id, (width, height) in enumerate([(80, 40), (30, 90), (50, 50)], start=7):
        image = Image.new("RGB", (width, height), "white")
        draw = ImageDraw.Draw(image)
        boxes = []
        for _ in range(image_id % 3 + 1):
            w, h = int(rng.integers(8, width // 2)), int(rng.integers(8, height // 2))
            x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
            draw.rectangle([x, y, x + w - 1, y + h - 1], fill="red")
            boxes.append([x, y, w, h])
            annotations.append({"id": len(annotations), "image_id": image_id, "category_id": 3, "bbox": [x, y, w, h],
                                "iscrowd": 0, "area": w * h})
        image.save(folder / f"{image_id}.png")
        images.append({"id": image_id, "file_name": f"{image_id}.png", "width": width, "height": height})
        boxes_of[image_id] = boxes
    images.append({"id": 99, "file_name": "99.png", "width": 10, "height": 10})  # no annotations
    Image.new("RGB", (10, 10), "white").save(folder / "99.png")
    path = folder / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": [{"id": 3, "name": "thing"}]}))
    return path, boxes_of


@pytest.mark.parametrize("resize", ["pad", "stretch"])
def test_coco_boxes_move_with_their_images(tmp_path, resize):
    annotations, boxes_of = _coco_set(tmp_path, np.random.default_rng(2))
    out = tmp_path / f"coco-{resize}.h5"
    report = convert_coco(annotations, out, size=(48, 64), resize=resize, progress=False)
    assert report.num_samples == 4
    dataset = open_dataset(out)
    assert dataset.metadata["source"]["categories"] == {"3": "thing"}
    for index in range(4):
        item = dataset[index]
        image = item["image"].numpy().transpose(1, 2, 0).astype(int)
        red = (image[..., 0] > 200) & (image[..., 1] < 80) & (image[..., 2] < 80)
        assert item["boxes"].shape == (len(boxes_of.get(item["image_id"], [])), 4)
        assert item["category_ids"].tolist() == [3] * len(item["boxes"])
        inside = np.zeros_like(red)
        for x, y, w, h in item["boxes"].tolist():
            inside[int(np.ceil(y + 1)) : int(y + h - 1), int(np.ceil(x + 1)) : int(x + w - 1)] = True
            assert red[int(y + h / 2), int(x + w / 2)]  # the middle of each moved box is red
        outside = np.ones_like(red)
        for x, y, w, h in item["boxes"].tolist():
            outside[max(0, int(y) - 1) : int(np.ceil(y + h)) + 1, max(0, int(x) - 1) : int(np.ceil(x + w)) + 1] = False
        assert red[inside].all() and not red[outside].any()  # no red outside the boxes, all red inside them


def test_coco_refuses_a_crop_and_a_dangling_annotation(tmp_path):
    annotations, _ = _coco_set(tmp_path, np.random.default_rng(3))
    with pytest.raises(OptionError, match="resize='crop' would cut boxes off"):
        convert_coco(annotations, tmp_path / "x.h5", resize="crop", progress=False)
    data = json.loads(annotations.read_text())
    data["annotations"][0]["category_id"] = 12
    annotations.write_text(json.dumps(data))
    with pytest.raises(SourceError, match="annotation 0 names image 7 and category 12, and the file lists no such "
                                          "category"):
        convert_coco(annotations, tmp_path / "x.h5", progress=False)


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(1, 300), height=st.integers(1, 300), out_h=st.integers(1, 64), out_w=st.integers(1, 64),
       resize=st.sampled_from(["pad", "stretch"]))
def test_a_box_over_the_whole_image_lands_on_the_resized_image_exactly(tmp_path, width, height, out_h, out_w, resize):
    path = tmp_path / "whole.png"
    Image.new("RGB", (width, height), "red").save(path)
    spec = ImageSpec(out_h, out_w, resize=resize)
    (placed,) = _placed(np.array([[0.0, 0.0, width, height]]), path, spec)
    pixels = load_image(path, ImageSpec(out_h, out_w, resize=resize))
    red = np.argwhere((pixels[..., 0] > 200) & (pixels[..., 1] < 60))
    top, left = red.min(0)
    bottom, right = red.max(0) + 1
    np.testing.assert_allclose(placed, [left, top, right - left, bottom - top], atol=1e-4)


def test_the_cli_converts_each_source(photos, tmp_path):
    rows = [{"path": str(path), "label": number} for number, (path, _) in enumerate(photos)]
    with open(tmp_path / "m.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    result = run_cli("convert", "table", str(tmp_path / "m.jsonl"), str(tmp_path / "m.arrow"), "--image", "path",
                     "--size", "16x20", "--storage", "jpeg", "--quiet")
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "6 samples" in result.output
    assert open_dataset(tmp_path / "m.arrow").read_batch([0])["path"].shape == (1, 3, 16, 20)
    result = run_cli("convert", "table", str(tmp_path / "m.jsonl"), str(tmp_path / "folder"), "--image", "path",
                     "--size", "16", "--format", "arrow", "--shard-size", "2KB", "--quiet")
    assert result.exit_code == 0, result.output
    folder = open_dataset(tmp_path / "folder")
    assert folder.format == "arrow" and len(folder._files) > 1 and folder.read_batch([5])["label"].tolist() == [5]
    annotations, _ = _coco_set(tmp_path, np.random.default_rng(4))
    result = run_cli("convert", "coco", str(annotations), str(tmp_path / "c.h5"), "--size", "32", "--quiet")
    assert result.exit_code == 0, result.output
    result = run_cli("convert", "coco", str(annotations), str(tmp_path / "d.h5"), "--resize", "crop")
    assert result.exit_code == 1 and "would cut boxes off" in result.output


def test_a_grey_hugging_face_image_feature_stays_grey_and_the_cli_asks_for_grey(photos, tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Image(mode="L"), "label": datasets.Value("int64")})
    dataset = datasets.Dataset.from_dict({"image": [str(path) for path, _ in photos], "label": list(range(6))},
                                         features=features)
    dataset.save_to_disk(str(tmp_path / "hf"))
    convert_hf(tmp_path / "hf", tmp_path / "hf.h5", size=SIZE, progress=False)
    converted = open_dataset(tmp_path / "hf.h5")
    assert converted.schema["image"].mode == "L"
    grey = converted.read_batch(np.arange(6))["image"]
    assert grey.shape == (6, 1, *SIZE)
    for row, (_, data) in enumerate(photos):  # the luma of the RGB pixels stored without the mode
        rgb = np.ascontiguousarray(_stored(data).transpose(1, 2, 0))
        np.testing.assert_array_equal(grey[row, 0].numpy(), np.asarray(Image.fromarray(rgb).convert("L")))
    table = tmp_path / "rows.csv"
    table.write_text("path,label\n" + "".join(f"{path.name},{number}\n" for number, (path, _) in enumerate(photos)))
    shutil.copytree(photos[0][0].parent, tmp_path, dirs_exist_ok=True)
    result = run_cli("convert", "table", table, tmp_path / "table.h5", "--image", "path", "--mode", "L", "--size",
                     f"{SIZE[0]}x{SIZE[1]}", "--quiet")
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(open_dataset(tmp_path / "table.h5").read_batch(np.arange(6))["path"].numpy(),
                                  grey.numpy())
