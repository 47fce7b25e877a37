"""The README's code runs as written: every python and bash block, or a stated reason why not.

A block is found by the heading it follows and its place under it
(``readme_blocks``); RUN names the test that runs each block and SKIPPED
gives the reason for each block no test runs, and
test_every_readme_block_is_run_or_skipped_with_a_reason fails when README.md
gains a block in neither. A test runs its blocks in a folder it fills with
what they name (photos/train, train.h5, train/, aclImdb/...), made by the
project's own converters from varied synthetic photos and texts, with only
the substitutions it asserts ("nccl" -> "gloo", "cuda" -> "cpu" without a
GPU, a cloud address -> a local server). A fragment that uses names the text
around it defines (``model``, ``loader``) is given them by code written here,
and a loop body written ``...`` (the reader's training step) records what it
was handed.
"""

import csv
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support import free_port, run_cli, train_hf_tokenizer

from fastdata import HDF5Dataset, convert_imagefolder, make_loader, open_dataset, write
from fastdata.measure.synthetic import make_imagefolder, make_text_corpus

pytestmark = pytest.mark.integration  # the README's commands, servers and schedulers

REPO = Path(__file__).resolve().parents[1]
BIN = os.path.dirname(sys.executable)  # the environment's bin folder, where the `fastdata` entry point is

TWO_COMMANDS = "## Two commands (fresh clone, Linux, Python 3.10+, no GPU needed)"
QUICK_START = "## Quick start"
SHARDS = "### Shard folders: datasets bigger than one file"
OBJECT_STORAGE = "### Object storage: `s3://` and any fsspec URL"
DDP = "### Training on several GPUs (DDP) and resuming mid-epoch"
TRAINERS = "### Lightning and accelerate"
HUGGING_FACE = "### Hugging Face `datasets`"
DEVICE = "### From file to GPU: device feeding, batched augmentation, normalization"
TEXT = "### Converting text"
RECORDS = "### Records of named fields: `fastdata.write`"
MEASURING = "## Measuring on your own data"

# (heading, language, n: the n-th block of that language under the heading) -> the test that runs it: a test
# of this module, or "path::test" of another
RUN = {
    (QUICK_START, "bash", 0): "test_quick_start_converts_describes_verifies_and_loads",
    (QUICK_START, "python", 0): "test_quick_start_converts_describes_verifies_and_loads",
    (SHARDS, "bash", 0): "test_a_shard_folder_converts_resumes_and_joins_its_parts",
    (OBJECT_STORAGE, "bash", 0): "test_a_conversion_to_s3_resumes_and_loads_as_the_local_files",
    (OBJECT_STORAGE, "python", 0): "test_a_conversion_to_s3_resumes_and_loads_as_the_local_files",
    (DDP, "python", 0): "test_the_ddp_snippet_runs_on_two_gloo_ranks_and_saves_one_loader_state",
    (DDP, "python", 1): "test_a_checkpoint_of_4_ranks_resumes_on_3_with_the_uninterrupted_global_batches",
    (TRAINERS, "python", 0): "test_lightning_ddp_trains_each_sample_once_an_epoch_on_two_cpu_processes",
    (TRAINERS, "python", 1): "test_accelerate_hands_the_loader_back_and_its_state_carries_the_position",
    (HUGGING_FACE, "python", 0): "tests/loading/test_huggingface.py::test_the_readme_line_runs",
    (DEVICE, "python", 0): "test_the_device_pipeline_augments_normalizes_and_casts",
    (TEXT, "bash", 0): "test_every_text_source_converts_and_loads_in_buckets",
    (TEXT, "python", 0): "test_every_text_source_converts_and_loads_in_buckets",
    (TEXT, "python", 1): "test_a_corpus_loads_as_language_model_sequences",
    (RECORDS, "python", 0): "test_records_of_named_fields_write_and_load_as_dict_batches",
    (RECORDS, "python", 1): "test_a_record_folder_resumes_and_runs_in_parts",
    (RECORDS, "bash", 0): "test_every_record_source_converts_from_the_command_line",
    (MEASURING, "bash", 0): "test_bench_and_tune_measure_a_folder_and_a_file",
    (MEASURING, "python", 0): "test_profile_reports_one_line_shaped_as_the_readme_shows",
}
SKIPPED = {
    (TWO_COMMANDS, "bash", 0): "scripts/demo.sh creates .venv and installs fastdata from the network: a fresh-clone "
                               "entry point, not something a test may run",
    (TWO_COMMANDS, "bash", 1): "scripts/test.sh is the CI itself (.venv, installs, ruff and this whole suite)",
}
CODE_LANGUAGES = ("python", "bash")
PROSE_LANGUAGES = ("",)  # the layout tree: not code

ONE_PER_CLASS = 600  # tiny photos, each its own class: a batch's labels say which samples it holds


# ---------------------------------------------------------------- finding and running blocks


def readme_blocks():
    """Return ``{(heading, language, n): code}`` of README.md's fenced blocks, in order.

    ``heading`` is the last heading line above the block and ``n`` counts the
    blocks of ``language`` under it.
    """
    blocks, heading, fence, seen = {}, None, None, Counter()
    with open(REPO / "README.md") as f:
        for line in f:
            if fence is None and line.startswith("```"):
                fence = (line[3:].strip(), [])
            elif fence is None and line.startswith("#"):
                heading = line.rstrip("\n")
            elif fence is not None and line.startswith("```"):
                language, lines = fence
                blocks[heading, language, seen[heading, language]] = "".join(lines)
                seen[heading, language] += 1
                fence = None
            elif fence is not None:
                fence[1].append(line)
    return blocks


def snippet(heading, language="python", n=0):
    """Return the code of the ``n``-th ``language`` block under ``heading``; it must be listed in RUN."""
    key = (heading, language, n)
    assert key in RUN, f"list {key} in RUN with the test that runs it"
    return readme_blocks()[key]


def commands(heading, n=0):
    """Return the non-empty lines of the ``n``-th bash block under ``heading`` (comments kept: bash skips them)."""
    return [line for line in snippet(heading, "bash", n).splitlines() if line.strip()]


def recording(code, statement):
    """Return ``code`` with its one loop body ``...`` (the reader's training step) replaced by ``statement``."""
    body = re.compile(r"^(\s+)\.\.\.(\s*#.*)?$", re.M)
    assert len(body.findall(code)) == 1, f"expected one `...` loop body in:\n{code}"
    return body.sub(lambda m: m.group(1) + statement + (m.group(2) or ""), code)


def run_snippet(code, **given):
    """Execute ``code`` in this process, in the current folder, with the names ``given``; return its names."""
    names = dict(given)
    exec(compile(code, "README.md", "exec"), names)
    return names


def run_bash(lines, cwd, timeout=120):
    """Run ``lines`` with ``bash -eu`` in ``cwd``, this environment's ``fastdata`` first on PATH; return the output."""
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(lines)], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    assert done.returncode == 0, "\n".join(lines) + f"\nfailed:\n{done.stdout[-3000:]}"
    return done.stdout


def run_script(code, cwd, *launcher, timeout=300):
    """Run ``code`` as a script in ``cwd`` with ``python [launcher...]``, gloo on loopback; return its stdout."""
    script = cwd / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *launcher, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def torchrun(ranks):
    """The launcher arguments of ``torchrun --nproc-per-node ranks`` on a free loopback port."""
    return ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port())]


def link(cwd, name, target):
    """Make ``cwd/name`` (e.g. "photos/train") a link to ``target``: the block's name for the test's data."""
    path = cwd / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


def assert_same_samples(root, reference):
    """Assert that the packed files or folders ``root`` and ``reference`` hold the same samples and labels."""
    got, want = open_dataset(root), open_dataset(reference)
    assert len(got) == len(want) and got.labels.tolist() == want.labels.tolist()
    everything = list(range(len(want)))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got.__getitems__(everything), want.__getitems__(everything)))


def defined_test(name):
    """Whether the test ``name`` ("test_x" of this module, or "tests/path.py::test_x") is defined."""
    path, _, function = name.rpartition("::")
    if not path:
        return callable(globals().get(function))
    return re.search(rf"^def {function}\(", (REPO / path).read_text(), re.M) is not None


def ranks_seen(cwd, world_size):
    """Return each rank's recorded batches, from the ``seen-rank{r}.json`` files the ranks wrote."""
    return [json.loads((cwd / f"seen-rank{rank}.json").read_text()) for rank in range(world_size)]


# ---------------------------------------------------------------- data the blocks name


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """An ImageFolder tree of 3 classes x 4 photos of varied sizes, aspect ratios, modes and formats; read-only."""
    return make_imagefolder(tmp_path_factory.mktemp("readme") / "photos", 3, 4, size=(80, 60), vary=True)


@pytest.fixture(scope="module")
def one_per_class(tmp_path_factory):
    """``{"folder": shard folder, "file": .h5}`` of ONE_PER_CLASS tiny photos, each its own class; read-only."""
    root = tmp_path_factory.mktemp("readme-labeled")
    src = make_imagefolder(root / "src", ONE_PER_CLASS, 1, size=(8, 8))
    folder = convert_imagefolder(src, root / "train", size=8, shard_size=150 * 3 * 8 * 8, workers=1, progress=False)
    file = convert_imagefolder(src, root / "train.h5", size=8, workers=1, progress=False)
    return {"folder": folder.path, "file": file.path}


# ---------------------------------------------------------------- the blocks nobody runs here


def test_every_readme_block_is_run_or_skipped_with_a_reason():
    blocks = readme_blocks()
    languages = {language for _, language, _ in blocks}
    assert languages <= {*CODE_LANGUAGES, *PROSE_LANGUAGES}, f"README has ```{languages} blocks: run or list them"
    code = {key for key in blocks if key[1] in CODE_LANGUAGES}
    assert not set(RUN) & set(SKIPPED)
    untested = code - set(RUN) - set(SKIPPED)
    assert not untested, f"README blocks that no test runs: add each to RUN with its test, or to SKIPPED: {untested}"
    gone = (set(RUN) | set(SKIPPED)) - code
    assert not gone, f"RUN or SKIPPED name blocks README no longer has: {gone}"
    missing = [test for test in RUN.values() if not defined_test(test)]
    assert not missing, f"RUN names tests that do not exist: {missing}"
    assert all(reason for reason in SKIPPED.values())


def test_the_skipped_blocks_are_the_setup_scripts_the_ci_runs():
    for heading, language, n in SKIPPED:  # the reasons hold while each block only runs one of these scripts
        script = re.fullmatch(r"bash (scripts/\w+\.sh)\n", readme_blocks()[heading, language, n]).group(1)
        assert script in ("scripts/demo.sh", "scripts/test.sh") and (REPO / script).is_file()


# ---------------------------------------------------------------- quick start and shard folders


def test_quick_start_converts_describes_verifies_and_loads(photos, tmp_path, monkeypatch):
    link(tmp_path, "photos/train", photos)
    install, *lines = commands(QUICK_START)
    assert install.startswith("pip install -e .")  # not run: it needs the network, and this environment is one
    out = run_bash(lines, tmp_path)
    assert "wrote 'train.h5': 12 samples" in out and "wrote 'train.arrow': 12 samples" in out
    assert re.search(r"samples: +12\n", out) and "uint8 [3x64x64]" in out  # fastdata info
    assert "'train.h5': ok (format version 2, 12 samples; checked: structure, crc32 checksums, labels)" in out
    assert open_dataset(tmp_path / "train.arrow").metadata["storage"] == "jpeg"

    monkeypatch.chdir(tmp_path)
    names = run_snippet(recording(snippet(QUICK_START), "seen.append(labels)"), seen=[])
    dataset = names["dataset"]
    assert names["image"].shape == (3, 64, 64) and names["image"].dtype == torch.uint8
    assert isinstance(names["label"], int)
    assert [batch.shape for batch in names["seen"]] == [(12,)] and names["images"].shape == (12, 3, 64, 64)
    assert sorted(torch.cat(names["seen"]).tolist()) == sorted(dataset.labels.tolist())  # one epoch: each sample once
    assert len(names["mean"]) == len(names["std"]) == 3 and all(0 < m < 1 for m in names["mean"])


def test_a_shard_folder_converts_resumes_and_joins_its_parts(photos, tmp_path, monkeypatch):
    first, resume, dask, part, index = commands(SHARDS)
    assert "--dask tcp://scheduler:8786" in dask  # run by the slow test below
    alone, parts = tmp_path / "alone", tmp_path / "parts"
    for cwd in (alone, parts):
        link(cwd, "imagenet/train", photos)
    run_bash([first], alone)
    shard = alone / "train" / "shard-00000.h5"
    written = json.loads((alone / "train" / "index.json").read_text())
    assert written["num_samples"] == 12 and [s["name"] for s in written["shards"]] == ["shard-00000.h5"]

    # after a kill the shards and their records are there, and index.json (written last) is not
    (alone / "train" / "index.json").unlink()
    (alone / "train" / "labels.npy").unlink()
    inode = shard.stat().st_ino
    assert "wrote '" in run_bash([resume], alone)
    assert json.loads((alone / "train" / "index.json").read_text()) == written
    assert shard.stat().st_ino == inode  # kept, not written again

    # every machine runs its part: the line as written on machine 3, the same line on the others
    assert " --part 3/16 " in part
    words = shlex.split(part, comments=True)
    monkeypatch.chdir(parts)
    for machine in range(16):  # in this process: 16 interpreters would take 20 s
        done = run_cli(*[f"{machine}/16" if word == "3/16" else word for word in words[1:]])
        assert done.exit_code == 0, done.output
    (parts / "train" / "index.json").unlink()  # written by the last part: `fastdata index` writes it again
    assert "wrote train/index.json: 12 samples" in run_bash([index], parts)
    assert_same_samples(parts / "train", alone / "train")  # the conversion in one go, other settings aside


@pytest.mark.slow  # ~10 s: a Dask cluster and a CLI process start
def test_a_shard_folder_converts_on_a_dask_scheduler(photos, tmp_path):
    distributed = pytest.importorskip("distributed")
    first, _, dask, _, _ = commands(SHARDS)
    link(tmp_path / "alone", "imagenet/train", photos)
    link(tmp_path / "dask", "imagenet/train", photos)
    run_bash([first], tmp_path / "alone")
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=":0") as cluster:
        assert dask.count("tcp://scheduler:8786") == 1  # the reader's scheduler, here a local one
        run_bash([dask.replace("tcp://scheduler:8786", cluster.scheduler_address)], tmp_path / "dask")
    assert_same_samples(tmp_path / "dask" / "train", tmp_path / "alone" / "train")


# ---------------------------------------------------------------- object storage


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # aiohttp sessions of s3fs closed at exit
@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes:UserWarning")  # 4 on 2 cores
def test_a_conversion_to_s3_resumes_and_loads_as_the_local_files(photos, s3_env, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDATA_CACHE", os.fspath(tmp_path / "cache"))
    link(tmp_path, "imagenet/train", photos)
    s3_env.bucket("bucket")
    first, resume = commands(OBJECT_STORAGE)
    assert "wrote 's3://bucket/train': 12 samples" in run_bash([first], tmp_path)
    client = s3_env.client()
    client.delete_object(Bucket="bucket", Key="train/index.json")  # as a conversion killed before its last upload
    assert "wrote 's3://bucket/train': 12 samples" in run_bash([resume], tmp_path)
    assert client.head_object(Bucket="bucket", Key="train/index.json")["ContentLength"] > 0

    code = snippet(OBJECT_STORAGE)
    assert code.count('"http://minio:9000"') == 1  # the reader's server, here moto's
    monkeypatch.chdir(tmp_path)
    names = run_snippet(code.replace('"http://minio:9000"', repr(s3_env.endpoint)))
    local = open_dataset(convert_imagefolder(photos, tmp_path / "local.h5", size=64, workers=1, progress=False).path)
    loader = names["loader"]
    try:
        batches = list(loader)
    finally:
        loader.close()
    assert len(names["dataset"]) == 12 and [len(labels) for _, labels in batches] == [12]
    images, labels = batches[0]
    got = sorted((label, image.numpy().tobytes()) for image, label in zip(images, labels.tolist()))
    want = sorted((label, image.numpy().tobytes()) for image, label in (local[i] for i in range(len(local))))
    assert got == want  # the local conversion's samples, each once
    assert os.listdir(tmp_path / "cache")  # the shard came through the local cache


# ---------------------------------------------------------------- DDP and trainers


def test_the_ddp_snippet_runs_on_two_gloo_ranks_and_saves_one_loader_state(shard_converted, tmp_path):
    link(tmp_path, "train", shard_converted("hdf5", "raw"))
    code = snippet(DDP)
    assert code.count('"nccl"') == 1  # a CPU has no NCCL: gloo, as the comment says
    run_script(code.replace('"nccl"', '"gloo"'), tmp_path, *torchrun(2))
    state = torch.load(tmp_path / "ckpt.pt")["loader"]
    assert (state["epoch"], state["samples_consumed"]) == (2, 0)  # after the second epoch: the third's start


RANK_RECORD = """
import json
with open(f"seen-rank{dist.get_rank()}.json", "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
"""


@pytest.mark.slow  # ~16 s: three gloo ranks start (tests/loading/test_ddp.py resumes across world sizes unmarked)
def test_a_checkpoint_of_4_ranks_resumes_on_3_with_the_uninterrupted_global_batches(one_per_class, tmp_path):
    link(tmp_path, "train", one_per_class["folder"])
    dataset = open_dataset(one_per_class["folder"])
    uninterrupted = [make_loader(dataset, batch_size=72, shuffle=True, seed=0, rank=rank, world_size=4)
                     for rank in range(4)]  # the run "4 GPUs x 72 before", read in this process
    steps = [sorted(np.concatenate([labels.numpy() for _, labels in step]).tolist())
             for step in zip(*uninterrupted)]
    before = make_loader(dataset, batch_size=72, shuffle=True, seed=0, rank=0, world_size=4)
    next(iter(before))  # one global step of 288, then the checkpoint every rank would save alike
    torch.save({"loader": before.state_dict()}, tmp_path / "ckpt.pt")

    start = snippet(DDP)
    start = start[: start.index("loader = ")].replace('"nccl"', '"gloo"')  # the DDP block's imports and group
    code = recording(snippet(DDP, n=1), "seen.append(labels.tolist())")
    run_script(start + "seen = []\n" + code + RANK_RECORD, tmp_path, *torchrun(3))
    seen = ranks_seen(tmp_path, 3)
    assert len(steps) == 3 and [len(batches) for batches in seen] == [2, 2, 2]  # the rest of the epoch: 2 steps
    assert all(len(batch) == 96 for batches in seen for batch in batches)
    assert [sorted(sum(step, [])) for step in zip(*seen)] == steps[1:]


LIGHTNING_MODEL = f"""
import lightning as L
import torch


class Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3, {ONE_PER_CLASS})
        self.seen = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        self.seen.append(labels.tolist())
        return torch.nn.functional.cross_entropy(self.net(images.float().mean((2, 3))), labels)

    def on_train_epoch_end(self):
        self.trainer.should_stop = True  # one epoch: the block leaves max_epochs at Lightning's default

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


model = Recorder()
"""
LIGHTNING_RECORD = """
import json
with open(f"seen-rank{trainer.global_rank}.json", "w") as f:
    json.dump({"batches": model.seen, "len": len(loader)}, f)
"""


@pytest.mark.slow  # ~20 s: two Lightning processes with 2 workers each (examples/lightning_ddp.py runs unmarked)
def test_lightning_ddp_trains_each_sample_once_an_epoch_on_two_cpu_processes(one_per_class, tmp_path):
    pytest.importorskip("lightning")
    link(tmp_path, "train.h5", one_per_class["file"])
    run_script(LIGHTNING_MODEL + snippet(TRAINERS) + LIGHTNING_RECORD, tmp_path, timeout=600)
    seen = ranks_seen(tmp_path, 2)
    steps = -(-ONE_PER_CLASS // 128)  # global batches of 64 x 2, the last one padded
    assert [record["len"] for record in seen] == [steps, steps]
    assert [len(record["batches"]) for record in seen] == [steps, steps]
    trained = {label for record in seen for batch in record["batches"] for label in batch}
    assert trained == set(range(ONE_PER_CLASS))
    (checkpoint,) = (tmp_path / "lightning_logs").glob("version_0/checkpoints/*.ckpt")
    state = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert [(s["epoch"], s["samples_consumed"]) for s in state] == [(1, 0)]  # the loader's state: the next epoch


ACCELERATE_GIVEN = """
import torch
from fastdata import make_loader, open_dataset

model = torch.nn.Linear(3, 3)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = made = make_loader(open_dataset("train.h5"), batch_size=2, shuffle=True, seed=0)
"""
ACCELERATE_CHECK = """
import json
steps = iter(loader)
first = [next(steps)[1].tolist() for _ in range(2)]
accelerator.save_state("state")
rest = [labels.tolist() for _, labels in steps]
accelerator.load_state("state")
again = [labels.tolist() for _, labels in loader]
print(json.dumps({"as_it_was": loader is made, "first": first, "rest": rest, "again": again}))
"""


def test_accelerate_hands_the_loader_back_and_its_state_carries_the_position(photos, tmp_path):
    pytest.importorskip("accelerate")
    convert_imagefolder(photos, tmp_path / "train.h5", size=16, workers=1, progress=False)
    out = run_script(ACCELERATE_GIVEN + snippet(TRAINERS, n=1) + ACCELERATE_CHECK, tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["as_it_was"]
    assert len(result["first"]) == 2 and len(result["rest"]) == 4 and result["again"] == result["rest"]
    assert sorted(sum(result["first"] + result["rest"], [])) == sorted(HDF5Dataset(tmp_path / "train.h5").labels)


# ---------------------------------------------------------------- device feeding


def test_the_device_pipeline_augments_normalizes_and_casts(photos, tmp_path, monkeypatch):
    convert_imagefolder(photos, tmp_path / "train", size=256, shard_size=4 * 3 * 256 * 256, workers=1, progress=False)
    val = HDF5Dataset(convert_imagefolder(photos, tmp_path / "val.h5", size=256, workers=1, progress=False).path)
    code, device = snippet(DEVICE), "cuda"
    if not torch.cuda.is_available():  # the same pipeline, without the copy (README: how it is tested here)
        assert code.count('device="cuda"') == 2
        code, device = code.replace('device="cuda"', 'device="cpu"'), "cpu"
    monkeypatch.chdir(tmp_path)
    names = run_snippet(recording(code, "seen.append(labels)"), seen=[])
    images, labels = names["images"], names["labels"]
    assert images.shape == (12, 3, 224, 224) and images.dtype == torch.bfloat16
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert images.device.type == labels.device.type == device
    assert sorted(torch.cat(names["seen"]).tolist()) == sorted(open_dataset("train/").labels.tolist())

    (crops, val_labels), = list(names["val"])  # CenterCrop(224) of the stored 256 px, then the file's mean/std
    pixels = torch.stack([val[i][0] for i in range(len(val))])[:, :, 16:240, 16:240].float() / 255
    mean, std = (torch.tensor(val.metadata[key]).view(1, 3, 1, 1) for key in ("mean", "std"))
    assert crops.dtype == torch.float32 and val_labels.tolist() == val.labels.tolist()
    torch.testing.assert_close(crops.cpu(), (pixels - mean) / std, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- text


REVIEWS = [("A fine film, well acted.", "good"), ("Dull and far too long.", "bad"), ("Loved it!", "good"),
           ('"Meh", said my friend; I agree.', "bad")]


def write_text_sources(cwd):
    """Write what the text block converts: aclImdb/{train,test}, reviews.csv, corpus.txt, reviews.jsonl and a
    Hugging Face tokenizer file; return the corpus lines."""
    make_text_corpus(cwd / "aclImdb", per_class=6, splits=("train", "test"))
    with open(cwd / "reviews.csv", "w", newline="") as f:
        csv.writer(f).writerows([("review", "sentiment"), *REVIEWS])
    with open(cwd / "reviews.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text, "label": label}) + "\n" for text, label in REVIEWS)
    lines = ["first line", "a second, longer line", "déjà vu: 3 bytes and more"]
    (cwd / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    train_hf_tokenizer([text for text, _ in REVIEWS] * 2, cwd / "my-tokenizer.json")
    return lines


def test_every_text_source_converts_and_loads_in_buckets(tmp_path, monkeypatch, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    lines = write_text_sources(tmp_path)
    out = run_bash(commands(TEXT), tmp_path)
    for name, count in (("train.h5", 12), ("test.h5", 12), ("reviews.arrow", 4), ("corpus.h5", 3), ("r.h5", 4)):
        assert f"wrote '{name}': {count} samples" in out
    train, test = open_dataset(tmp_path / "train.h5"), open_dataset(tmp_path / "test.h5")
    assert train.lengths.max() <= 512 and test.metadata["tokenizer"] == train.metadata["tokenizer"]
    reviews = open_dataset(tmp_path / "reviews.arrow")
    assert reviews.metadata["classes"] == ["bad", "good"]
    assert [reviews.metadata["classes"][label] for label in reviews.labels] == [label for _, label in REVIEWS]
    corpus = open_dataset(tmp_path / "corpus.h5")
    assert [bytes(corpus[i][0].tolist()).decode() for i in range(3)] == lines
    hf = tokenizers.Tokenizer.from_file(os.fspath(tmp_path / "my-tokenizer.json"))
    r = open_dataset(tmp_path / "r.h5")
    assert [r[i][0].tolist() for i in range(4)] == [hf.encode(text).ids for text, _ in REVIEWS]

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    names = run_snippet(recording(snippet(TEXT), "seen.append((tokens, lengths, labels))"), seen=[])
    assert names["dataset"].lengths.tolist() == train.lengths.tolist() and isinstance(names["label"], int)
    for tokens, lengths, _ in names["seen"]:
        assert tokens.dtype == torch.int64 and tokens.shape == (len(lengths), int(lengths.max()))
        padding = torch.arange(tokens.shape[1]) >= lengths[:, None]
        assert (tokens[padding] == 0).all() and (tokens[~padding] != 0).all()  # <pad> is 0, only past the length
    assert sorted(torch.cat([labels for _, _, labels in names["seen"]]).tolist()) == sorted(train.labels.tolist())
    assert "'saved'" in capsys.readouterr().out  # print(sampler.padding())


def test_records_of_named_fields_write_and_load_as_dict_batches(photos, tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    paths = sorted(str(path) for path in Path(photos).rglob("*") if path.is_file())
    annotations = [(path, f"photo {number}: ünï", rng.random((number % 4, 4)).astype(np.float32), number % 3)
                   for number, path in enumerate(paths)]
    monkeypatch.chdir(tmp_path)
    names = run_snippet(recording(snippet(RECORDS), "seen.append(batch)"), seen=[], annotations=annotations)
    (batch,) = names["seen"]
    assert batch["image"].shape == (len(paths), 3, 64, 64) and batch["image"].dtype == torch.uint8
    order = batch["label"].tolist()
    by_caption = {text: (boxes, label) for _, text, boxes, label in annotations}
    assert sorted(batch["caption"]) == sorted(text for _, text, _, _ in annotations)
    for row, caption in enumerate(batch["caption"]):
        boxes, label = by_caption[caption]
        assert order[row] == label and int(batch["boxes_lengths"][row]) == len(boxes)
        np.testing.assert_array_equal(batch["boxes"][row, : len(boxes)].numpy(), boxes)
    assert len(names["captions"]) == len(paths) and list(names["captions"][0]) == ["caption"]


def _file_record(path):
    """The README's ``make_record``: a top-level function, as worker processes need."""
    return {"path": path, "bytes": os.path.getsize(path)}


def test_a_record_folder_resumes_and_runs_in_parts(photos, tmp_path, monkeypatch):
    paths = sorted(str(path) for path in Path(photos).rglob("*") if path.is_file())
    monkeypatch.chdir(tmp_path)
    first, second = snippet(RECORDS, "python", 1).strip().splitlines()
    run_snippet(first, write=write, paths=paths, make_record=_file_record)  # nothing to resume: writes it all
    batch = open_dataset(tmp_path / "photos").read_batch(np.arange(len(paths)))
    assert batch["path"] == paths and batch["bytes"].tolist() == [os.path.getsize(path) for path in paths]
    report = run_snippet(f"report = {second.split('#')[0].strip()}", write=write, paths=paths,
                         make_record=_file_record)["report"]
    assert report.finished  # a part of the same conversion: the folder is finished already
    run_snippet(second.replace('"photos/"', '"parts/"'), write=write, paths=paths, make_record=_file_record)
    assert not (tmp_path / "parts" / "index.json").exists()  # part 3 of 16 alone: the other parts are to come


def test_a_corpus_loads_as_language_model_sequences(tmp_path, monkeypatch):
    hf = pytest.importorskip("tokenizers")
    texts = [" ".join(f"word{(number * 7 + index) % 50}" for index in range(number * 13 % 900 + 1))
             for number in range(40)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    tokenizer = hf.Tokenizer(hf.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = hf.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, hf.trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]",
                                                                                     "<|endoftext|>"]))
    tokenizer.save(str(tmp_path / "tok.json"))
    assert "wrote 'corpus.h5': 40 samples" in run_bash(
        ["fastdata convert text corpus.jsonl corpus.h5 --tokenizer tok.json --no-labels --quiet"], tmp_path)
    monkeypatch.chdir(tmp_path)
    names = run_snippet(recording(snippet(TEXT, "python", 1), "seen.append(batch)"), seen=[],
                        open_dataset=open_dataset, make_loader=make_loader)
    eod = tokenizer.token_to_id("<|endoftext|>")
    stream = np.concatenate([tokenizer.encode(text).ids + [eod] for text in texts])
    rows = [row for batch in names["seen"] for row in batch["input_ids"]]
    assert all(batch["input_ids"].shape[1] == 2048 for batch in names["seen"])
    assert len(rows) == -(-(len(stream) - 1) // 2048)
    inputs = stream[: len(rows) * 2048].tolist()
    padding = [tokenizer.token_to_id("[PAD]")] * (len(rows) * 2048 - len(inputs))
    assert sorted(np.concatenate(rows).tolist()) == sorted(inputs + padding)  # the sequences come shuffled


def _as_jpeg(path):
    """The image at ``path`` encoded as JPEG: a WebDataset's samples share their members' extensions."""
    buffer = io.BytesIO()
    with Image.open(path) as image:
        image.convert("RGB").save(buffer, format="JPEG")
    return buffer.getvalue()


def test_every_record_source_converts_from_the_command_line(photos, tmp_path):
    datasets, webdataset = pytest.importorskip("datasets"), pytest.importorskip("webdataset")
    paths = sorted(path for path in Path(photos).rglob("*") if path.is_file())
    with open(tmp_path / "manifest.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label"])
        writer.writerows([os.path.relpath(path, tmp_path), number % 3] for number, path in enumerate(paths))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    datasets.Dataset.from_dict({"image": [str(path) for path in paths], "label": [n % 3 for n in range(len(paths))]},
                               features=features).save_to_disk(str(tmp_path / "hf-dataset"))
    for shard in range(2):
        with webdataset.TarWriter(str(tmp_path / f"shard-{shard}.tar")) as sink:
            for number, path in list(enumerate(paths))[shard::2]:
                sink.write({"__key__": f"s{number:03d}", "jpg": _as_jpeg(path), "cls": number})
    (tmp_path / "images").symlink_to(photos)
    relative = [os.path.relpath(path, photos) for path in paths]
    (tmp_path / "instances.json").write_text(json.dumps({
        "images": [{"id": n, "file_name": name} for n, name in enumerate(relative)],
        "annotations": [{"id": 0, "image_id": 0, "category_id": 1, "bbox": [1, 2, 10, 5]}],
        "categories": [{"id": 1, "name": "thing"}]}))
    out = run_bash(commands(RECORDS), tmp_path, timeout=300)
    for name in ("pairs.h5", "hf.arrow", "wds.h5", "coco.h5"):
        assert f"wrote '{name}': {len(paths)} samples" in out
    labels = [n % 3 for n in range(len(paths))]
    assert open_dataset(tmp_path / "pairs.h5").read_batch(np.arange(len(paths)))["label"].tolist() == labels
    hf = open_dataset(tmp_path / "hf.arrow")
    assert hf.schema["label"].names == ("a", "b", "c") and hf.read_batch([0])["image"].shape == (1, 3, 64, 64)
    assert sorted(open_dataset(tmp_path / "wds.h5").read_batch(np.arange(len(paths)))["cls"].tolist()) == \
        list(range(len(paths)))
    coco = open_dataset(tmp_path / "coco.h5")
    assert coco[0]["image"].shape == (3, 128, 128) and coco[0]["boxes"].shape == (1, 4) and len(coco[1]["boxes"]) == 0


# ---------------------------------------------------------------- measuring


@pytest.mark.slow  # ~70 s: bench times every row (17 s, 13 s) and tune measures as long as its 60 s budget lets it
def test_bench_and_tune_measure_a_folder_and_a_file(photos, tmp_path):
    link(tmp_path, "photos/train", photos)
    convert_imagefolder(photos, tmp_path / "train.h5", size=64, workers=1, progress=False)
    out = run_bash(commands(MEASURING), tmp_path, timeout=600)
    assert "raw folder: Pillow decode" in out and "fastdata HDF5 raw: make_loader" in out
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["num_samples"] == 12
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    tuned = json.loads((tmp_path / "train.h5.tune.json").read_text())
    assert f"recommended: {tuned['call']}" in out
    loader = make_loader(HDF5Dataset(tmp_path / "train.h5"), num_workers="auto")  # finds what tune saved
    assert getattr(loader, "num_workers", 0) == tuned["recommended"]["num_workers"]
    assert loader.prefetch_factor == tuned["recommended"]["prefetch_factor"]


REPORT = re.compile(r"data-bound [\d.]+% \(waited [\d.]+s of [\d.]+s over ([\d,]+) batches; [\d,]+ samples/s; "
                    r"first batch [\d.]+s; [a-z ]+ \d+[^)]*\) -> .+")


def test_profile_reports_one_line_shaped_as_the_readme_shows(packed_files, capsys):
    code = snippet(MEASURING)
    example = code.splitlines()[-1]
    assert REPORT.fullmatch(example.removeprefix("# "))  # the report as README shows it
    loader = make_loader(open_dataset(packed_files("hdf5")), 4)
    steps = []
    capsys.readouterr()
    names = run_snippet(code, loader=loader, train_step=lambda images, labels: steps.append(len(labels)))
    (line,) = capsys.readouterr().out.splitlines()
    assert REPORT.fullmatch(line) and int(REPORT.fullmatch(line).group(1)) == len(loader) == len(steps)
    assert names["profiled"].report().batches == len(loader) and sum(steps) == len(loader.dataset)
