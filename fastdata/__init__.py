"""fastdata: pack a dataset once, then feed PyTorch from it at memory speed."""

import importlib
import warnings
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> module: the API the README documents, the results it
# returns and the errors it raises. Loaded on first use so that converter
# worker processes (see NOTE [worker start]) never pay for importing torch.
# The measuring engine (bench, tune) is used through its commands and lives
# in fastdata.measure.
_EXPORTS = {
    "ArrowDataset": "fastdata.loading.datasets",
    "BatchIndexSampler": "fastdata.loading.samplers",
    "BucketBatchSampler": "fastdata.loading.samplers",
    "ConversionReport": "fastdata.converters",
    "DiskFullError": "fastdata.errors",
    "FastdataError": "fastdata.errors",
    "Field": "fastdata.formats.records",
    "FormatError": "fastdata.errors",
    "HDF5Dataset": "fastdata.loading.datasets",
    "MissingDependencyError": "fastdata.errors",
    "NotFoundError": "fastdata.errors",
    "OptionError": "fastdata.errors",
    "OutputExistsError": "fastdata.errors",
    "ProfileReport": "fastdata.measure.profiler",
    "RecordDataset": "fastdata.loading.records",
    "RemoteError": "fastdata.errors",
    "SampleError": "fastdata.errors",
    "SourceError": "fastdata.errors",
    "TokenSequences": "fastdata.loading.sequences",
    "Tokenizer": "fastdata.codecs.tokenizers",
    "convert_imagefolder": "fastdata.converters",
    "convert_text": "fastdata.converters",
    "make_loader": "fastdata.loading.loader",
    "mix": "fastdata.loading.mixture",
    "open_dataset": "fastdata.loading.datasets",
    "profile": "fastdata.measure.profiler",
    "write": "fastdata.converters.records",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what type checkers see: the real names, re-exported ("X as X"), so a bad keyword is flagged
    from fastdata.codecs.tokenizers import Tokenizer as Tokenizer
    from fastdata.converters import ConversionReport as ConversionReport
    from fastdata.converters import convert_imagefolder as convert_imagefolder
    from fastdata.converters import convert_text as convert_text
    from fastdata.converters.records import write as write
    from fastdata.errors import DiskFullError as DiskFullError
    from fastdata.errors import FastdataError as FastdataError
    from fastdata.errors import FormatError as FormatError
    from fastdata.errors import MissingDependencyError as MissingDependencyError
    from fastdata.errors import NotFoundError as NotFoundError
    from fastdata.errors import OptionError as OptionError
    from fastdata.errors import OutputExistsError as OutputExistsError
    from fastdata.errors import RemoteError as RemoteError
    from fastdata.errors import SampleError as SampleError
    from fastdata.errors import SourceError as SourceError
    from fastdata.formats.records import Field as Field
    from fastdata.loading.datasets import ArrowDataset as ArrowDataset
    from fastdata.loading.datasets import HDF5Dataset as HDF5Dataset
    from fastdata.loading.datasets import open_dataset as open_dataset
    from fastdata.loading.loader import make_loader as make_loader
    from fastdata.loading.mixture import mix as mix
    from fastdata.loading.records import RecordDataset as RecordDataset
    from fastdata.loading.samplers import BatchIndexSampler as BatchIndexSampler
    from fastdata.loading.samplers import BucketBatchSampler as BucketBatchSampler
    from fastdata.loading.sequences import TokenSequences as TokenSequences
    from fastdata.measure.profiler import ProfileReport as ProfileReport
    from fastdata.measure.profiler import profile as profile

# Names exported by fastdata 0.1 that now live in their modules only: they
# still resolve, with a DeprecationWarning naming the new home.
_MOVED = {
    "ProfiledLoader": "fastdata.measure.profiler",
    "benchmark": "fastdata.measure.bench",
    "measure_loader": "fastdata.measure.engine",
    "tune_loader": "fastdata.measure.tune",
}


def __getattr__(name):
    if name in _MOVED:
        warnings.warn(f"fastdata.{name} moved: import it from {_MOVED[name]}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])
