"""The GPU check (scripts/gpu-check.sh): the CUDA tests, then the gpu section's copies and training steps.

Run from the repository root on a machine with an NVIDIA GPU:

    bash scripts/gpu-check.sh                        # picks the Python, then runs this
    python benchmarks/gpucheck.py                    # the same, with this Python
    python benchmarks/gpucheck.py --device cpu --quick --no-tests   # the measurements on the CPU, tiny

Writes ``results.json`` and ``results.md`` into --out-dir (default
benchmarks/results/gpu; on the CPU benchmarks/results/tmp/gpu-cpu) after
each stage, so a run cut short leaves what it measured, and prints the
Markdown. The CUDA tests are tests/loading/test_device.py and every other
test whose source or decorators mention CUDA (found with ``ast``), run by
pytest with the slow ones included.

Exit status: 0 everything ran and every test passed (a target may still miss:
read the table), 1 a test or a measurement failed, 3 no CUDA device,
4 torch here is a build without CUDA.
"""

import argparse
import ast
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)
if __name__ == "__main__":  # run as a script: import the suite as benchmarks.*, as run.py does
    sys.path[:] = [REPO, *(path for path in sys.path if os.path.abspath(path or ".") != BENCHMARKS)]
RESULTS = os.path.join(REPO, "benchmarks", "results")
DEVICE_TESTS = "tests/loading/test_device.py"
TESTS_TIMEOUT = 300  # seconds for the whole pytest run (about 30 s on 2 CPU cores, CUDA tests skipped)
NO_CUDA, CPU_ONLY_TORCH = 3, 4  # exit statuses


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to measure (default cuda)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a step or two per row: a smoke test")
    parser.add_argument("--precision", choices=("bf16", "fp32"),
                        help="training precision (default: bf16 autocast on cuda, fp32 on cpu)")
    parser.add_argument("--no-tests", action="store_true", help="skip the CUDA tests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic photos and the orders")
    parser.add_argument("--workdir", default=os.path.join(RESULTS, "tmp"), help="cache of photos and packed files")
    parser.add_argument("--out-dir", help="where results.json and results.md go")
    args = parser.parse_args(argv)
    if args.out_dir is None:
        args.out_dir = os.path.join(RESULTS, "gpu" if args.device == "cuda" else os.path.join("tmp", "gpu-cpu"))
    return args


def cuda_problem():
    """Return ``(exit status, message)`` where this Python cannot use a CUDA device, else None."""
    import torch

    if torch.version.cuda is None:
        return CPU_ONLY_TORCH, (f"torch {torch.__version__} at {os.path.dirname(torch.__file__)} is a CPU-only build "
                                "(torch.version.cuda is None): use a Python whose torch is built with CUDA")
    if not torch.cuda.is_available():
        return NO_CUDA, (f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return None


def cuda_test_ids(repo=REPO):
    """Return the pytest ids to run: tests/loading/test_device.py, and each test elsewhere that mentions CUDA."""
    ids = [DEVICE_TESTS]
    for root, _, names in sorted(os.walk(os.path.join(repo, "tests"))):
        for name in sorted(names):
            path = os.path.relpath(os.path.join(root, name), repo)
            if name.startswith("test_") and name.endswith(".py") and path != DEVICE_TESTS:
                ids += _mentioning_cuda(path, repo)
    return ids


def _mentioning_cuda(path, repo):
    with open(os.path.join(repo, path), encoding="utf-8") as f:
        source = f.read()
    if "cuda" not in source.lower():
        return []
    ids = []
    for node in ast.parse(source).body:
        functions = [(node.name + "::", child) for child in node.body] if isinstance(node, ast.ClassDef) else [
            ("", node)]
        for prefix, function in functions:
            if isinstance(function, ast.FunctionDef) and function.name.startswith("test"):
                text = "".join(ast.get_source_segment(source, part) for part in (*function.decorator_list, function))
                if "cuda" in text.lower():
                    ids.append(f"{path}::{prefix}{function.name}")
    return ids


def run_tests(ids, cwd=REPO, timeout=TESTS_TIMEOUT):
    """Run ``ids`` with pytest (slow tests included) in a new process group; return its counts.

    Returns:
        dict: ``ids``, ``passed``, ``failed``, ``errors``, ``skipped``, ``failures`` (the ids of failed or
        erroring tests), ``skip_reasons``, ``returncode`` (None where it ran past ``timeout``), ``seconds``
        and the output's last lines.
    """
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        # no:benchmark: a GPU image's pytest-benchmark warns under xdist, and filterwarnings=error made that an
        # INTERNALERROR before any test ran (the first check, on an H200)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:benchmark",
                   "-m", "slow or not slow",
                   f"--junitxml={junit}", *ids]
        process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        timed_out = False
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # pytest and every process its tests started
            output, timed_out = process.communicate()[0], True
        counts = _junit_counts(junit) if os.path.exists(junit) else {}
    passed = counts.get("total", 0) - sum(counts.get(key, 0) for key in ("failed", "errors", "skipped"))
    return {"ids": ids, "passed": passed, "failed": counts.get("failed", 0), "errors": counts.get("errors", 0),
            "skipped": counts.get("skipped", 0), "failures": counts.get("failures", []),
            "skip_reasons": counts.get("skip_reasons", {}), "returncode": None if timed_out else process.returncode,
            "seconds": time.perf_counter() - started, "output_tail": output.splitlines()[-15:]}


def _junit_counts(path):
    """Return the totals, failed ids and skip reasons of a pytest JUnit XML report."""
    counts = {"total": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skip_reasons": {}}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        counts["total"] += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                counts[key] += 1
                if key == "skipped":
                    reason = found.get("message", "")
                    counts["skip_reasons"][reason] = counts["skip_reasons"].get(reason, 0) + 1
                else:
                    counts["failures"].append(name)
                break
    return counts


def describe_device(device):
    """Return the device, torch, CUDA and cuDNN versions (in a fresh process: it starts CUDA)."""
    import torch

    info = {"type": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0]}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=torch.cuda.get_device_name(0), capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    else:
        info["name"] = "CPU"
    from fastdata.measure.machine import installed_version

    info["simplejpeg"] = installed_version("simplejpeg")  # the JPEG decoder: Pillow without it
    return info


def markdown(results):
    """Return the check's report as Markdown."""
    from benchmarks.report import targets_table

    device, setup = results["device"], results.get("setup", {})
    lines = ["# fastdata GPU check", "",
             f"{results['date']}: {device.get('name')}, torch {device.get('torch')}, CUDA {device.get('cuda')}, "
             f"cuDNN {device.get('cudnn')}, Python {device.get('python')}, {device.get('cpu_count')} CPUs, "
             f"simplejpeg {device.get('simplejpeg') or 'absent (Pillow decodes)'}; "
             f"`{results['command']}`, {results.get('seconds', 0):.0f} s.", ""]
    if "ids" in results.get("tests", {}):
        lines += [_tests_text(results["tests"]), ""]
    if results.get("targets"):
        passed = sum(target["pass"] for target in results["targets"])
        lines += [f"## Targets ({passed} of {len(results['targets'])} pass)", "", targets_table(results["targets"]), ""]
    for key, title in (("copies", "Host to device"), ("host", "Host reads alone"), ("training", "Training steps")):
        if key in results.get("tables", {}):
            lines += [f"## {title}", "", results["tables"][key], ""]
    if setup:
        lines += [f"Setup: {setup}", ""]
    lines += [f"- {stage} FAILED: {error.splitlines()[-1]}" for stage, error in results.get("errors", {}).items()]
    return "\n".join(lines).rstrip() + "\n"


def _tests_text(tests):
    """Return the CUDA tests' counts, failures and skip reasons as Markdown (pytest's last lines where it failed)."""
    status = {0: "", None: f" (cut at {TESTS_TIMEOUT} s)"}.get(tests["returncode"],
                                                                f" (pytest exit status {tests['returncode']})")
    lines = [f"CUDA tests ({len(tests['ids'])} ids, pytest, {tests['seconds']:.0f} s): {tests['passed']} passed, "
             f"{tests['failed']} failed, {tests['errors']} errors, {tests['skipped']} skipped{status}"]
    lines += [f"- failed: `{name}`" for name in tests["failures"]]
    lines += [f"- skipped ({count}): {reason}" for reason, count in tests["skip_reasons"].items()]
    if tests["returncode"] != 0:
        lines += ["", "```", *tests["output_tail"], "```"]
    return "\n".join(lines)


def write(results, out_dir):
    """Write results.json and results.md (the Markdown kept in the JSON too) into ``out_dir``."""
    from fastdata.measure.tables import write_json

    os.makedirs(out_dir, exist_ok=True)
    results["markdown"] = markdown(results)
    write_json(results, os.path.join(out_dir, "results.json"))
    with open(os.path.join(out_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write(results["markdown"])


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and (problem := cuda_problem()):
        print(problem[1], file=sys.stderr)
        return problem[0]
    from benchmarks.fresh import FreshProcesses
    from benchmarks.report import finish
    from benchmarks.sections import gpu

    started = time.perf_counter()
    command = "python benchmarks/gpucheck.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {"check": "fastdata GPU check (scripts/gpu-check.sh, benchmarks/gpucheck.py)", "command": command.strip(),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "errors": {}}
    with FreshProcesses() as fresh:
        results["device"] = device = fresh.run(describe_device, args.device)
        print(f"{device['name']}, torch {device['torch']}, CUDA {device['cuda']}", flush=True)
        if args.no_tests:
            results["tests"] = {"skipped_because": "--no-tests"}
        else:
            print(f"running the CUDA tests (pytest, at most {TESTS_TIMEOUT} s)...", flush=True)
            results["tests"] = run_tests(cuda_test_ids())
        write(results, args.out_dir)
        print("measuring copies and training steps...", flush=True)
        try:
            setup = gpu.make_setup(args.device, args.quick, args.seed, args.precision)
            results.update(gpu.measure(os.path.abspath(args.workdir), setup, fresh))
            results["targets"] = [finish(target, "gpu") for target in results["targets"]]
        except Exception:
            results["errors"]["measure"] = traceback.format_exc()
            print(results["errors"]["measure"], file=sys.stderr)
    results["seconds"] = time.perf_counter() - started
    write(results, args.out_dir)
    print("\n" + results["markdown"] + f"\nwrote {os.path.join(args.out_dir, 'results.{json,md}')}")
    tests_failed = "ids" in results["tests"] and results["tests"]["returncode"] != 0  # None: cut at the timeout
    return 1 if tests_failed or results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
