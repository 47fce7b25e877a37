"""The language-model-at-scale section of the benchmark suite, run small: warm rows and rows from disk in a cgroup."""

import signal
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks.fresh import FreshProcesses  # noqa: E402
from benchmarks.sections import lmscale  # noqa: E402
from fastdata import make_loader, open_dataset  # noqa: E402
from fastdata.measure.pagecache import cgroup_problem  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # fresh processes, a memory cgroup, LitData's workers


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    pytest.importorskip("tokenizers")
    config = {"quick": True, "lmscale_docs": 1500, "lmscale_rounds": 2, "lmscale_seconds": 0.3, "repeats": 1,
              "process_repeats": 1, "min_seconds": 0.01, "seed": 0, "workdir": str(tmp_path_factory.mktemp("work"))}
    handler = signal.getsignal(signal.SIGINT)
    with FreshProcesses() as fresh:
        section = lmscale.run(config, fresh)
    # LitData's optimize runs in a process of the section's: it leaves a SIGINT handler calling os._exit(0)
    assert signal.getsignal(signal.SIGINT) is handler
    return section


def test_the_corpus_is_converted_and_the_peers_hold_its_stream(section):
    files = section["files"]
    stream = np.fromfile(files["bin"], np.uint16)
    assert files["documents"] == 1500 and len(stream) == files["tokens"]  # each document ends with its eod
    loader = make_loader(open_dataset(files["fastdata"]), 4, seq_len=lmscale.SEQ_LEN, eod=int(stream[-1]),
                         tokens_only=True)
    rows = np.concatenate([batch["tokens"].numpy()[:, :-1].reshape(-1) for batch in loader])
    assert rows.tolist() == stream[: len(rows)].tolist() and len(stream) - len(rows) <= lmscale.SEQ_LEN
    assert files["bytes"] == sum(Path(path).stat().st_size for path in files["shard_paths"])
    records = open_dataset(files["records"])  # the same documents, written by fastdata.write as a tokens field
    assert records.shard_paths == files["record_paths"]
    loader = make_loader(records, 4, seq_len=lmscale.SEQ_LEN, eod=int(stream[-1]), tokens_only=True)
    assert np.concatenate([batch["tokens"].numpy()[:, :-1].reshape(-1) for batch in loader]).tolist() == rows.tolist()


def test_every_reader_is_timed_warm_and_from_disk_and_the_targets_are_ratios_of_its_rows(section):
    warm, cold = section["warm"], section["cold"]
    litdata = {"litdata"} if "litdata" in section["files"] else set()
    assert set(warm) == set(lmscale.WARM) - {"litdata"} | litdata
    assert all(len(rates) == 2 and min(rates) > 0 for rates in warm.values())
    by_name = {target["name"]: target for target in section["targets"]}
    for key, (ours, name, _) in lmscale.WARM_TARGETS.items():
        if key in warm:
            label = "concat sequences" if ours == "concat" else "tokens_only rows"
            ratios = [a / b for a, b in zip(warm[ours], warm[key])]
            target = by_name[f"lmscale: fastdata {label} over {name}"]
            assert target["value"] == pytest.approx(statistics.median(ratios))
    if cgroup_problem() is not None:
        assert cold["skipped"].startswith("not measured")
        return
    rows = cold["rows"]
    assert [row["what"] for row in rows] == [what for what in lmscale.COLD if what != "litdata" or litdata]
    for row in rows:
        assert "skipped" not in row and row["tokens_per_s"] > 0  # the limit reads this small corpus at once
        assert row["seconds"] >= 0.3 or row["what"] == "limit"
        assert row["cgroup"]["max_usage"] <= row["cgroup"]["limit"] == lmscale.QUICK["lmscale_cache_limit"]
    limits = [row["tokens_per_s"] for row in rows if row["what"] == "limit"]
    tokens = next(row for row in rows if row["what"] == "tokens")["tokens_per_s"]
    target = by_name["lmscale: fastdata tokens_only rows from disk over the sequential read (bigger than the page "
                     "cache)"]
    assert target["value"] == pytest.approx(tokens / statistics.mean(limits))
    records = next(row for row in rows if row["what"] == "records")["tokens_per_s"]
    target = by_name["lmscale: a record file's tokens field from disk over the text folder's (tokens_only rows)"]
    assert target["value"] == pytest.approx(records / tokens)
    ranks = {row["what"]: row for row in rows if row["what"].startswith("ranks")}
    assert ranks["ranks"]["misses"] == [0] * lmscale.RANKS or ranks["ranks"]["readahead"] != "SharedSequenceWindows"
    assert ranks["ranks"]["order"] == ranks["ranks_hints"]["order"]
    assert ranks["ranks"]["order"][2] == lmscale.RANK_WINDOW
    assert ranks["ranks_hints"]["readahead"] != "SharedSequenceWindows"
    target = by_name[f"lmscale: {lmscale.RANKS} ranks' tokens_only rows from disk through the windows they share "
                     "over the kernel hints"]
    assert target["value"] == pytest.approx(ranks["ranks"]["tokens_per_s"] / ranks["ranks_hints"]["tokens_per_s"])
    assert "Bigger than the page cache" in section["text"] and "M tokens/s" in section["text"]
