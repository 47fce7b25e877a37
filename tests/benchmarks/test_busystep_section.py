"""The busy-step section: its GIL-holding step, and a tiny real run of every loader beside it."""

import math
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks.fresh import FreshProcesses  # noqa: E402
from benchmarks.sections import busystep  # noqa: E402


class Counter:
    """A thread counting in Python as fast as it can, until stopped."""

    def __init__(self):
        self.count, self._stop = 0, False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop:
            self.count += 1

    def __enter__(self):
        self._thread.start()
        while self.count == 0:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc_info):
        self._stop = True
        self._thread.join()

    def during(self, fn, *args):
        """Return ``(counts while fn ran, seconds it took)``."""
        before, started = self.count, time.perf_counter()
        fn(*args)
        return self.count - before, time.perf_counter() - started


def test_the_busy_step_holds_the_gil_where_a_sleep_releases_it():
    # below the switch interval a waiting thread gets the GIL only where the step gives it up
    units = busystep.calibrate(sys.getswitchinterval() / 2)
    beside_step, beside_sleep = 0, 0
    with Counter() as counter:
        for _ in range(15):  # interleaved, so both see the same machine
            counted, seconds = counter.during(busystep.hold_gil, units)
            beside_step += counted
            beside_sleep += counter.during(time.sleep, seconds)[0]
    assert beside_step < 0.5 * beside_sleep, (beside_step, beside_sleep)


def test_calibrated_steps_are_named_and_counted():
    units = busystep.calibrate_steps((("hold", 1), ("sleep", 1)))
    assert list(units) == ["holds GIL 1 ms"] and units["holds GIL 1 ms"] >= 1
    steps = busystep._steps({"steps": (("hold", 1), ("sleep", 1)), "units": units})
    assert list(steps) == ["holds GIL 1 ms", "sleeps 1 ms"]
    assert steps["holds GIL 1 ms"]() == units["holds GIL 1 ms"] * (4 + 4 + 1 + sum(range(busystep.PY_OPS)))


def test_a_missing_peer_is_named_with_how_to_install_it(monkeypatch):
    monkeypatch.setattr(busystep, "installed_version", lambda package: None)
    assert busystep.peer_missing("SPDL") == "not installed: pip install -c constraints.txt spdl"
    assert busystep.peer_missing("fastdata defaults") is None


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    # two small files, two steps, three rounds: ~60 s on 2 busy cores
    patch = pytest.MonkeyPatch()
    patch.setattr(busystep, "FILES", (("64px raw", 64, "raw"), ("64px jpeg", 64, "jpeg")))
    patch.setattr(busystep, "STEPS", (("hold", 2), ("sleep", 5)))
    config = {"quick": True, "num_images": 200, "batch_size": 64, "workers": 2, "repeats": 3, "min_seconds": 0.05,
              "seed": 0, "workdir": str(tmp_path_factory.mktemp("work"))}
    try:
        with FreshProcesses() as fresh:
            yield busystep.run(config, fresh)
    finally:
        patch.undo()


@pytest.mark.slow
def test_every_loader_is_timed_beside_every_step_with_plausible_figures(section):
    loaders = [name for name in busystep.LOADERS if name not in section["missing"]]
    assert [(row["file"], row["loader"]) for row in section["rows"]] == [
        (file, name) for file in ("64px raw", "64px jpeg") for name in loaders]
    kept = []
    for row in section["rows"]:
        assert list(row["steps"]) == ["holds GIL 2 ms", "sleeps 5 ms"]
        for figures in row["steps"].values():
            rounds = figures["kept_rounds"]
            assert len(rounds) == 3 and all(math.isfinite(r) and r > 0 for r in rounds)
            assert min(rounds) <= figures["kept"] <= max(rounds)
            assert 0 <= figures["wait_share"] < 1 and figures["steps_per_s"] > 0
            assert math.isfinite(figures["cpu_per_1k_loader"]) and figures["cpu_per_1k_all"] > 0
            kept.append(figures["kept"])
    # one share may pass 1.5 on a loaded machine (a loop-alone pass slowed by other processes);
    # a loop alone slowed by its own loader would lift them all
    assert 0 < statistics.median(kept) <= 1.5, kept
    ceiling = section["ceilings"]["64px jpeg"]["steps"]
    assert list(section["ceilings"]) == ["64px jpeg"] and all(0 < s["ceiling"] <= 1 for s in ceiling.values())


@pytest.mark.slow
def test_the_tables_and_targets_name_every_row(section):
    text = section["text"]
    for header in ("step rate kept", "data wait", "CPU s / 1k img (all)", "### 64px raw", "### 64px jpeg",
                   "loop alone (batch in memory)", "ceiling: spare cores"):
        assert header in text
    assert all(f"| {name} " in text for name in busystep.LOADERS if name not in section["missing"])
    names = [target["name"] for target in section["targets"]]
    assert "busy step 64px raw, GIL held 5 ms: make_loader defaults' step rate kept" not in names  # no 5 ms step here
    assert sum("/ the ceiling" in name for name in names) == 2
    assert all(math.isfinite(target["value"]) and target["threshold"] > 0 for target in section["targets"])
