"""fastdata.measure.tune, `fastdata tune`, make_loader(num_workers="auto"): search logic on fake rates, not speed."""

import json
import os
import shutil
import warnings

import pytest
import torch
from support import run_cli

from fastdata import make_loader, open_dataset
from fastdata.loading.batchloader import BatchLoader
from fastdata.loading.recommendation import read_recommendation, tune_json_path
from fastdata.loading.workers import WorkerLoader
from fastdata.measure.engine import Rate, close_loader
from fastdata.measure.tune import (
    DEFAULTS,
    TuneResult,
    search,
    tune_loader,
    write_tune_json,
)


@pytest.fixture
def small_raw(small_photos):
    """The raw .h5 file of ``small_photos`` (read-only: copy it to write a tune file beside it)."""
    return small_photos[1]["raw"]


@pytest.fixture
def private(small_raw, tmp_path):
    """A private copy of ``small_raw``, to tune and touch."""
    path = tmp_path / "photos.h5"
    shutil.copyfile(small_raw, path)
    return path


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Clock:
    """A fake monotonic clock that fake measurements advance."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def fake(rates, clock=None, cost=1.0, default=100.0):
    """Return ``measure(settings, max_seconds)`` reading samples/s from ``rates(settings)`` (or a dict)."""
    calls = []

    def measure(settings, max_seconds):
        calls.append((settings, max_seconds))
        if clock is not None:
            clock.now += cost
        value = rates(settings) if callable(rates) else rates.get(settings["num_workers"], default)
        return Rate(value)

    measure.calls = calls
    return measure


def measured(outcome, key, **fixed):
    """Return ``key`` of each search trial (the confirmation left out) whose settings match ``fixed``."""
    trials = [t for t in outcome["trials"] if t["phase"] != "confirm"]
    return [t[key] for t in trials if all(t[k] == v for k, v in fixed.items())]


# ---------------------------------------------------------------- search logic


def test_workers_search_stops_after_the_peak():
    curve = {0: 100, 1: 60, 2: 120, 4: 200, 8: 190, 16: 150}
    outcome = search(fake(curve), budget=100, batch_sizes=None, max_workers=16)
    assert measured(outcome, "num_workers", prefetch_factor=2) == [0, 1, 2, 4, 8]  # never 16
    assert outcome["recommended"]["num_workers"] == 4 and outcome["stopped_early"] is None


def test_in_process_wins_when_workers_cannot_catch_up():
    curve = {0: 1_000_000, 1: 30_000, 2: 35_000, 4: 36_000}  # raw storage: workers pay a copy per batch
    outcome = search(fake(curve), budget=100, batch_sizes=None, max_workers=4)
    assert measured(outcome, "num_workers", prefetch_factor=2) == [0, 1]  # even 4x of 30k cannot beat 1M
    assert outcome["recommended"]["num_workers"] == 0


def test_a_worker_within_threshold_of_in_process_is_not_chosen():
    outcome = search(fake({0: 100, 1: 80, 2: 103}), budget=100, batch_sizes=None, max_workers=2)
    assert outcome["recommended"]["num_workers"] == 0  # 3% faster is noise: fewer workers win


def test_batch_size_doubles_while_it_improves():
    curve = {64: 100, 128: 150, 256: 200, 512: 205, 1024: 400}
    outcome = search(fake(lambda s: curve[s["batch_size"]]), budget=100, max_workers=0)
    assert measured(outcome, "batch_size", num_workers=0, prefetch_factor=2) == [256, 64, 128, 512]  # no 1024
    assert outcome["recommended"]["batch_size"] == 256  # 512 is within 5%: the smaller batch


def test_batch_sizes_that_do_not_fit_are_skipped():
    outcome = search(fake(lambda s: s["batch_size"]), budget=100, max_workers=0,
                     fits=lambda s: s["batch_size"] <= 128)
    assert set(measured(outcome, "batch_size")) == {256, 64, 128}  # 256: the defaults, always measured


@pytest.mark.parametrize("rates, chosen", [({1: 100, 2: 100, 4: 100}, 2), ({1: 100, 2: 100, 4: 110}, 4),
                                          ({1: 120, 2: 100, 4: 90}, 1)])
def test_prefetch_keeps_the_default_unless_another_is_faster(rates, chosen):
    outcome = search(fake(lambda s: rates[s["prefetch_factor"]]), budget=100, batch_sizes=None, max_workers=0)
    assert sorted(measured(outcome, "prefetch_factor")) == [1, 2, 4]
    assert outcome["recommended"]["prefetch_factor"] == chosen


def test_pin_memory_is_searched_only_with_cuda():
    without = search(fake({}), budget=100, batch_sizes=None, max_workers=0)
    assert set(measured(without, "pin_memory")) == {False} and without["recommended"]["pin_memory"] is False
    start = {**DEFAULTS, "pin_memory": True}
    rates = lambda s: 100 if s["pin_memory"] else 200  # noqa: E731
    with_cuda = search(fake(rates), budget=100, start=start, batch_sizes=None, max_workers=0, cuda=True)
    assert set(measured(with_cuda, "pin_memory")) == {True, False}
    assert with_cuda["recommended"]["pin_memory"] is False


def test_budget_is_respected_and_the_best_so_far_recommended():
    clock = Clock()
    measure = fake({0: 100, 1: 150, 2: 290, 4: 560}, clock, cost=1.0)
    outcome = search(measure, budget=4.5, max_workers=4, clock=clock)
    assert len(outcome["trials"]) == 4 and clock.now <= 4.5
    assert outcome["stopped_early"] and "budget" in outcome["stopped_early"]
    recommended = outcome["recommended"]
    assert any(all(t[k] == recommended[k] for k in DEFAULTS) for t in outcome["trials"])  # a measured setting
    assert all(max_seconds <= 4.5 - i for i, (_, max_seconds) in enumerate(measure.calls))


def test_a_winner_is_confirmed_against_the_start():
    curve = {0: 100, 1: 60, 2: 120, 4: 200, 8: 190}
    outcome = search(fake(curve), budget=100, batch_sizes=None, max_workers=8)
    confirm = [(t["num_workers"], t["samples_per_s"]) for t in outcome["trials"] if t["phase"] == "confirm"]
    assert confirm == [(4, 200), (0, 100)] and outcome["recommended"]["num_workers"] == 4
    assert outcome["confirmation"].startswith("confirmed")


def test_a_lucky_trial_is_not_confirmed():
    seen = []

    def rates(settings):  # 4 workers look fast once, then as fast as in-process
        seen.append(settings["num_workers"])
        return {0: 100, 1: 60, 2: 120, 8: 100}.get(settings["num_workers"], 300 if seen.count(4) == 1 else 101)

    outcome = search(fake(rates), budget=100, batch_sizes=None, max_workers=8)
    assert seen.count(4) >= 2 and outcome["recommended"] == DEFAULTS
    assert outcome["confirmation"].startswith("rejected") and "num_workers=4" in outcome["confirmation"]


def test_the_first_trial_runs_whatever_the_budget():
    clock = Clock()
    outcome = search(fake({}, clock, cost=5.0), budget=1, max_workers=4, clock=clock)
    assert len(outcome["trials"]) == 1 and outcome["recommended"] == DEFAULTS and outcome["stopped_early"]


def test_search_is_deterministic_given_the_rates():
    def rates(s):
        return s["batch_size"] * (1 + s["num_workers"]) / (1 + abs(s["prefetch_factor"] - 4))

    first, second = (search(fake(rates, clock), budget=100, max_workers=8, clock=clock) for clock in (Clock(), Clock()))
    assert first == second and len(first["trials"]) > 5


# ---------------------------------------------------------------- tune_loader and its JSON


def tuned(path, curve, **options):
    """Run tune_loader on ``path`` with fake rates by num_workers; return the TuneResult."""
    return tune_loader(path, budget=100, measure=fake(curve), max_workers=2, **options)


def test_tune_loader_result(private, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as without CUDA: pin_memory is not searched
    result = tuned(private, {0: 100, 1: 300, 2: 200})  # as fast at any batch size: the smallest tried wins
    assert result.recommended == {"batch_size": 64, "num_workers": 1, "prefetch_factor": 2, "pin_memory": False}
    assert result.call() == "make_loader(dataset, batch_size=64, num_workers=1, prefetch_factor=2, pin_memory=False)"
    assert result.file["size"] == os.path.getsize(private) and result.file["num_samples"] == 12
    assert result.search["pin_memory"] == "n/a (no CUDA)"
    assert result.call() in str(result)
    saved = json.loads(json.dumps(result.to_dict()))
    assert set(saved) >= {"file", "machine", "trials", "recommended", "call"}


def test_tune_loader_keeps_a_given_batch_size(private):
    result = tuned(private, {}, batch_size=32)
    assert {t["batch_size"] for t in result.trials} == {32} and result.recommended["batch_size"] == 32


# ---------------------------------------------------------------- make_loader(num_workers="auto")


def test_auto_without_a_tune_file_reads_in_process(private):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = make_loader(open_dataset(private), 4, num_workers="auto")
    assert isinstance(loader, BatchLoader) and loader.prefetch_factor == 2


def test_auto_uses_the_saved_recommendation(private):
    write_tune_json(tuned(private, {0: 100, 1: 300, 2: 200}), tune_json_path(private))
    dataset = open_dataset(private)
    loader = make_loader(dataset, 4, num_workers="auto", multiprocessing_context="fork")
    assert isinstance(loader, WorkerLoader) and loader.num_workers == 1 and loader.prefetch_factor == 2
    assert sum(len(labels) for _, labels in loader) == len(dataset)
    close_loader(loader)
    given = make_loader(dataset, 4, num_workers="auto", prefetch_factor=3, multiprocessing_context="fork")
    assert given.prefetch_factor == 3  # a given prefetch_factor wins


def test_auto_keeps_the_recommended_workers_within_max_cpu(private, monkeypatch):
    monkeypatch.setattr("fastdata.loading.loader.usable_cpus", lambda: 4)
    write_tune_json(tuned(private, {0: 100, 1: 200, 2: 300}), tune_json_path(private))
    dataset = open_dataset(private)
    for max_cpu, workers in ((None, 2), (0.5, 2), (0.25, 1)):
        loader = make_loader(dataset, 4, num_workers="auto", max_cpu=max_cpu, multiprocessing_context="fork")
        assert loader.num_workers == workers
        close_loader(loader)


def test_auto_ignores_a_tune_file_of_another_file(private, small_raw, tmp_path):
    other = tmp_path / "other.h5"
    shutil.copyfile(small_raw, other)
    os.utime(other, ns=(0, 10**18))  # same size, another modification time
    write_tune_json(tuned(private, {1: 300}), tune_json_path(private))
    shutil.copyfile(tune_json_path(private), tune_json_path(other))
    with pytest.warns(UserWarning, match="different 'other.h5'"):
        loader = make_loader(open_dataset(other), 4, num_workers="auto")
    assert isinstance(loader, BatchLoader)


def test_auto_ignores_a_tune_file_once_the_file_changes(private):
    write_tune_json(tuned(private, {1: 300}), tune_json_path(private))
    stat = os.stat(private)
    os.utime(private, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.warns(UserWarning, match="re-run"):
        assert read_recommendation(private) is None


@pytest.mark.parametrize("content, match", [("not json", "cannot read"), ("[]", "cannot read"),
                                            (None, "non-negative integers")])
def test_auto_ignores_a_broken_tune_file(private, content, match):
    if content is None:  # the right file, a bad value
        write_tune_json(tuned(private, {}), tune_json_path(private))
        saved = read_json(tune_json_path(private))
        saved["recommended"]["num_workers"] = -2
        content = json.dumps(saved)
    with open(tune_json_path(private), "w") as f:
        f.write(content)
    with pytest.warns(UserWarning, match=match):
        loader = make_loader(open_dataset(private), 4, num_workers="auto")
    assert isinstance(loader, BatchLoader)


def test_auto_on_a_dataset_without_a_path_reads_in_process(private):
    class Pathless:
        def __init__(self, dataset):
            self.read_batch, self._len = dataset.read_batch, len(dataset)

        def __len__(self):
            return self._len

    assert isinstance(make_loader(Pathless(open_dataset(private)), 4, num_workers="auto"), BatchLoader)


# ---------------------------------------------------------------- fastdata tune


@pytest.mark.slow
def test_cli_tune_prints_trials_and_saves_beside_the_file(private):
    result = run_cli("tune", private, "--budget", "3s", "--max-workers", "1")
    assert result.exit_code == 0, result.output
    assert "defaults" in result.output and "samples/s" in result.output
    assert "recommended: make_loader(dataset, batch_size=" in result.output
    saved = read_json(tune_json_path(private))
    assert saved["file"]["path"] == os.path.abspath(private) and saved["trials"]
    assert set(saved["recommended"]) == set(DEFAULTS) and saved["machine"]["cuda"] is torch.cuda.is_available()
    assert saved["elapsed_seconds"] > 0 and read_recommendation(private) == saved["recommended"]


@pytest.mark.slow
def test_cli_tune_of_a_shard_folder_saves_beside_it_and_auto_reads_it(shard_converted, tmp_path):
    folder = tmp_path / "shards"
    shutil.copytree(shard_converted("hdf5", "raw"), folder)
    result = run_cli("tune", folder, "--budget", "2s", "--max-workers", "1")
    assert result.exit_code == 0, result.output
    assert tune_json_path(folder) == str(tmp_path / "shards.tune.json")
    saved = read_json(tune_json_path(folder))
    assert read_recommendation(folder) == saved["recommended"]
    os.utime(folder / "index.json", ns=(0, 10**18))  # a new conversion writes a new index
    with pytest.warns(UserWarning, match="re-run"):
        assert read_recommendation(folder) is None


def test_cli_tune_does_not_overwrite_without_flag(private, tmp_path, monkeypatch):
    monkeypatch.setattr("fastdata.measure.tune.tune_loader", lambda path, **options: tuned(path, {}))
    out = tmp_path / "t.json"
    assert run_cli("tune", private, "--json", out).exit_code == 0
    again = run_cli("tune", private, "--json", out)
    assert again.exit_code == 1 and "already exists" in again.output and "--overwrite" in again.output
    assert run_cli("tune", private, "--json", out, "--overwrite").exit_code == 0


@pytest.mark.parametrize("text, seconds", [("60", 60), ("60s", 60), ("2m", 120), ("1.5min", 90), (" 45 S ", 45)])
def test_cli_tune_budget(private, tmp_path, monkeypatch, text, seconds):
    budgets = []

    def record(path, budget, **options):
        budgets.append(budget)
        return tuned(path, {})

    monkeypatch.setattr("fastdata.measure.tune.tune_loader", record)
    result = run_cli("tune", private, "--budget", text, "--json", tmp_path / "t.json")
    assert result.exit_code == 0, result.output
    assert budgets == [seconds]


@pytest.mark.parametrize("text", ["soon", "0s", "-5", "10 hours"])
def test_cli_tune_rejects_bad_budgets(private, text):
    result = run_cli("tune", private, "--budget", text)
    assert result.exit_code == 1 and "--budget should be a positive duration" in result.output
    assert not os.path.exists(tune_json_path(private))


def test_tune_result_str_names_an_early_stop():
    trials = [{**DEFAULTS, "phase": "defaults", "samples_per_s": 10.0, "seconds": 1.0}]
    result = TuneResult({}, {}, trials, dict(DEFAULTS), 1.0, 2.0, "out of time", {"confirmation": "rejected: x"})
    assert "stopped early: out of time" in str(result) and "best settings rejected: x" in str(result)
