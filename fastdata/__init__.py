"""fastdata: pack a dataset once, then feed PyTorch from it at memory speed."""

import importlib

__version__ = "0.1.0"

# Public name -> module. Loaded on first use so that converter worker
# processes (see NOTE [worker start]) never pay for importing torch.
_EXPORTS = {
    "ArrowDataset": "fastdata.loading.datasets",
    "BucketBatchSampler": "fastdata.loading.samplers",
    "ConversionReport": "fastdata.converters",
    "FastdataError": "fastdata.errors",
    "FormatError": "fastdata.errors",
    "HDF5Dataset": "fastdata.loading.datasets",
    "MissingDependencyError": "fastdata.errors",
    "ProfileReport": "fastdata.measure.profiler",
    "ProfiledLoader": "fastdata.measure.profiler",
    "SampleError": "fastdata.errors",
    "SourceError": "fastdata.errors",
    "Tokenizer": "fastdata.codecs.tokenizers",
    "benchmark": "fastdata.measure.bench",
    "convert_imagefolder": "fastdata.converters",
    "convert_text": "fastdata.converters",
    "make_loader": "fastdata.loading.loader",
    "measure_loader": "fastdata.measure.engine",
    "open_dataset": "fastdata.loading.datasets",
    "profile": "fastdata.measure.profiler",
    "tune_loader": "fastdata.measure.tune",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])
