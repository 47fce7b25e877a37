"""profile(): the arithmetic of waits and bodies on loops with known sleeps, and a real packed loader.

Sleeps are 20-40 ms and bounds are loose (a sleep lasts at least its time,
and a busy shared machine only makes it longer), so the tests do not flake.
"""

import dataclasses
import gc
import time

import numpy as np
import pytest
import torch

import fastdata
from fastdata import HDF5Dataset, ProfileReport, convert_imagefolder, make_loader
from fastdata.measure.profiler import WAIT_LABEL, ProfiledLoader
from fastdata.measure.synthetic import make_imagefolder

WAIT = 0.02  # seconds the fake loader sleeps before each batch
BODY = 0.04  # seconds the loop body sleeps
BATCH_SIZE = 8


class SleepyLoader:
    """Yield ``num_batches`` batches ``(x float [B, 2], y int64 [B])``, sleeping ``wait`` s before each.

    The first batch sleeps ``first`` s instead, where given (a slow start-up).
    """

    def __init__(self, num_batches, wait=WAIT, first=None, batch_size=BATCH_SIZE):
        self.num_batches, self.wait, self.first, self.batch_size = num_batches, wait, first, batch_size
        self.served = 0  # batches handed out over all passes

    def __len__(self):
        return self.num_batches

    def __iter__(self):
        for index in range(self.num_batches):
            time.sleep(self.first if index == 0 and self.first is not None else self.wait)
            self.served += 1
            yield torch.full((self.batch_size, 2), float(index)), torch.arange(self.batch_size)


def run_loop(loader, body=BODY, stop_after=None):
    """Iterate ``loader`` sleeping ``body`` s per batch; return the batches seen (break after ``stop_after``)."""
    seen = []
    for batch in loader:
        time.sleep(body)
        seen.append(batch)
        if stop_after is not None and len(seen) == stop_after:
            break
    return seen


def assert_timed(report, batches, wait, body, first=None):
    """Check the report's sums against the sleeps: never below them, at most a loose bound above."""
    first = wait if first is None else first
    assert report.batches == batches
    assert first * 0.9 <= report.first_batch_seconds <= first + 0.5
    assert (batches - 1) * wait * 0.9 <= report.wait_seconds <= (batches - 1) * wait + 0.5
    assert batches * body * 0.9 <= report.body_seconds <= batches * body + 0.5


# ---------------------------------------------------------------- arithmetic


def test_waits_and_bodies_add_up_with_known_sleeps():
    profiled = fastdata.profile(SleepyLoader(6, first=0.03))
    seen = run_loop(profiled)
    report = profiled.report()
    assert len(seen) == 6
    assert_timed(report, batches=6, wait=WAIT, body=BODY, first=0.03)
    steady = report.wait_seconds + report.body_seconds
    assert report.samples == 6 * BATCH_SIZE
    assert report.total_seconds == pytest.approx(report.first_batch_seconds + steady)
    assert report.data_bound_fraction == pytest.approx(report.wait_seconds / steady)
    assert report.batches_per_s == pytest.approx(6 / steady)
    assert report.samples_per_s == pytest.approx(6 * BATCH_SIZE / steady)
    # 5 waits of 20 ms against 6 bodies of 40 ms: 100 / 340 = 0.29
    assert report.data_bound_fraction == pytest.approx(0.1 / 0.34, abs=0.1)
    assert WAIT * 0.9 <= report.wait_p50_seconds <= report.wait_p95_seconds <= 0.5


def test_first_batch_wait_is_startup_and_left_out_of_the_fraction():
    profiled = fastdata.profile(SleepyLoader(4, wait=0.0, first=0.15))
    run_loop(profiled, body=0.02)
    report = profiled.report()
    assert report.first_batch_seconds >= 0.15 * 0.9
    assert report.wait_seconds < 0.05  # later batches come at once
    assert report.data_bound_fraction < 0.5
    assert report.total_seconds >= 0.15 + 4 * 0.02 * 0.9
    assert f"first batch {report.first_batch_seconds:.2f}s" in str(report)


def test_yields_exactly_the_loaders_batches_and_passes_len_through():
    loader = SleepyLoader(3, wait=0.0)
    profiled = fastdata.profile(loader)
    assert isinstance(profiled, ProfiledLoader)
    assert len(profiled) == 3
    for (x, y), (x0, y0) in zip(run_loop(profiled, body=0.0), run_loop(loader, body=0.0), strict=True):
        assert torch.equal(x, x0) and torch.equal(y, y0)
    assert len(fastdata.profile(loader, max_batches=2)) == 2
    assert len(fastdata.profile(loader, max_batches=10)) == 3


def test_report_is_valid_after_an_early_break():
    profiled = fastdata.profile(SleepyLoader(10))
    start = time.perf_counter()
    seen = run_loop(profiled, stop_after=3)
    loop_seconds = time.perf_counter() - start
    time.sleep(0.1)  # after the loop: must not count as body
    report = profiled.report()
    assert len(seen) == 3
    assert_timed(report, batches=3, wait=WAIT, body=BODY)
    assert report.total_seconds <= loop_seconds


def test_max_batches_stops_without_asking_for_one_more():
    loader = SleepyLoader(10)
    profiled = fastdata.profile(loader, max_batches=4)
    seen = run_loop(profiled)
    assert len(seen) == 4
    assert loader.served == 4
    assert_timed(profiled.report(), batches=4, wait=WAIT, body=BODY)


def test_report_during_the_loop_counts_the_running_body_so_far():
    profiled = fastdata.profile(SleepyLoader(3))
    for index, _ in enumerate(profiled):
        time.sleep(BODY)
        if index == 1:
            middle = profiled.report()
    assert middle.batches == 2
    assert 2 * BODY * 0.9 <= middle.body_seconds <= 2 * BODY + 0.5
    assert profiled.report().batches == 3


def test_each_pass_is_measured_afresh():
    profiled = fastdata.profile(SleepyLoader(3, wait=0.0))
    run_loop(profiled, body=0.0)
    run_loop(profiled, body=0.0)
    assert profiled.report().batches == 3


def test_samples_come_from_batch_size_of_or_stay_unknown():
    profiled = fastdata.profile(SleepyLoader(3, wait=0.0), batch_size_of=lambda batch: 5)
    run_loop(profiled, body=0.0)
    assert profiled.report().samples == 15
    dicts = fastdata.profile([{"x": torch.zeros(7, 3)}, {"x": torch.zeros(2, 3)}])
    run_loop(dicts, body=0.0)
    assert dicts.report().samples == 9
    scalars = fastdata.profile([1, 2, 3])
    run_loop(scalars, body=0.01)
    report = scalars.report()
    assert report.samples is None and report.samples_per_s is None
    assert "batches/s" in str(report)


def test_empty_and_single_batch_reports():
    empty = fastdata.profile([])
    assert run_loop(empty) == []
    report = empty.report()
    assert (report.batches, report.samples, report.data_bound_fraction, report.batches_per_s) == (0, 0, 0.0, 0.0)
    assert "too few batches" in str(report)
    single = fastdata.profile([torch.zeros(4)])
    run_loop(single, body=0.0)
    assert single.report().batches == 1 and not single.report().starving
    assert "too few batches" in str(single.report())


# ---------------------------------------------------------------- verdict line


def test_one_line_says_keeping_up_when_the_body_dominates():
    profiled = fastdata.profile(SleepyLoader(4, wait=0.0))
    run_loop(profiled, body=0.03)
    report = profiled.report()
    line = str(report)
    assert not report.starving
    assert "\n" not in line
    assert line.startswith("data-bound ") and "over 4 batches" in line and "samples/s" in line
    assert line.endswith("-> the input pipeline keeps up")


def test_one_line_says_starving_with_a_hint_when_waits_dominate():
    profiled = fastdata.profile(SleepyLoader(4, wait=0.04))
    run_loop(profiled, body=0.0)
    report = profiled.report()
    assert report.data_bound_fraction > 0.5
    assert report.starving
    assert "-> GPU is starving: " in str(report) and "fastdata convert" in str(report)


def test_starving_above_sets_the_threshold():
    profiled = fastdata.profile(SleepyLoader(4), starving_above=0.9)
    run_loop(profiled, body=0.02)  # about half the time waiting
    assert not profiled.report().starving


def test_print_report_prints_one_line_at_the_end(capsys):
    run_loop(fastdata.profile(SleepyLoader(3, wait=0.0), print_report=True), body=0.0)
    run_loop(fastdata.profile(SleepyLoader(5, wait=0.0), print_report=True), body=0.0, stop_after=2)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert "over 3 batches" in lines[0] and "over 2 batches" in lines[1]


def test_report_is_a_plain_dataclass():
    profiled = fastdata.profile(SleepyLoader(2, wait=0.0))
    run_loop(profiled, body=0.0)
    fields = dataclasses.asdict(profiled.report())
    assert isinstance(profiled.report(), ProfileReport)
    assert {"batches", "samples", "wait_seconds", "body_seconds", "data_bound_fraction", "samples_per_s"} <= set(fields)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"max_batches": 0}, ValueError, "max_batches should be a positive integer"),
    ({"starving_above": 1.5}, ValueError, "starving_above should be a fraction"),
    ({"batch_size_of": 3}, TypeError, "batch_size_of should be a function"),
])
def test_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        fastdata.profile([], **kwargs)


def test_a_loader_that_is_not_iterable_is_refused():
    with pytest.raises(TypeError, match="loader should be an iterable of batches, got int"):
        fastdata.profile(3)


def test_cuda_sync_is_a_no_op_without_cuda():
    profiled = fastdata.profile(SleepyLoader(2, wait=0.0), cuda_sync=True)
    assert len(run_loop(profiled, body=0.0)) == 2
    assert profiled.cuda_sync == torch.cuda.is_available()


# ---------------------------------------------------------------- torch.profiler and a real loader


@pytest.mark.slow
def test_waits_show_in_a_torch_profiler_trace():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
        run_loop(fastdata.profile(SleepyLoader(3, wait=0.0)), body=0.0)
    counts = {event.key: event.count for event in trace.key_averages()}
    assert counts.get(WAIT_LABEL) == 4  # three batches, then the wait that finds the end


def test_packed_loader_yields_identical_batches_through_the_wrapper(tmp_path):
    root = make_imagefolder(tmp_path / "photos", 2, 4, size=(80, 60))
    path = convert_imagefolder(root, tmp_path / "photos.h5", size=16, workers=1, progress=False).path
    loader = make_loader(HDF5Dataset(path), batch_size=3)
    profiled = fastdata.profile(loader)
    assert len(profiled) == len(loader) == 3
    for (images, labels), (images0, labels0) in zip(profiled, loader, strict=True):
        assert torch.equal(images, images0) and torch.equal(labels, labels0)
    report = profiled.report()
    assert (report.batches, report.samples) == (3, 8)
    assert "make_loader" in report.hint


def test_the_report_counts_the_batches_of_the_pass_by_the_way_they_were_read(shard_converted, packed_files):
    # NOTE [no silent fallbacks]: a converted folder's batches are one take from its stitched rows
    loader = make_loader(fastdata.open_dataset(shard_converted("hdf5", "raw")), batch_size=4, shuffle=True)
    profiled = fastdata.profile(loader)
    for passes in (1, 2):  # the dataset's counts so far: a batch or two ahead of the loop
        run_loop(profiled, body=0.0)
        report = profiled.report()
        assert passes * len(loader) <= report.read_paths["stitched"] <= passes * len(loader) + 2
        assert report.batches == len(loader) and report.fallbacks == ()
        assert sum(report.read_paths.values()) == report.read_paths["stitched"], report.read_paths
        assert f"stitched {report.read_paths['stitched']}" in str(report)
    one_file = fastdata.profile(make_loader(fastdata.open_dataset(packed_files("hdf5", "raw")), batch_size=4))
    run_loop(one_file, body=0.0)
    assert one_file.report().read_paths["one file"] >= one_file.report().batches > 1
    assert fastdata.profile(SleepyLoader(2, wait=0.0)).report().read_paths is None  # not a fastdata loader


def test_record_and_sequence_loaders_are_profiled_with_the_hint_their_fields_call_for(tmp_path):
    # a record file's loader has no storage of its own: its image fields say whether batches decode
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (12 + i % 5, 9 + i % 3, 3), dtype=np.uint8) for i in range(40)]
    jpeg = {"image": fastdata.Field("image", size=(8, 8), storage="jpeg"), "label": "int"}
    fastdata.write([{"image": image, "label": i % 3} for i, image in enumerate(images)], tmp_path / "jpeg.h5", jpeg)
    fastdata.write([{"tokens": np.arange(1 + i % 30, dtype=np.int32)} for i in range(60)], tmp_path / "tokens.h5",
                   {"tokens": "tokens"})
    for loader, decodes in ((make_loader(fastdata.open_dataset(tmp_path / "jpeg.h5"), 8), True),
                            (make_loader(fastdata.open_dataset(tmp_path / "jpeg.h5", fields=["label"]), 8), False),
                            (make_loader(fastdata.open_dataset(tmp_path / "tokens.h5"), 4, seq_len=16, eod=0), False)):
        profiled = fastdata.profile(loader)
        run_loop(profiled, body=0.0)
        report = profiled.report()
        assert report.batches == len(loader) and report.read_paths is None and report.fallbacks == ()
        assert ("image decoding" in report.hint) is decodes, report.hint


def test_batches_a_helper_process_reads_count_in_the_report(shard_converted):
    # NOTE [paths read elsewhere]: the helper's counts add into the training process's
    dataset = fastdata.open_dataset(shard_converted("hdf5", "raw"))
    with make_loader(dataset, batch_size=4, shuffle=True, helper_process=True) as loader:
        profiled = fastdata.profile(loader)
        run_loop(profiled, body=0.0)
        report = profiled.report()
        helper = loader.helper.report()
    assert report.batches == len(loader) == helper["batches"] == helper["read_paths"]["stitched"]
    assert report.read_paths == helper["read_paths"] == dataset.read_paths(), (report.read_paths, helper)
    assert sum(dataset.read_path_log.counts.values()) == 0  # none read in this process
    counted = dataset.read_paths()
    del loader, profiled
    gc.collect()  # the helper's shared tally goes with it; what it counted stays the dataset's
    assert dataset.read_paths() == counted and dataset.read_path_log._tallies == []
