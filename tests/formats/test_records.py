"""Records of named fields: every field type round trips through both containers, written by fastdata.write."""

import json

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdata import Field, FormatError, OptionError, open_dataset, write
from fastdata.formats import read_packed, read_records
from fastdata.formats.records import make_schema

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def _field_and_values(draw, count):
    """Return ``(Field, [value] * count)`` of a random type, dtype and shape."""
    kind = draw(st.sampled_from(["int", "float", "str", "bytes", "json", "tokens", "ragged", "array"]))
    if kind == "int":
        return Field("int"), draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=count, max_size=count))
    if kind == "float":
        dtype = draw(st.sampled_from(["float64", "float32"]))
        width = 64 if dtype == "float64" else 32
        floats = st.floats(width=width, allow_nan=False)
        return Field("float", dtype=dtype), draw(st.lists(floats, min_size=count, max_size=count))
    if kind in ("str", "bytes", "json"):
        values = {"str": st.text(), "bytes": st.binary(max_size=20), "json": _JSON}[kind]
        return Field(kind), draw(st.lists(values, min_size=count, max_size=count))
    dtype = draw(st.sampled_from(["int32", "uint16", "int64", "float32", "int8"] if kind != "tokens"
                                 else ["int32", "uint16", "int64", "uint8"]))
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    numbers = (st.integers(int(info.min), int(info.max)) if info is not None
               else st.floats(width=32, allow_nan=False, allow_infinity=False))
    if kind == "tokens":
        return Field("tokens", dtype=dtype), draw(st.lists(st.lists(numbers, max_size=6), min_size=count,
                                                            max_size=count))
    shape = tuple(draw(st.lists(st.integers(0 if kind == "array" else 1, 3), max_size=2)))
    width = int(np.prod(shape, dtype=np.int64))

    def value(rows):
        return np.array(draw(st.lists(numbers, min_size=rows * width, max_size=rows * width)),
                        dtype=dtype).reshape(rows, *shape)

    if kind == "array":
        return Field("array", dtype=dtype, shape=shape), [value(1)[0] for _ in range(count)]
    return Field("ragged", dtype=dtype, shape=shape), [value(draw(st.integers(0, 4))) for _ in range(count)]


@st.composite
def _records(draw):
    count = draw(st.integers(0, 7))
    drawn = [draw(_field_and_values(count)) for _ in range(draw(st.integers(1, 4)))]
    schema = {f"f{number}": field for number, (field, _) in enumerate(drawn)}
    records = [{f"f{number}": values[row] for number, (_, values) in enumerate(drawn)} for row in range(count)]
    return schema, records


def _assert_item_equal(field, got, expected):
    if field.type in ("int", "float", "str", "bytes"):
        assert got == expected and type(got) is type(expected if field.type != "float" else 0.0)
    elif field.type == "json":
        assert json.dumps(got) == json.dumps(expected)  # equal, and of the same JSON types (1 is not 1.0)
    else:
        assert isinstance(got, torch.Tensor)
        np.testing.assert_array_equal(got.numpy(), np.asarray(expected).reshape(got.shape))
        assert tuple(got.shape) == np.asarray(expected, dtype=field.dtype).shape or field.type == "ragged"


@pytest.mark.parametrize("ext", ["h5", "arrow"])
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(drawn=_records(), order=st.randoms(use_true_random=False))
@pytest.mark.slow
def test_every_field_type_round_trips(tmp_path, ext, drawn, order):
    schema, records = drawn
    path = tmp_path / f"records.{ext}"
    report = write(records, path, schema=schema, overwrite=True)
    assert report.num_samples == len(records) and not report.skipped
    dataset = open_dataset(path)
    assert len(dataset) == len(records)
    fields = make_schema(schema)
    for index, record in enumerate(records):
        item = dataset[index]
        assert list(item) == list(schema)
        for name, field in fields.items():
            _assert_item_equal(field, item[name], record[name])
    indices = list(range(len(records)))
    order.shuffle(indices)
    batch = dataset.read_batch(indices)
    for row, index in enumerate(indices):
        for name, field in fields.items():
            value = batch[name][row]
            if field.type in ("tokens", "ragged"):
                length = int(batch[f"{name}_lengths"][row])
                assert length == len(records[index][name])
                assert not value[length:].any()  # zero padding
                value = value[:length]
            if isinstance(value, torch.Tensor) and field.type in ("int", "float"):
                value = value.item()
            _assert_item_equal(field, value, records[index][name])


def test_arrow_columns_are_arrows_own_types(tmp_path):
    """Any Arrow reader sees the values: strings, binaries, lists and fixed-size lists, not opaque bytes."""
    records = [{"caption": "a cat", "label": 3, "boxes": [[1.0, 2.0, 3.0, 4.0]], "ids": [5, 6], "raw": b"\x00",
                "emb": np.arange(3, dtype=np.float32), "meta": {"k": [1]}}]
    path = tmp_path / "native.arrow"
    write(records, path, schema={"caption": "str", "label": "int", "boxes": Field("ragged", shape=(4,)),
                                 "ids": "tokens", "raw": "bytes", "emb": Field("array", shape=(3,)), "meta": "json"})
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_file(source).read_all()
    row = table.to_pylist()[0]
    assert row["caption"] == "a cat" and row["label"] == 3 and row["raw"] == b"\x00"
    assert row["boxes"] == [[1.0, 2.0, 3.0, 4.0]] and row["ids"] == [5, 6] and row["emb"] == [0.0, 1.0, 2.0]
    assert json.loads(row["meta"]) == {"k": [1]}
    assert table.schema.field("caption").type == pa.large_string()
    assert table.schema.field("boxes").type == pa.large_list(pa.list_(pa.float32(), 4))


def test_an_empty_file_keeps_its_schema(tmp_path):
    path = tmp_path / "empty.h5"
    write([], path, schema={"label": "int", "caption": "str"})
    dataset = open_dataset(path)
    assert len(dataset) == 0 and list(dataset.schema) == ["label", "caption"]
    batch = dataset.read_batch([])
    assert batch["label"].shape == (0,) and batch["caption"] == []


@pytest.mark.parametrize("ext", ["h5", "arrow"])
def test_a_reader_of_sample_label_files_refuses_a_record_file(tmp_path, ext):
    path = tmp_path / f"records.{ext}"
    write([{"caption": "x", "label": 1}], path)
    with pytest.raises(FormatError, match="records of named fields .caption, label.*open_dataset"):
        read_packed(path)


def test_a_stored_schema_that_is_not_valid_is_named(tmp_path):
    path = tmp_path / "records.h5"
    write([{"label": 1}], path)
    import h5py

    with h5py.File(path, "r+") as f:
        metadata = json.loads(f.attrs["fastdata"])
        metadata["fields"][0]["type"] = "complex"
        f.attrs["fastdata"] = json.dumps(metadata)
    with pytest.raises(FormatError, match=r"records.h5.*stored schema is not valid.*'complex'"):
        read_records(path)


@pytest.mark.parametrize("schema, message", [
    ({"a b": "int"}, "should be an identifier"),
    ({"x": "complex"}, "has type 'complex'"),
    ({"x": Field("image")}, r"needs size=\(height, width\)"),
    ({"x": Field("image", size=(8, 8), storage="webp")}, "storage should be one of"),
    ({"x": Field("image", size=(8, 8), quality=80)}, "quality applies to storage='jpeg' only"),
    ({"x": Field("array")}, r"needs shape=\(...\)"),
    ({"x": Field("tokens", dtype="float32")}, "takes an integer dtype"),
    ({"x": Field("str", dtype="int8")}, "takes no dtype"),
    ({"x": Field("int", dtype="int8")}, "is stored as int64"),
    ({"x": "tokens", "x_lengths": "int"}, "holds the lengths of 'x'"),
    ({}, "non-empty dict"),
])
def test_a_bad_schema_is_refused_naming_the_field(tmp_path, schema, message):
    with pytest.raises(OptionError, match=message):
        write([], tmp_path / "never.h5", schema=schema)
    assert not (tmp_path / "never.h5").exists()


@pytest.mark.parametrize("longest", [5, 256, 257, 400])
def test_ragged_rows_pad_alike_gathered_at_once_or_row_by_row(tmp_path, longest):
    # rows up to _GATHER_WIDTH long are gathered at once, longer batches row by row (NOTE [short rows at once])
    rng = np.random.default_rng(longest)
    rows = [rng.integers(0, 60000, int(length)).tolist() for length in rng.integers(0, longest + 1, 40)]
    rows[7] = list(range(longest))
    boxes = [rng.random((len(row) % 7, 4)).astype(np.float32) for row in rows]
    write([{"ids": row, "boxes": box} for row, box in zip(rows, boxes)], tmp_path / "r.h5",
          schema={"ids": Field("tokens", dtype="uint16"), "boxes": Field("ragged", shape=(4,))})
    batch = open_dataset(tmp_path / "r.h5").read_batch(np.arange(40)[::-1])
    assert batch["ids"].shape == (40, longest) and batch["ids"].dtype == torch.int64
    for row, index in enumerate(range(39, -1, -1)):
        length = len(rows[index])
        assert batch["ids_lengths"][row] == length and batch["ids"][row, :length].tolist() == rows[index]
        assert not batch["ids"][row, length:].any()
        np.testing.assert_array_equal(batch["boxes"][row, : len(boxes[index])].numpy(), boxes[index])
