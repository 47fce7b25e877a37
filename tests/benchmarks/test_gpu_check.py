"""The GPU check (scripts/gpu-check.sh, benchmarks/gpucheck.py): its refusals without CUDA, and its CPU variant."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks import gpucheck  # noqa: E402
from benchmarks.resnet import make_resnet  # noqa: E402
from benchmarks.sections import gpu  # noqa: E402

pytestmark = pytest.mark.integration  # benchmark sections in fresh processes

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without CUDA")
PUBLISHED_PARAMETERS = {"resnet18": 11.7e6, "resnet50": 25.6e6}  # He et al. 2015; torchvision's model cards


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnets_give_1000_logits_a_gradient_everywhere_and_the_published_size(name):
    model = make_resnet(name)
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.01)
    logits = model(torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last))
    assert logits.shape == (2, 1000)
    torch.nn.functional.cross_entropy(logits, torch.tensor([3, 999])).backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def run_script(env=None):
    """Run scripts/gpu-check.sh from another folder; return the finished process."""
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh")], capture_output=True, text=True,
                          timeout=120, cwd="/", env={**os.environ, **(env or {})})


@NO_CUDA
def test_the_script_stops_at_once_without_a_cuda_device():
    if any(name.startswith("nvidia") and name[6:].isdigit() for name in os.listdir("/dev")):
        pytest.skip("this machine has an NVIDIA device node")
    finished = run_script({"PATH": "/usr/bin:/bin"})  # no nvidia-smi
    assert finished.returncode == gpucheck.NO_CUDA, finished.stderr
    assert finished.stderr.startswith("no CUDA device: ")


@NO_CUDA
@pytest.mark.parametrize("python", [{}, {"PYTHON": sys.executable}], ids=["found", "given"])
def test_the_script_refuses_a_cpu_only_torch_where_a_gpu_seems_present(tmp_path, python):
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")  # a GPU as far as the script can tell
    (tmp_path / "nvidia-smi").chmod(0o755)
    finished = run_script({"PATH": f"{tmp_path}:{os.environ['PATH']}", **python})
    assert finished.returncode == gpucheck.CPU_ONLY_TORCH, finished.stderr
    assert "CPU-only build" in finished.stderr and not finished.stdout


@NO_CUDA
def test_the_section_skips_without_cuda_and_says_why(capsys):
    class InProcess:
        def run(self, fn, *args):
            return fn(*args)

    assert gpu.run({"quick": True, "workdir": "unused", "seed": 0}, InProcess()) == {
        "skipped": "no CUDA device: torch sees none here; run bash scripts/gpu-check.sh on a machine with one"}
    assert "gpu: skipped (no CUDA device" in capsys.readouterr().out


def test_the_cuda_tests_are_the_device_file_and_each_test_that_mentions_cuda():
    ids = gpucheck.cuda_test_ids()
    assert ids[0] == "tests/loading/test_device.py" and len(ids) == len(set(ids))
    assert "tests/measure/test_profiler.py::test_cuda_sync_is_a_no_op_without_cuda" in ids
    assert not [i for i in ids[1:] if i.startswith(ids[0])]
    for node in ids[1:]:
        path, name = node.split("::", 1)
        assert f"def {name.split('::')[-1]}(" in (REPO / path).read_text()


def test_test_counts_come_from_pytest_s_own_report(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n\ndef test_passes():\n    pass\n\ndef test_fails():\n    assert False\n\n"
        "@pytest.mark.skipif(True, reason='needs CUDA')\ndef test_skips():\n    pass\n")
    counts = gpucheck.run_tests(["test_three.py"], cwd=tmp_path, timeout=60)
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (1, 1, 0, 1)
    assert counts["failures"] == ["test_three::test_fails"] and counts["returncode"] == 1
    assert counts["skip_reasons"] == {"needs CUDA": 1}
    text = gpucheck._tests_text(counts)
    assert "1 passed, 1 failed, 0 errors, 1 skipped (pytest exit status 1)" in text
    assert "- failed: `test_three::test_fails`" in text


@pytest.mark.slow  # ~40 s on 2 busy cores: six ResNet rows, each a step or two in a fresh process
def test_the_cpu_variant_measures_and_writes_every_part(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "benchmarks" / "gpucheck.py"), "--device", "cpu", "--quick", "--no-tests",
               "--workdir", str(tmp_path / "work"), "--out-dir", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["device"]["type"] == "cpu" and results["date"] and results["device"]["torch"] == torch.__version__
    assert results["tests"] == {"skipped_because": "--no-tests"} and not results["errors"]
    assert [row["key"] for row in results["copies"]] == ["loader", "pageable"]  # nothing is pinned on the CPU
    assert all(row["bytes_per_s"] > 0 and row["batch_bytes"] == 8 * 3 * 40 * 40 for row in results["copies"])
    rows = results["training"]
    assert [(row["model"], row["storage"], row["helper_process"]) for row in rows] == [
        *((model, storage, False) for model in gpu.MODELS for storage in ("model only", "raw", "jpeg")),
        (gpu.MODELS[0], "raw", True), (gpu.MODELS[0], "jpeg", True)]
    for row in rows:
        assert row["steps"] >= 1 and row["steps_per_s"] > 0 and 0 <= row["data_wait"] <= 1
        assert row["parameters"] == pytest.approx(PUBLISHED_PARAMETERS[row["model"]], rel=0.01)
    assert len(results["targets"]) == 5 and all(isinstance(t["pass"], bool) for t in results["targets"])
    markdown = (out / "results.md").read_text()
    assert markdown == results["markdown"] and "## Training steps" in markdown and "| resnet50" in markdown
    assert "## Targets" in markdown and "## Host to device" in markdown and markdown in finished.stdout
