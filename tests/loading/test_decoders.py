"""The decoder contract, checked for each kind of packed file (raw images, JPEG images, tokens), one file or shards."""

import inspect

import numpy as np
import pytest
import torch

from fastdata.errors import FormatError
from fastdata.formats import read_packed
from fastdata.formats.shards import read_index
from fastdata.loading.decoders import (
    DECODERS,
    Decoder,
    JpegImageDecoder,
    RawImageDecoder,
    TokenDecoder,
    decoder_for,
)
from fastdata.reading import rowcopy
from fastdata.reading.parts import Part


class DecoderContract:
    """What every decoder promises; subclasses name the decoder, the storage it reads and values of its options."""

    decoder_class = None
    storage = None  # "raw", "jpeg" or "text": which session file and shard folder it reads
    options = {}  # read option name -> values to try

    @pytest.fixture(params=["hdf5", "arrow"])
    def path(self, request, shard_single):
        return shard_single(request.param, self.storage)

    @pytest.fixture(params=["hdf5", "arrow"])
    def shards(self, request, shard_folders):
        """``(decoder, [(columns, path) per shard])`` of the session's shard folder (1-sample shards included)."""
        index = read_index(shard_folders(request.param, self.storage))
        opened = [(read_packed(index.path(k))[0], index.path(k)) for k in range(index.num_shards)]
        return decoder_for(index.metadata, index.root), opened

    @pytest.fixture
    def opened(self, path):
        columns, metadata = read_packed(path)
        return decoder_for(metadata, str(path)), columns, metadata["num_samples"]

    def option_sets(self):
        """Return ``{}`` and each named option at each of its values."""
        return [{}] + [{name: value} for name, values in self.options.items() for value in values]

    def test_is_the_decoder_of_its_files(self, opened):
        decoder, _, _ = opened
        assert type(decoder) is self.decoder_class and isinstance(decoder, Decoder)
        assert self.decoder_class in DECODERS.values()

    def test_names_exactly_the_options_its_batch_takes(self):
        assert set(self.decoder_class.read_options) == set(self.options)
        batch_options = set(inspect.signature(self.decoder_class.batch_parts).parameters) - {"self", "parts",
                                                                                              "pin_memory"}
        assert batch_options == set(self.decoder_class.read_options)

    def test_refuses_an_option_it_does_not_name(self, opened):
        decoder, columns, _ = opened
        with pytest.raises(TypeError):
            decoder.batch(columns, np.array([0]), no_such_option=1)

    def test_batch_equals_items(self, opened):
        decoder, columns, num_samples = opened
        rng = np.random.default_rng(0)
        for options in self.option_sets():
            indices = np.sort(rng.choice(num_samples, 9, replace=False))
            samples = decoder.batch(columns, indices, **options)
            assert isinstance(samples, tuple) and all(len(part) == len(indices) for part in samples)
            items = decoder.unbatch(*samples)
            assert len(items) == len(indices)
            for item, index in zip(items, indices.tolist()):
                assert torch.equal(item, self.expected_item(decoder.item(columns, index), options))

    def expected_item(self, item, options):
        """The item a batch read with ``options`` holds for the per-item ``item``."""
        return item

    def test_an_empty_batch_has_no_rows(self, opened):
        decoder, columns, _ = opened
        samples = decoder.batch(columns, np.array([], dtype=np.int64))
        assert all(len(part) == 0 for part in samples) and len(decoder.unbatch(*samples)) == 0

    def test_max_batch_bytes_bounds_every_batch(self, opened):
        decoder, columns, num_samples = opened
        for options in self.option_sets():
            for size in (1, 5, num_samples):
                indices = np.arange(size)
                samples = decoder.batch(columns, indices, **options)
                used = sum(part.numel() * part.element_size() for part in samples)
                assert used <= decoder.max_batch_bytes(size, **options)

    @pytest.mark.parametrize("layout", ["spanning", "unsorted", "duplicates", "one-sample shards"])
    def test_batch_parts_equal_the_items_of_each_part(self, shards, layout):
        decoder, opened = shards
        sizes = [columns.num_samples for columns, _ in opened]
        rows = {  # (shard, local rows) of each part, in batch order
            "spanning": [(k, np.arange(n)) for k, n in enumerate(sizes)],
            "unsorted": [(3, np.array([6, 0, 2])), (0, np.array([0])), (3, np.array([1])), (1, np.array([4, 1]))],
            "duplicates": [(1, np.array([2, 2, 0])), (2, np.array([0])), (1, np.array([2])), (2, np.array([0, 0]))],
            "one-sample shards": [(k, np.zeros(1, np.int64)) for k, n in enumerate(sizes) if n == 1],
        }[layout]
        parts = [Part(opened[k][0], local.astype(np.int64), opened[k][1]) for k, local in rows]
        expected = [decoder.item(opened[k][0], int(row)) for k, local in rows for row in local]
        for options in self.option_sets():
            samples = decoder.batch_parts(parts, **options)
            assert all(len(part) == len(expected) for part in samples)
            for item, want in zip(decoder.unbatch(*samples), expected):
                assert torch.equal(item, self.expected_item(want, options))

    def test_one_part_is_the_batch_of_its_file(self, shards):
        decoder, opened = shards
        columns, path = max(opened, key=lambda shard: shard[0].num_samples)
        indices = np.arange(columns.num_samples)[::-1].copy()
        for a, b in zip(decoder.batch(columns, indices), decoder.batch_parts([Part(columns, indices, path)])):
            assert torch.equal(a, b)

    def test_no_parts_is_an_empty_batch(self, shards):
        decoder, _ = shards
        samples = decoder.batch_parts([])
        assert all(len(part) == 0 for part in samples) and len(decoder.unbatch(*samples)) == 0

    def test_a_kept_batch_is_never_overwritten(self, opened):
        decoder, columns, num_samples = opened
        first = decoder.batch(columns, np.arange(3))
        copies = [part.clone() for part in first]
        decoder.batch(columns, np.arange(num_samples - 3, num_samples))
        assert all(torch.equal(part, copy) for part, copy in zip(first, copies))


class TestRawImageDecoder(DecoderContract):
    decoder_class = RawImageDecoder
    storage = "raw"
    options = {"threads": [1, 2, 3]}

    @pytest.fixture(autouse=True)
    def every_batch_on_threads(self, monkeypatch):
        """The session's files are small: copy even their batches in pieces on helper threads."""
        monkeypatch.setattr(rowcopy, "PARALLEL_BYTES", 0)

    def test_a_started_batch_is_the_batch(self, shards):
        decoder, opened = shards
        parts = [Part(columns, np.arange(columns.num_samples)[::-1].copy(), path) for columns, path in opened]
        expected = decoder.batch_parts(parts, threads=1)[0].clone()
        finishes = [decoder.start_parts(parts, threads=threads) for threads in (1, 2, 3, 2)]  # in flight together
        for finish in finishes:
            assert torch.equal(finish()[0], expected)


class TestJpegImageDecoder(DecoderContract):
    decoder_class = JpegImageDecoder
    storage = "jpeg"
    options = {"threads": [1, 3], "crop": [None]}  # a crop changes the rows: tests/loading/test_fused_crop_decoding.py


class TestTokenDecoder(DecoderContract):
    decoder_class = TokenDecoder
    storage = "text"
    options = {"pad_to": [1, 5, 5000]}

    def expected_item(self, item, options):
        return item[: options.get("pad_to")]

    def test_parts_are_padded_to_the_longest_of_all_parts(self, shards):
        decoder, opened = shards
        parts = [Part(columns, np.arange(columns.num_samples), path) for columns, path in opened]
        tokens, lengths = decoder.batch_parts(parts)
        longest = max(int(np.diff(columns.offsets).max()) for columns, _ in opened)
        assert tokens.shape == (sum(len(part.indices) for part in parts), longest) and int(lengths.max()) == longest
        assert len({int(np.diff(columns.offsets).max()) for columns, _ in opened}) > 1  # shards differ in width


def test_an_unknown_kind_of_file_has_no_decoder():
    with pytest.raises(FormatError, match="no reader for kind='audio', storage='flac'"):
        decoder_for({"kind": "audio", "storage": "flac"}, "a.h5")


def test_a_decoder_must_implement_the_whole_contract():
    class ItemOnly(Decoder):
        def item(self, columns, index):
            return torch.zeros(1)

    with pytest.raises(TypeError, match="abstract"):
        ItemOnly({}, "a.h5")
