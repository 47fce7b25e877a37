"""Lightning, accelerate and torchrun + torch.distributed.checkpoint as users run them: gloo, 2 ranks, 0 and 2 workers.

Each test starts a real trainer (lightning_run.py, accelerate_run.py,
torchrun_dcp_run.py) in a session of its own, once uninterrupted with a checkpoint saved mid-epoch,
then once resumed from that checkpoint; every rank records the samples of
its batches (trainer_record.py). Checked: each global step's shares are
disjoint, every sample is trained once per epoch, every rank has the same
``len(loader)`` and the order is one rank's; the resumed run trains exactly
the uninterrupted run's remaining batches. Every process a trainer started
must have ended when it returns.
"""

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from trainer_record import SEED, Samples, image_key

from fastdata import convert_imagefolder, make_loader, open_dataset
from fastdata.errors import OptionError
from fastdata.measure.synthetic import make_imagefolder

# The trainers run in their own processes: found, not imported here (lightning takes 3.3 s to import, which
# collecting the edit loop's tests paid on every pytest-xdist worker).
MISSING = [name for name in ("lightning", "accelerate") if importlib.util.find_spec(name) is None]
pytestmark = [pytest.mark.integration, pytest.mark.skipif(bool(MISSING), reason=f"needs {' and '.join(MISSING)}")]

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_CLASSES, PER_CLASS = 8, 12  # 96 samples: 8 global batches of 12, none short
BATCH, WORLD = 6, 2
STEPS = NUM_CLASSES * PER_CLASS // (BATCH * WORLD)
EPOCHS, CHECKPOINT_STEP = 2, STEPS + 3  # the checkpoint: 3 batches into the second epoch
RUN_SECONDS = 240  # a trainer still running after this has hung: it is killed and the test fails
END_SECONDS = 10  # what a trainer started may take to end after the trainer returned
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(WORLD),
                     "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                     "--main_process_port", "{port}"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-addr",
            "127.0.0.1", "--master-port", "{port}"]
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Return a raw .h5 file converted from varied photos (sizes, aspect ratios, modes, formats)."""
    root = tmp_path_factory.mktemp("trainers")
    src = make_imagefolder(root / "src", NUM_CLASSES, PER_CLASS, size=(64, 48), vary=True)
    return os.fspath(convert_imagefolder(src, root / "photos.h5", size=32, workers=1, progress=False).path)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(command, spec, folder):
    """Run ``command`` + SPEC in a session of its own; return each rank's record. Fail on a hang or a leftover."""
    path = os.path.join(folder, f"{spec['name']}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    run_session([*command, path], folder, spec["name"])
    records = []
    for rank in range(WORLD):
        with open(os.path.join(folder, f"{spec['name']}-rank{rank}.json")) as f:
            records.append(json.load(f))
    return records


def run_session(command, folder, name):
    """Run ``command`` in ``folder``, in a session of its own; return its output. Fail on a hang or a leftover.

    A ``{port}`` in ``command`` becomes the free port the process group meets on.
    """
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONFAULTHANDLER": "1"}  # a rank that aborts (SIGABRT, once in CI at exit) prints every thread's stack
    log = os.path.join(folder, f"{name}.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([part.replace("{port}", str(port)) for part in command], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=folder, start_new_session=True)
    try:
        code = proc.wait(timeout=RUN_SECONDS)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        left = _end_session(proc)
    with open(log, errors="replace") as f:
        output = f.read()
    assert code is not None, f"{name} still running after {RUN_SECONDS} s (hung)\n{output[-4000:]}"
    assert code == 0, f"{name} exited with {code}\n{output[-4000:]}"
    assert not left, f"{name} left processes running after it returned\n{output[-4000:]}"
    return output


def _end_session(proc):
    """Wait up to END_SECONDS for the rest of ``proc``'s session to end, then kill it; return whether any was left."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + END_SECONDS
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return True
        time.sleep(0.1)


def global_steps(records):
    """Return ``{global step: (epoch, [share of each rank])}``; check every rank has the same len and steps."""
    assert {record["len"] for record in records} == {STEPS}, "ranks disagree on len(loader)"
    per_rank = [{step: (epoch, indices) for epoch, step, indices in record["steps"]} for record in records]
    assert all(per_rank[0].keys() == steps.keys() for steps in per_rank), "ranks trained different steps"
    return {step: (per_rank[0][step][0], [steps[step][1] for steps in per_rank]) for step in per_rank[0]}


def reference_batches(path):
    """Return the global batches of one rank's uninterrupted run, sorted, per global step."""
    loader = make_loader(open_dataset(path), BATCH * WORLD, shuffle="uniform", seed=SEED, rank=0, world_size=1)
    labels = Samples(path)  # the same image keys the ranks use
    batches = []
    for _ in range(EPOCHS):
        for images, _ in loader:
            batches.append(sorted(labels.index[image_key(image)] for image in images.numpy()))
    return batches


def check_runs(path, full, resumed):
    """Check the uninterrupted run's shares and order, and that the resumed run trained the rest of it."""
    steps, num_samples = global_steps(full), NUM_CLASSES * PER_CLASS
    assert sorted(steps) == list(range(EPOCHS * STEPS))
    expected = reference_batches(path)
    for epoch in range(EPOCHS):
        trained = []
        for step in range(epoch * STEPS, (epoch + 1) * STEPS):
            step_epoch, shares = steps[step]
            assert step_epoch == epoch and all(len(share) == BATCH for share in shares)
            assert sorted(i for share in shares for i in share) == expected[step], f"step {step}: not one rank's"
            trained += [i for share in shares for i in share]
        assert sorted(trained) == list(range(num_samples)), f"epoch {epoch}: not every sample once"
    after = global_steps(resumed)
    assert sorted(after) == list(range(CHECKPOINT_STEP, EPOCHS * STEPS))
    assert after == {step: steps[step] for step in after}, "the resumed run trained other batches"


@pytest.mark.parametrize(("num_workers", "made"), [(0, "early"), (2, "early")])
def test_lightning_ddp_gives_each_rank_its_share_and_resumes_mid_epoch(photos, tmp_path, num_workers, made):
    spec = {"path": photos, "out": os.fspath(tmp_path), "num_workers": num_workers, "batch_size": BATCH,
            "epochs": EPOCHS, "made": made, "checkpoint_step": CHECKPOINT_STEP, "resume": None}
    command = [sys.executable, os.path.join(HERE, "lightning_run.py")]
    full = launch(command, {**spec, "name": "full"}, tmp_path)
    checkpoint = os.path.join(tmp_path, f"step={CHECKPOINT_STEP}.ckpt")
    saved = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert [(state["epoch"], state["samples_consumed"], state["shuffle"]) for state in saved] == [
        (1, 3 * BATCH * WORLD, "uniform")]
    resumed = launch(command, {**spec, "name": "resumed", "resume": checkpoint}, tmp_path)
    check_runs(photos, full, resumed)
    assert [record["validated"] for record in full + resumed] == [2 * EPOCHS] * WORLD + [2] * WORLD  # cut short


@pytest.mark.parametrize(("launcher", "num_workers", "made"), [
    ("accelerate", 0, "early"), ("accelerate", 2, "late"), ("torchrun_dcp", 0, "late"), ("torchrun_dcp", 2, "early")])
def test_accelerate_and_torchrun_with_dcp_give_each_rank_its_share_and_resume_mid_epoch(photos, tmp_path, launcher,
                                                                                         num_workers, made):
    # torchrun_dcp: the loader is a Stateful in torch.distributed.checkpoint, as with torchdata's StatefulDataLoader
    spec = {"path": photos, "out": os.fspath(tmp_path), "num_workers": num_workers, "batch_size": BATCH,
            "epochs": EPOCHS, "made": made, "checkpoint_step": CHECKPOINT_STEP, "resume": None}
    command = [*(ACCELERATE_LAUNCH if launcher == "accelerate" else TORCHRUN), os.path.join(HERE, f"{launcher}_run.py")]
    full = launch(command, {**spec, "name": "full"}, tmp_path)
    resumed = launch(command, {**spec, "name": "resumed", "resume": os.path.join(tmp_path, "checkpoint")}, tmp_path)
    check_runs(photos, full, resumed)


def test_the_lightning_example_trains_on_two_processes(tmp_path):
    output = run_session([sys.executable, os.path.join(EXAMPLES, "lightning_ddp.py"), "--workdir", "work",
                          "--epochs", "1", "--workers", "2"], tmp_path, "lightning-example")
    assert "trained 4 steps: 4 batches of 16 per process per epoch, 128 samples" in output


def test_the_accelerate_example_resumes_where_it_stopped(tmp_path):
    command = [*ACCELERATE_LAUNCH, os.path.join(EXAMPLES, "accelerate_ddp.py"), "--workdir", "work"]
    assert "saved the state after step 3" in run_session([*command, "--stop-after", "3"], tmp_path, "stopped")
    output = run_session(command, tmp_path, "resumed")
    assert "resumed at step 3" in output and "trained 8 steps: 4 batches of 16 per process per epoch" in output


def test_a_loader_iterated_under_torchrun_without_a_process_group_refuses(photos, monkeypatch):
    loader = make_loader(open_dataset(photos), BATCH, shuffle=True)  # no group: rank 0 of 1, for now
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(OptionError, match="WORLD_SIZE=2 but torch.distributed has no process group"):
        next(iter(loader))
