"""make_loader over a record file: dict batches in the same order, resume and rank shares as for (sample, label)."""

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import overwrite

from fastdata import Field, FormatError, OptionError, RecordDataset, make_loader, open_dataset, write
from fastdata.loading import records

NUM_RECORDS = 53


@pytest.fixture(scope="module")
def record_file(tmp_path_factory):
    """53 image + caption + boxes records, JPEG-stored images of 3 sizes, in an .arrow file: ``(path, records)``."""
    rng = np.random.default_rng(11)
    records = []
    for index in range(NUM_RECORDS):
        height, width = [(20, 30), (64, 16), (9, 9)][index % 3]
        records.append({
            "id": index,
            "image": rng.integers(0, 256, (height, width, 3), dtype=np.uint8),
            "caption": "ünïcode " * (index % 7) + str(index),
            "tokens": rng.integers(0, 50_000, index % 9).tolist(),
            "boxes": rng.random((index % 5, 4)).astype(np.float32),
            "weight": float(index) / 7,
        })
    path = tmp_path_factory.mktemp("records") / "pairs.arrow"
    write(records, path, schema={"id": "int", "image": Field("image", size=(16, 16), storage="jpeg"),
                                 "caption": "str", "tokens": Field("tokens", dtype="uint16"),
                                 "boxes": Field("ragged", shape=(4,)), "weight": "float"})
    return path, records


def _ids(batches):
    return [batch["id"].tolist() for batch in batches]


def test_a_shuffled_epoch_yields_every_record_once_as_the_dataset_reads_it(record_file):
    path, records = record_file
    dataset = open_dataset(path)
    loader = make_loader(dataset, 8, shuffle=True, seed=3)
    first, second = list(loader), list(loader)
    for batches in (first, second):
        assert sorted(i for ids in _ids(batches) for i in ids) == list(range(NUM_RECORDS))
    assert _ids(first) != _ids(second)
    for batch in first:
        again = dataset.read_batch(batch["id"].numpy())
        assert set(batch) == set(again) == {"id", "image", "caption", "tokens", "tokens_lengths", "boxes",
                                            "boxes_lengths", "weight"}
        torch.testing.assert_close(batch["image"], again["image"], rtol=0, atol=0)
        assert batch["caption"] == again["caption"] == [records[i]["caption"] for i in batch["id"].tolist()]
        for row, index in enumerate(batch["id"].tolist()):
            length = int(batch["boxes_lengths"][row])
            np.testing.assert_array_equal(batch["boxes"][row, :length].numpy(), records[index]["boxes"])
            assert batch["tokens"][row, : int(batch["tokens_lengths"][row])].tolist() == records[index]["tokens"]


def test_worker_processes_yield_the_same_batches(record_file):
    path, _ = record_file
    here = list(make_loader(open_dataset(path), 8, shuffle=True, seed=5))
    loader = make_loader(open_dataset(path), 8, shuffle=True, seed=5, num_workers=2)
    try:
        there = list(loader)
        assert loader.dataset.slots is not None  # the writer's longest values bound a batch: shared slots
    finally:
        loader.close()
    assert _ids(there) == _ids(here)
    for mine, theirs in zip(here, there):
        assert mine["caption"] == theirs["caption"]
        for key in ("image", "tokens", "boxes", "weight"):
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0)


def test_a_state_saved_mid_epoch_resumes_with_the_next_batch(record_file):
    path, _ = record_file
    whole = _ids(make_loader(open_dataset(path), 6, shuffle=True, seed=1))
    loader = make_loader(open_dataset(path), 6, shuffle=True, seed=1)
    iterator = iter(loader)
    taken = [next(iterator) for _ in range(4)]
    state = loader.state_dict()
    del iterator
    resumed = make_loader(open_dataset(path), 6, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    assert len(whole) == 9 and _ids(taken) == whole[:4] and _ids(resumed) == whole[4:]


def test_ranks_share_every_global_batch(record_file):
    path, _ = record_file
    shares = [_ids(make_loader(open_dataset(path), 5, shuffle=True, seed=2, rank=rank, world_size=3,
                               remainder="drop")) for rank in range(3)]
    assert len({len(share) for share in shares}) == 1
    seen = [i for share in shares for ids in share for i in ids]
    assert len(seen) == len(set(seen)) == (NUM_RECORDS // 15) * 15


def test_fields_picks_what_is_read_and_the_others_are_never_touched(record_file, tmp_path):
    path, records = record_file
    copy = tmp_path / "damaged.arrow"
    copy.write_bytes(path.read_bytes())
    dataset = open_dataset(copy)
    jpeg = dataset.read_batch([0])["image"]
    start = copy.read_bytes().index(b"\xff\xd8\xff")  # the first stored JPEG
    overwrite(copy, start, b"\x00" * 64)  # its header gone: it cannot decode
    picked = open_dataset(copy, fields=["id", "caption"])
    assert repr(picked).startswith("<RecordDataset 'damaged.arrow' arrow: 53 records, id int, caption str>")
    batch = next(iter(make_loader(picked, 4)))
    assert set(batch) == {"id", "caption"} and batch["caption"][0] == records[0]["caption"]
    with pytest.raises(FormatError, match="damaged.arrow.*JPEG of sample 0 does not decode"):
        open_dataset(copy).read_batch([0])
    assert jpeg.shape == (1, 3, 16, 16)


def test_a_batch_keeps_the_schemas_order_whatever_order_its_fields_are_read_in(record_file):
    # NOTE [fields beside the decode]: the image is decoded last, on the helpers while the others are read
    path, _ = record_file
    batch = open_dataset(path).read_batch([4, 0, 7])
    assert list(batch) == ["id", "image", "caption", "tokens", "tokens_lengths", "boxes", "boxes_lengths", "weight"]
    picked = open_dataset(path, fields=["caption", "image", "id"]).read_batch([4, 0, 7])
    assert list(picked) == ["caption", "image", "id"] and picked["image"].shape == (3, 3, 16, 16)


def test_options_for_sample_label_batches_are_refused(record_file):
    with pytest.raises(OptionError, match="pad_to applies to text datasets"):
        make_loader(open_dataset(record_file[0]), 4, pad_to=8)


def _same_dict_batches(got, expected):
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected):
        assert list(mine) == list(theirs)
        for name, value in theirs.items():
            assert torch.equal(mine[name], value) if isinstance(value, torch.Tensor) else mine[name] == value, name


def test_the_helper_process_maps_dict_batches_from_its_slots(record_file):
    path, _ = record_file
    dataset = open_dataset(path)
    in_process = make_loader(dataset, 8, shuffle=True, seed=4)
    with make_loader(dataset, 8, shuffle=True, seed=4, helper_process=True) as loader:
        helper = loader.helper
        slots = [(buffer.data_ptr(), buffer.data_ptr() + buffer.numel()) for buffer in helper._buffers]
        for _ in range(2):  # a new order each epoch, the same helper
            got = [{name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in batch.items()}
                   for batch in loader]
            _same_dict_batches(got, list(in_process))
        batch = next(iter(loader))
        for name in ("image", "id", "tokens", "tokens_lengths", "boxes", "weight"):  # mapped, not copied
            assert any(start <= batch[name].data_ptr() < stop for start, stop in slots), name
        report = helper.report()  # each batch's images read into the start of its slot, ahead of "id"
        assert report["read_in_place"] == report["batches"] >= 2 * len(loader)


def test_the_device_pipeline_augments_dict_batches_from_the_helper(record_file):
    from fastdata.loading.augment import RandomResizedCrop

    path, _ = record_file
    options = dict(shuffle=True, seed=2, device="cpu", augment=RandomResizedCrop(12),
                   normalize=((0.5,) * 3, (0.25,) * 3))
    expected = list(make_loader(open_dataset(path), 8, **options))
    with make_loader(open_dataset(path), 8, helper_process=True, **options) as loader:
        _same_dict_batches(list(loader), expected)
    assert expected[0]["image"].shape == (8, 3, 12, 12) and expected[0]["image"].dtype == torch.float32


def test_changed_files_names_a_file_replaced_or_deleted_under_the_dataset(record_file, tmp_path):
    path, _ = record_file
    copy = tmp_path / "copy.arrow"
    copy.write_bytes(path.read_bytes())
    dataset = RecordDataset(copy)
    assert dataset.changed_files() == {}
    copy.write_bytes(path.read_bytes()[:-8])
    assert dataset.changed_files() == {str(copy): "changed (its size, modification time or inode)"}
    copy.unlink()
    assert dataset.changed_files() == {str(copy): "was deleted"}


def test_open_dataset_options_that_do_not_apply_are_refused(record_file, packed_files):
    with pytest.raises(OptionError, match=r"fields=\['nope'\]: .* has fields id, image, caption"):
        open_dataset(record_file[0], fields=["nope"])
    with pytest.raises(OptionError, match="transform applies to .sample, label. items"):
        open_dataset(record_file[0], transform=lambda x: x)
    with pytest.raises(OptionError, match="fields= picks the fields of a record file"):
        open_dataset(packed_files("hdf5", "raw"), fields=["image"])


def test_a_dataset_pickles_without_its_maps_and_refuses_a_file_changed_under_it(record_file, tmp_path):
    path, _ = record_file
    copy = tmp_path / "copy.arrow"
    copy.write_bytes(path.read_bytes())
    dataset = RecordDataset(copy)
    dataset.read_batch([1, 2])
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone._shards is None and clone.fingerprint == dataset.fingerprint == RecordDataset(path).fingerprint
    assert clone[5]["id"] == 5
    copy.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(FormatError, match="copy.arrow' changed since it was opened"):
        dataset.read_batch([0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_feeding_moves_a_dict_batch_and_normalizes_its_image_field(record_file, num_workers):
    path, _ = record_file
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    plain = list(make_loader(open_dataset(path), 8, shuffle=True, seed=9))
    loader = make_loader(open_dataset(path), 8, shuffle=True, seed=9, device="cpu", normalize=(mean, std),
                         dtype=torch.float16, num_workers=num_workers)
    try:
        fed = list(loader)
    finally:
        loader.close()
    assert len(fed) == len(plain)
    for raw, batch in zip(plain, fed):
        assert batch["image"].dtype == torch.float16 and batch["caption"] == raw["caption"]
        expected = (raw["image"].float() / 255 - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
        torch.testing.assert_close(batch["image"].float(), expected, atol=2e-3, rtol=2e-3)
        for key in ("id", "tokens", "tokens_lengths", "boxes", "boxes_lengths", "weight"):
            torch.testing.assert_close(batch[key], raw[key], rtol=0, atol=0)
    with pytest.raises(OptionError, match="normalize transform image fields; .* reads none"):
        make_loader(open_dataset(path, fields=["caption"]), 8, device="cpu", normalize=(mean, std))


@pytest.mark.slow
def test_tune_times_a_record_file_and_bench_refuses_it_by_name(record_file, tmp_path):
    from fastdata.loading.recommendation import tune_json_path
    from fastdata.measure.bench import benchmark
    from fastdata.measure.tune import tune_loader, write_tune_json

    copy = tmp_path / "pairs.arrow"
    copy.write_bytes(record_file[0].read_bytes())
    result = tune_loader(copy, budget=4, max_workers=1)  # real trials of make_loader over dict batches
    assert result.trials and result.file["kind"] == "records" and result.file["num_samples"] == NUM_RECORDS
    write_tune_json(result, tune_json_path(copy))
    tuned = make_loader(open_dataset(copy), 8, num_workers="auto")
    try:
        assert getattr(tuned, "num_workers", 0) == result.recommended["num_workers"]
        assert sorted(i for batch in tuned for i in batch["id"].tolist()) == list(range(NUM_RECORDS))
    finally:
        tuned.close()
    with pytest.raises(OptionError, match=r"pairs.arrow' holds records of named fields: `fastdata tune` times"):
        benchmark(copy)


def test_a_batch_fits_the_bytes_its_dataset_promises(record_file):
    dataset = open_dataset(record_file[0])
    longest = dataset.metadata["longest"]
    assert longest["tokens"] == 8 and longest["boxes"] == 4  # index % 9 ids, index % 5 boxes
    for size in (1, 7, 53):
        batch = dataset.read_batch(np.arange(size))
        used = sum(value.numel() * value.element_size() for value in batch.values() if isinstance(value, torch.Tensor))
        assert used <= dataset.max_batch_bytes(size)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=60), row_shape=st.sampled_from([(), (4,), (2, 3)]),
       dtype=st.sampled_from(["uint16", "int64", "float32", "bool"]), picks=st.data())
def test_ragged_rows_gathered_as_windows_equal_the_rows_copied_one_by_one(monkeypatch, lengths, row_shape, dtype,
                                                                          picks):
    # the windows of _gathered read past a row's end (into the next rows, NaN among them) and clip at the values'
    # end: the padded batch must equal the row-by-row copy, zeros after each length
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.arange(offsets[-1] * int(np.prod(row_shape)), dtype=np.float64).reshape(-1, *row_shape) % 7
    if dtype == "float32":
        values[::3] = np.nan
    values = values.astype(dtype)
    indices = np.array(picks.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=20)))
    column = SimpleNamespace(offsets=offsets, values=values)
    field = SimpleNamespace(type="ragged", row_shape=row_shape)
    monkeypatch.setattr(records, "_GATHER_WIDTH", 10**6)
    gathered, gathered_lengths = records._padded(column, indices, field)
    monkeypatch.setattr(records, "_GATHER_WIDTH", -1)
    copied, copied_lengths = records._padded(column, indices, field)
    assert gathered.dtype == copied.dtype and gathered.shape == copied.shape
    assert gathered.is_contiguous()
    np.testing.assert_array_equal(gathered_lengths.numpy(), copied_lengths.numpy())
    np.testing.assert_array_equal(gathered.numpy(), copied.numpy())  # NaN equals NaN here
