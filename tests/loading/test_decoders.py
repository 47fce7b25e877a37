"""The decoder contract, checked for each kind of packed file (raw images, JPEG images, tokens)."""

import inspect

import numpy as np
import pytest
import torch

from fastdata.errors import FormatError
from fastdata.formats import read_packed
from fastdata.loading.decoders import (
    DECODERS,
    Decoder,
    JpegImageDecoder,
    RawImageDecoder,
    TokenDecoder,
    decoder_for,
)


class DecoderContract:
    """What every decoder promises; subclasses name the decoder, a file it reads and values of its options."""

    decoder_class = None
    options = {}  # read option name -> values to try

    @pytest.fixture
    def path(self):
        raise NotImplementedError

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
        batch_options = set(inspect.signature(self.decoder_class.batch).parameters) - {"self", "columns", "indices",
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

    def test_a_kept_batch_is_never_overwritten(self, opened):
        decoder, columns, num_samples = opened
        first = decoder.batch(columns, np.arange(3))
        copies = [part.clone() for part in first]
        decoder.batch(columns, np.arange(num_samples - 3, num_samples))
        assert all(torch.equal(part, copy) for part, copy in zip(first, copies))


class TestRawImageDecoder(DecoderContract):
    decoder_class = RawImageDecoder

    @pytest.fixture(params=["hdf5", "arrow"])
    def path(self, request, packed_files):
        return packed_files(request.param, "raw")


class TestJpegImageDecoder(DecoderContract):
    decoder_class = JpegImageDecoder
    options = {"threads": [1, 3]}

    @pytest.fixture(params=["hdf5", "arrow"])
    def path(self, request, packed_files):
        return packed_files(request.param, "jpeg")


class TestTokenDecoder(DecoderContract):
    decoder_class = TokenDecoder
    options = {"pad_to": [1, 5, 5000]}

    @pytest.fixture(params=["hdf5", "arrow"])
    def path(self, request, packed_text):
        return packed_text(request.param)

    def expected_item(self, item, options):
        return item[: options.get("pad_to")]


def test_an_unknown_kind_of_file_has_no_decoder():
    with pytest.raises(FormatError, match="no reader for kind='audio', storage='flac'"):
        decoder_for({"kind": "audio", "storage": "flac"}, "a.h5")


def test_a_decoder_must_implement_the_whole_contract():
    class ItemOnly(Decoder):
        def item(self, columns, index):
            return torch.zeros(1)

    with pytest.raises(TypeError, match="abstract"):
        ItemOnly({}, "a.h5")
