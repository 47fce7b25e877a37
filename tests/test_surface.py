"""The public surface: what ``import fastdata`` offers, and that it ships its type hints."""

import importlib
import importlib.resources
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import fastdata
from fastdata import errors

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = {  # the README's names, plus what they return and raise
    "ArrowDataset", "BatchIndexSampler", "BucketBatchSampler", "HDF5Dataset", "Tokenizer", "convert_imagefolder",
    "convert_text", "make_loader", "open_dataset", "profile", "ConversionReport", "ProfileReport", "Field",
    "RecordDataset", "write", "TokenSequences", "mix",
}


def test_the_surface_is_the_documented_api_and_the_errors():
    error_names = {name for name, value in vars(errors).items()
                   if inspect.isclass(value) and issubclass(value, errors.FastdataError)}
    assert set(fastdata.__all__) == DOCUMENTED | error_names
    assert fastdata.__all__ == sorted(fastdata.__all__)
    for name in fastdata.__all__:
        assert getattr(fastdata, name).__name__ == name


def test_both_samplers_or_neither_and_no_internal_classes():
    assert {"BatchIndexSampler", "BucketBatchSampler"} <= set(fastdata.__all__)
    for internal in ("BatchLoader", "WorkerLoader", "EpochSampler"):
        with pytest.raises(AttributeError, match=internal):
            getattr(fastdata, internal)
    assert not set(fastdata._MOVED) & set(fastdata.__all__)


@pytest.mark.parametrize("name, home", [("ProfiledLoader", "fastdata.measure.profiler"),
                                        ("benchmark", "fastdata.measure.bench"),
                                        ("measure_loader", "fastdata.measure.engine"),
                                        ("tune_loader", "fastdata.measure.tune")])
def test_names_exported_before_still_resolve_with_a_warning(name, home):
    with pytest.warns(DeprecationWarning, match=home):
        value = getattr(fastdata, name)
    assert value is getattr(importlib.import_module(home), name)


def test_every_error_is_also_the_matching_builtin():
    for name in ("FormatError", "SampleError", "SourceError", "OptionError"):
        assert issubclass(getattr(errors, name), ValueError)
    assert issubclass(errors.NotFoundError, FileNotFoundError)
    assert issubclass(errors.OutputExistsError, FileExistsError)
    assert issubclass(errors.MissingDependencyError, ImportError)


@pytest.mark.integration
def test_import_fastdata_loads_no_torch():
    code = "import sys, fastdata; fastdata.__all__; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["make_loader", "open_dataset", "convert_imagefolder", "convert_text", "profile"])
def test_public_functions_have_type_hints(name):
    signature = inspect.signature(getattr(fastdata, name))
    assert all(p.annotation is not inspect.Parameter.empty for p in signature.parameters.values())
    assert signature.return_annotation is not inspect.Signature.empty


def test_converters_take_their_source_first_by_the_same_name():
    for convert in (fastdata.convert_imagefolder, fastdata.convert_text):
        assert list(inspect.signature(convert).parameters)[:2] == ["src", "out"]


def test_the_package_ships_py_typed():
    assert importlib.resources.files("fastdata").joinpath("py.typed").is_file()
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["fastdata"]
