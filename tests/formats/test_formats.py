"""The packed-file contract, checked for each container (HDF5, Arrow)."""

import json
import os
import re
import shutil
import tempfile

import h5py
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import column_regions, downgrade_to_version1, overwrite, private_copy

from fastdata import ArrowDataset, FormatError, HDF5Dataset, open_dataset
from fastdata.formats import (
    FORMAT_VERSION,
    Columns,
    column_offsets,
    format_of,
    read_checksums,
    read_packed,
    write_packed,
)
from fastdata.formats.layout import CHECKSUM_CHUNK_BYTES, COLUMN_ALIGNMENT, METADATA_KEY, chunk_checksums


def mapped_files(address):
    """Paths of the file mappings of this process that contain ``address``."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < stop and len(fields) == 6:
                found.append(fields[5].strip())
    return found


def data_address(array):
    return array.__array_interface__["data"][0]


class FormatContract:
    """What every packed format promises; subclasses say how to forge its files."""

    fmt = None
    ext = None
    dataset_class = None

    @pytest.fixture
    def path(self, packed_files):
        return packed_files(self.fmt, "raw")

    @pytest.fixture
    def jpeg_path(self, packed_files):
        return packed_files(self.fmt, "jpeg")

    def write_foreign(self, path):
        """Write a valid container file that fastdata did not write."""
        raise NotImplementedError

    def rewrite_metadata(self, src, dst, change):
        """Copy ``src`` to ``dst`` with its stored metadata passed through ``change(dict)``."""
        raise NotImplementedError

    def open_all(self, path):
        """Every public way to open a packed file; each must raise the same errors."""
        return [
            lambda: read_packed(path),
            lambda: open_dataset(path),
            lambda: self.dataset_class(path),
        ]

    # ------------------------------------------------------------ identity

    def test_extension_picks_the_format(self, path):
        assert format_of(path) == self.fmt
        assert isinstance(open_dataset(path), self.dataset_class)

    def test_metadata_names_the_format_and_version(self, path):
        _, metadata = read_packed(path)
        assert metadata["format"] == "fastdata"
        assert metadata["format_version"] == FORMAT_VERSION
        assert metadata["kind"] == "image"

    # ------------------------------------------------------------ bad files

    def test_missing_file(self, tmp_path):
        path = tmp_path / f"missing{self.ext}"
        for opener in self.open_all(path):
            with pytest.raises(FileNotFoundError, match=re.escape(os.fspath(path))):
                opener()

    def test_foreign_file_is_not_a_fastdata_file(self, tmp_path):
        path = tmp_path / f"foreign{self.ext}"
        self.write_foreign(path)
        for opener in self.open_all(path):
            with pytest.raises(FormatError, match="not a fastdata file"):
                opener()

    def test_newer_format_version(self, path, tmp_path):
        newer = tmp_path / f"newer{self.ext}"
        self.rewrite_metadata(path, newer, lambda m: {**m, "format_version": 99})
        for opener in self.open_all(newer):
            with pytest.raises(FormatError, match="format version") as info:
                opener()
            assert "99" in str(info.value) and "newer" in str(info.value)

    def test_other_format_name(self, path, tmp_path):
        other = tmp_path / f"other{self.ext}"
        self.rewrite_metadata(path, other, lambda m: {**m, "format": "somebody-else"})
        with pytest.raises(FormatError, match="not a fastdata file"):
            read_packed(other)

    def test_metadata_disagreeing_with_the_arrays(self, path, tmp_path):
        bad = tmp_path / f"bad{self.ext}"
        self.rewrite_metadata(path, bad, lambda m: {**m, "num_samples": m["num_samples"] + 1})
        with pytest.raises(FormatError, match=re.escape(os.fspath(bad))):
            read_packed(bad)

    def test_unknown_storage_has_no_reader(self, path, tmp_path):
        odd = tmp_path / f"odd{self.ext}"
        self.rewrite_metadata(path, odd, lambda m: {**m, "storage": "webp"})
        with pytest.raises(FormatError, match="no reader"):
            self.dataset_class(odd)[0]

    @pytest.mark.parametrize("storage", ["raw", "jpeg"])
    def test_truncated_file(self, packed_files, tmp_path, storage):
        source = packed_files(self.fmt, storage)
        cut = tmp_path / f"cut{self.ext}"
        data = source.read_bytes()
        cut.write_bytes(data[: int(len(data) * 0.7)])
        for opener in self.open_all(cut):
            with pytest.raises(FormatError, match=re.escape(os.fspath(cut))):
                opener()

    @pytest.mark.parametrize("size", [0, 7, 4096])
    def test_random_bytes(self, tmp_path, size):
        path = tmp_path / f"random{self.ext}"
        path.write_bytes(np.random.default_rng(size).bytes(size))
        for opener in self.open_all(path):
            with pytest.raises(FormatError, match=re.escape(os.fspath(path))):
                opener()

    def test_other_container_under_this_extension(self, packed_files, tmp_path):
        other_fmt = "arrow" if self.fmt == "hdf5" else "hdf5"
        path = tmp_path / f"disguised{self.ext}"
        shutil.copyfile(packed_files(other_fmt, "raw"), path)
        with pytest.raises(FormatError):
            read_packed(path)

    # ------------------------------------------------------------ reading

    @pytest.mark.parametrize("storage", ["raw", "jpeg"])
    def test_arrays_are_memory_mapped_not_copied(self, packed_files, storage):
        path = os.path.realpath(packed_files(self.fmt, storage))
        columns, _ = read_packed(path)
        arrays = [columns.samples, columns.labels] + ([columns.offsets] if columns.ragged else [])
        for array in arrays:
            assert not array.flags.owndata
            assert not array.flags.writeable
            assert path in mapped_files(data_address(array))

    def test_dataset_reads_through_the_memory_map(self, path):
        ds = self.dataset_class(path)
        ds[0]
        real = os.path.realpath(path)
        assert real in mapped_files(data_address(ds.labels))

    @pytest.mark.parametrize("dtype", [np.uint8, np.float32])
    def test_write_then_read_fixed_columns(self, tmp_path, dtype):
        rng = np.random.default_rng(0)
        columns = Columns((rng.random((5, 3, 4, 2)) * 255).astype(dtype), np.arange(5, dtype=np.int64) - 1)
        path = tmp_path / f"fixed{self.ext}"
        metadata = {
            "kind": "test",
            "num_samples": 5,
            "sample_shape": [3, 4, 2],
            "sample_dtype": np.dtype(dtype).name,
            "extra": [1, "x"],
        }
        write_packed(path, columns, metadata)
        got, meta = read_packed(path)
        assert meta["extra"] == [1, "x"] and meta["num_samples"] == 5
        assert got.samples.dtype == dtype and got.samples.shape == (5, 3, 4, 2)
        assert np.array_equal(got.samples, columns.samples)
        assert np.array_equal(got.labels, columns.labels) and got.labels.dtype == np.int64
        assert got.offsets is None

    def test_write_then_read_ragged_columns(self, tmp_path):
        rng = np.random.default_rng(0)
        lengths = np.array([3, 0, 7, 1], np.int64)
        columns = Columns(
            rng.integers(0, 256, lengths.sum(), dtype=np.uint8),
            np.array([2, 0, 1, 1], np.int64),
            np.concatenate([[0], np.cumsum(lengths)]),
        )
        path = tmp_path / f"ragged{self.ext}"
        write_packed(path, columns, {"kind": "test", "num_samples": 4, "sample_shape": None, "sample_dtype": "uint8"})
        got, _ = read_packed(path)
        assert np.array_equal(got.samples, columns.samples)
        assert np.array_equal(got.labels, columns.labels)
        assert np.array_equal(got.offsets, columns.offsets)

    def test_version1_files_still_read(self, path, jpeg_path, tmp_path):
        for source in (path, jpeg_path):
            old = downgrade_to_version1(private_copy(source, tmp_path, "old"))
            (columns, metadata), (new_columns, new_metadata) = read_packed(old), read_packed(source)
            assert metadata["format_version"] == 1 and "checksums" not in metadata and read_checksums(old) == {}
            for name in ("samples", "labels", "offsets"):
                assert np.array_equal(getattr(columns, name), getattr(new_columns, name)), name
            assert {**metadata, "format_version": 2, "checksums": new_metadata["checksums"]} == new_metadata

    def test_checksums_cover_every_chunk_of_every_column(self, tmp_path):
        lengths = np.random.default_rng(1).integers(0, 4000, 300)
        columns = Columns(
            np.random.default_rng(2).integers(0, 2**16, lengths.sum(), dtype=np.uint16),
            np.arange(300, dtype=np.int64) % 7,
            np.concatenate([[0], np.cumsum(lengths)]),
        )
        assert columns.samples.nbytes > 2 * CHECKSUM_CHUNK_BYTES
        path = tmp_path / f"ragged{self.ext}"
        metadata = {"kind": "test", "num_samples": 300, "sample_shape": None, "sample_dtype": "uint16"}
        write_packed(path, columns, metadata)
        _, metadata = read_packed(path)
        assert metadata["checksums"] == {"algorithm": "crc32", "chunk_bytes": CHECKSUM_CHUNK_BYTES}
        stored = read_checksums(path)
        for name in ("samples", "labels", "offsets"):
            assert np.array_equal(stored[name], chunk_checksums(getattr(columns, name), CHECKSUM_CHUNK_BYTES)), name
        assert len(stored["samples"]) == -(-columns.samples.nbytes // CHECKSUM_CHUNK_BYTES)

    def test_the_writer_sets_version_and_checksums_whatever_the_metadata_says(self, path, tmp_path):
        # benchmarks rewrite files with the metadata they read: stale checksums must not survive
        columns, metadata = read_packed(path)
        copy = tmp_path / f"fewer{self.ext}"
        fewer = Columns(np.asarray(columns.samples[:5]), np.asarray(columns.labels[:5]))
        stale = {**metadata, "num_samples": 5, "format_version": 1, "checksums": {"algorithm": "md5"}}
        write_packed(copy, fewer, stale)
        _, written = read_packed(copy)
        assert written["format_version"] == FORMAT_VERSION and written["checksums"]["algorithm"] == "crc32"
        assert np.array_equal(read_checksums(copy)["labels"], chunk_checksums(fewer.labels, CHECKSUM_CHUNK_BYTES))

    def test_labels_outside_the_classes_are_refused_naming_the_sample(self, path, tmp_path):
        bad = private_copy(path, tmp_path, "bad")
        overwrite(bad, column_regions(bad)["labels"][0] + 3 * 8, np.int64(-2).tobytes())
        for opener in self.open_all(bad):
            with pytest.raises(FormatError, match=re.escape(os.fspath(bad)) + ".*labels outside -1..3 at sample 3 "):
                opener()
        assert read_packed(bad, check=False)[0].labels[3] == -2  # verify reads it to report it

    @pytest.mark.parametrize("entry, value", [(0, 1), (5, -1), (5, 2**62), ("last", 1)])
    def test_offsets_out_of_order_or_bounds_are_refused(self, jpeg_path, tmp_path, entry, value):
        bad = private_copy(jpeg_path, tmp_path, "bad")
        offset, nbytes = column_regions(bad)["offsets"]
        where = nbytes - 8 if entry == "last" else entry * 8
        if entry == "last":
            value += int(read_packed(bad)[0].offsets[-1])
        overwrite(bad, offset + where, np.int64(value).tobytes())
        for opener in self.open_all(bad):
            with pytest.raises(FormatError, match=re.escape(os.fspath(bad)) + ".*offsets of samples? .*out of order"):
                opener()

    def test_empty_columns_round_trip(self, tmp_path):
        path = tmp_path / f"empty{self.ext}"
        columns = Columns(np.empty((0, 3, 2, 2), np.uint8), np.empty(0, np.int64))
        metadata = {"kind": "test", "num_samples": 0, "sample_shape": [3, 2, 2], "sample_dtype": "uint8"}
        write_packed(path, columns, metadata)
        got, meta = read_packed(path)
        assert got.samples.shape == (0, 3, 2, 2) and got.labels.shape == (0,)


class TestHDF5Contract(FormatContract):
    fmt, ext, dataset_class = "hdf5", ".h5", HDF5Dataset

    def write_foreign(self, path):
        with h5py.File(path, "w") as f:
            f.create_dataset("samples", data=np.zeros((4, 3, 2, 2), np.uint8))
            f.create_dataset("labels", data=np.zeros(4, np.int64))
            f.attrs["creator"] = "someone else"

    def rewrite_metadata(self, src, dst, change):
        shutil.copyfile(src, dst)
        with h5py.File(dst, "r+") as f:
            metadata = json.loads(f.attrs[METADATA_KEY])
            f.attrs[METADATA_KEY] = json.dumps(change(metadata))

    def test_chunked_dataset_is_refused(self, path, tmp_path):
        chunked = tmp_path / "chunked.h5"
        with h5py.File(path, "r") as src, h5py.File(chunked, "w") as dst:
            dst.attrs[METADATA_KEY] = src.attrs[METADATA_KEY]
            dst.create_dataset("samples", data=src["samples"][()], chunks=True, compression="gzip")
            dst.create_dataset("labels", data=src["labels"][()])
        with pytest.raises(FormatError, match="not contiguous"):
            read_packed(chunked)


class TestArrowContract(FormatContract):
    fmt, ext, dataset_class = "arrow", ".arrow", ArrowDataset

    def write_foreign(self, path):
        table = pa.table({"sample": pa.array([b"a", b"bc"]), "label": pa.array([0, 1], pa.int64())})
        with pa.OSFile(os.fspath(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    def rewrite_metadata(self, src, dst, change):
        with pa.memory_map(os.fspath(src), "r") as source:
            table = pa.ipc.open_file(source).read_all()
        metadata = json.loads(table.schema.metadata[METADATA_KEY.encode()])
        table = table.replace_schema_metadata({METADATA_KEY: json.dumps(change(metadata))})
        with pa.OSFile(os.fspath(dst), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    def test_several_record_batches_are_refused(self, path, tmp_path):
        split = tmp_path / "split.arrow"
        with pa.memory_map(os.fspath(path), "r") as source:
            table = pa.ipc.open_file(source).read_all()
        with pa.OSFile(os.fspath(split), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=5)
        with pytest.raises(FormatError, match="one record batch"):
            read_packed(split)


@pytest.mark.parametrize("ext", [".h5", ".arrow"])
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 300), shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       extra=st.text(max_size=3000))
def test_fixed_sample_columns_start_aligned_whatever_the_metadata(ext, rows, shape, extra):
    # NOTE [aligned columns]: headers of any length (here: metadata text) leave the samples on a 4,096-byte
    # boundary, so every shard of a folder lays out alike for the stitched and window readers
    samples = np.random.default_rng(rows).integers(0, 256, (rows, *shape), dtype=np.uint8)
    columns = Columns(samples, np.arange(rows, dtype=np.int64) % 3)
    metadata = {"kind": "test", "num_samples": rows, "sample_shape": shape, "sample_dtype": "uint8",
                "extra": extra}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"aligned{ext}")
        write_packed(path, columns, metadata)
        start, _ = column_offsets(path)
        if samples.nbytes:
            assert start % COLUMN_ALIGNMENT == 0, start
        with open(path, "rb") as f:
            f.seek(start)
            assert f.read(samples.nbytes) == samples.tobytes()  # the offset is where the samples are
        read, stored = read_packed(path)
        assert np.array_equal(read.samples, samples) and stored["extra"] == extra
