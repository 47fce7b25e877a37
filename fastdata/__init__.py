"""fastdata: pack a dataset once, then feed PyTorch from it at memory speed."""

import importlib

__version__ = "0.1.0"

# Public name -> module. Loaded on first use so that converter worker
# processes (see NOTE [worker start]) never pay for importing torch.
_EXPORTS = {
    "ArrowDataset": "fastdata.datasets",
    "BucketBatchSampler": "fastdata.samplers",
    "ConversionReport": "fastdata.converters",
    "FastdataError": "fastdata.errors",
    "FormatError": "fastdata.errors",
    "HDF5Dataset": "fastdata.datasets",
    "MissingDependencyError": "fastdata.errors",
    "ProfileReport": "fastdata.profiler",
    "ProfiledLoader": "fastdata.profiler",
    "SampleError": "fastdata.errors",
    "SourceError": "fastdata.errors",
    "Tokenizer": "fastdata.tokenizers",
    "benchmark": "fastdata.compare",
    "convert_imagefolder": "fastdata.converters",
    "convert_text": "fastdata.converters",
    "make_loader": "fastdata.loader",
    "measure_loader": "fastdata.bench",
    "open_dataset": "fastdata.datasets",
    "profile": "fastdata.profiler",
    "tune_loader": "fastdata.tune",
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
