"""fastdata: pack a dataset once, then feed PyTorch from it at memory speed."""

import importlib
import warnings

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
    "FastdataError": "fastdata.errors",
    "FormatError": "fastdata.errors",
    "HDF5Dataset": "fastdata.loading.datasets",
    "MissingDependencyError": "fastdata.errors",
    "NotFoundError": "fastdata.errors",
    "OptionError": "fastdata.errors",
    "OutputExistsError": "fastdata.errors",
    "ProfileReport": "fastdata.measure.profiler",
    "RemoteError": "fastdata.errors",
    "SampleError": "fastdata.errors",
    "SourceError": "fastdata.errors",
    "Tokenizer": "fastdata.codecs.tokenizers",
    "convert_imagefolder": "fastdata.converters",
    "convert_text": "fastdata.converters",
    "make_loader": "fastdata.loading.loader",
    "open_dataset": "fastdata.loading.datasets",
    "profile": "fastdata.measure.profiler",
}
__all__ = sorted(_EXPORTS)

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
