"""The README's code runs as written: its DDP snippet under torchrun, two ranks on gloo."""

import os
import re
import socket
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snippet_after(heading):
    """Return the first python block of README.md after the line ``heading``."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    start = text.index(f"\n{heading}\n")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_ddp_snippet_runs_on_two_gloo_ranks_and_saves_one_loader_state(shard_converted, tmp_path):
    folder = shard_converted("hdf5", "raw")
    code = snippet_after("### Training on several GPUs (DDP) and resuming mid-epoch")
    assert '"nccl"' in code and '"train/"' in code  # what a reader copies, with only these two changed:
    script = tmp_path / "train.py"
    script.write_text(code.replace('"nccl"', '"gloo"').replace('"train/"', repr(os.fspath(folder))))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    state = torch.load(tmp_path / "ckpt.pt")["loader"]
    assert (state["epoch"], state["samples_consumed"]) == (2, 0)  # after the second epoch: the third's start
