"""The language-model section of the benchmark suite, run small: every reader over the same tokenized corpus."""

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the suite imports as benchmarks.*, shadowing nothing

from benchmarks.fresh import FreshProcesses  # noqa: E402
from benchmarks.sections import lm  # noqa: E402
from fastdata import make_loader, open_dataset  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # fresh processes and a trained tokenizer


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    pytest.importorskip("tokenizers")
    config = {"quick": True, "text_docs": 400, "repeats": 1, "process_repeats": 1, "min_seconds": 0.01, "seed": 0,
              "workdir": str(tmp_path_factory.mktemp("work"))}
    with FreshProcesses() as fresh:
        return lm.run(config, fresh)


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # LitData's reads wrap read-only bytes
def test_the_peers_hold_the_tokens_fastdata_stored(section):
    files = section["files"]
    stream = np.fromfile(files["bin"], np.uint16)
    assert len(stream) == files["tokens"] and files["documents"] == 400
    loader = make_loader(open_dataset(files["fastdata"]), 4, seq_len=lm.SEQ_LEN, eod=int(stream[-1]))
    rows = np.concatenate([batch["input_ids"].numpy().reshape(-1) for batch in loader])
    assert rows[: len(stream) - 1].tolist() == stream[:-1].tolist()  # the concat rows are the nanoGPT stream
    if "hf" in files:
        import datasets

        blocks = datasets.load_from_disk(files["hf"])
        assert blocks[1]["input_ids"] == stream[lm.SEQ_LEN + 1 : 2 * (lm.SEQ_LEN + 1)].tolist()
    if "litdata" in files:  # LitData's blocks: the stream in rows of SEQ_LEN + 1, a chunk's last tokens left out
        blocks = lm._litdata_blocks(files["litdata"], 0)
        assert len(blocks) == files["litdata_blocks"] > 0
        rows = sorted(tuple(blocks[index].tolist()) for index in range(len(blocks)))
        assert all(len(row) == lm.SEQ_LEN + 1 for row in rows)
        text = stream.tobytes()
        assert all(np.array(row, np.uint16).tobytes() in text for row in rows)


def test_every_reader_is_measured_and_the_targets_are_ratios_of_its_rows(section):
    rate = {row["key"]: row["tokens_per_s"] for row in section["rows"]}
    assert {"concat", "tokens", "best_fit", "mixed", "nanogpt", "copy", "copy_memmap"} <= set(rate)
    assert min(rate.values()) > 0
    by_name = {target["name"]: target for target in section["targets"]}
    paired = section["paired"]  # the read targets: a fastdata row and each peer timed in turn, round by round
    peers = {key for key in ("hf", "litdata") if key in rate}
    assert set(paired) == {"concat", "tokens", "nanogpt", "copy", "copy_memmap"} | peers
    assert {len(rates) for rates in paired.values()} == {2} and min(min(rates) for rates in paired.values()) > 0
    for key, (ours, name, _) in lm.TARGETS.items():
        if key not in paired:
            continue
        ratios = sorted(a / b for a, b in zip(paired[ours], paired[key]))
        label = "concat sequences" if ours == "concat" else "tokens_only rows"
        assert by_name[f"lm: fastdata {label} over {name}"]["value"] == pytest.approx(sum(ratios) / 2)
    assert "M tokens/s" in section["text"] and "best_fit" in section["text"]
    if "hf" in section["files"]:  # the same JSONL tokenized by datasets.map: the same ids counted, timed
        files = section["files"]
        conversion = by_name["lm: fastdata convert text tokens/s over datasets.map(batched=True, num_proc)"]
        (ours,), (theirs,) = files["convert_seconds"], files["hf_convert_seconds"]  # --quick: one round each
        assert conversion["value"] == pytest.approx(theirs / ours)
        assert "datasets took" in section["text"]
