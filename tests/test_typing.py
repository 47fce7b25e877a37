"""The public API is typed for mypy: a user's script that misuses it is flagged, one that uses it is clean."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration  # type checkers in subprocesses

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD = """
    import torch

    from fastdata import ProfileReport, make_loader, open_dataset, profile


    def train(path: str) -> ProfileReport:
        loader = profile(make_loader(open_dataset(path), batch_size=32, shuffle=True, num_workers=2))
        for images, labels in loader:
            assert isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor)
        return loader.report()
"""
BAD = """
    from fastdata import make_loader, open_dataset

    loader = make_loader(open_dataset("train.h5"), batch_size="32", shufle=True)
"""


@pytest.fixture(scope="module")
def mypy(tmp_path_factory):
    """Return ``run(folder, *args)``: mypy on ``args`` from ``folder``, as a user runs it (one cache: torch once)."""
    pytest.importorskip("mypy")
    cache = tmp_path_factory.mktemp("mypy-cache")

    def run(folder, *args):
        return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--follow-imports=silent",
                               *args], cwd=folder, capture_output=True, text=True, timeout=600)

    return run


def user_script(folder, source):
    script = folder / "user.py"
    script.write_text(textwrap.dedent(source))
    return str(script)


def test_a_script_using_the_public_api_type_checks_strict(mypy, tmp_path):
    # run from the script's folder: fastdata is found where pip installed it
    result = mypy(tmp_path, "--strict", user_script(tmp_path, GOOD))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_misspelled_keyword_and_a_wrong_type_are_flagged(mypy, tmp_path):
    result = mypy(tmp_path, "--strict", user_script(tmp_path, BAD))
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'Unexpected keyword argument "shufle" for "make_loader"; did you mean "shuffle"?' in result.stdout
    assert 'Argument "batch_size" to "make_loader" has incompatible type "str"; expected "int"' in result.stdout


def test_the_examples_type_check(mypy, tmp_path):
    examples = os.path.join(REPO, "examples")
    scripts = sorted(os.path.join(examples, name) for name in os.listdir(examples) if name.endswith(".py"))
    result = mypy(tmp_path, "--ignore-missing-imports", *scripts)
    assert result.returncode == 0, result.stdout + result.stderr
