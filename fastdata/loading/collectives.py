"""The collectives fastdata runs on the default process group, with tensors that outlive the backend's threads.

NOTE [fork after a collective]: on CPython 3.11 up to 3.11.7 (the Python
here), a process forked while another thread of its parent held the
interpreter's thread-list lock (HEAD_LOCK) never starts: the child waits for
that lock in ``PyOS_AfterFork_Child`` forever (gh-112275; the fix, PR
#112336, came in later 3.11 releases). A gloo rank has such a thread: its
``pt_gloo_runloop`` threads free a collective's work once it is done, and
where that work held the last reference to a tensor that Python had already
dropped, freeing it takes the GIL from that native thread (pybind11's
``gil_scoped_acquire``), which makes a thread state under HEAD_LOCK, without
the GIL, just as the rank's main thread goes on to fork its DataLoader
workers (caught under gdb). torch's ``all_gather_object`` and
``broadcast_object_list`` drop their tensors as they return, and so did the
agreement check's ``all_gather``. Measured on 2 gloo ranks on 2 cores, a
child forked right after each collective and counted hung after 5 s
(tests/loading/fork_after_collective.py, WHOSE "torch" or "fastdata"):
torch's object collectives 8 children hung of 30,000 forks (1 in ~3,750); 4
of ~230 runs of test_ddp's [2-False] hung so. So every collective here waits
on its work and keeps the work and its tensors in _HELD, which frees them,
in this thread, 16 collectives later, when the backend has long let go of
them: 0 hung of 24,000 forks. Collectives that other code runs (a trainer's)
are theirs to keep.
"""

import collections
import pickle

import numpy as np
import torch
import torch.distributed as dist

_HELD = collections.deque(maxlen=16)  # (work, tensors) of the latest collectives: NOTE [fork after a collective]


def collective_device():
    """Return the device of the default group's tensors: the CPU where a backend takes them, else this rank's GPU.

    gloo and mpi take CPU tensors, and so does a group of several backends ("cpu:gloo,cuda:nccl", the
    default of ``init_process_group()``); nccl takes only CUDA tensors, on the device this rank set.
    """
    config = dist.get_backend_config() if hasattr(dist, "get_backend_config") else str(dist.get_backend())
    if "cpu:" in config or any(name in config for name in ("gloo", "mpi")):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def gather_rows(row):
    """Return int64 ``[world_size, len(row)]`` on the CPU: every rank's ``row`` (a list of ints), by one all_gather."""
    mine = torch.tensor(row, dtype=torch.int64, device=collective_device())
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    _finish(dist.all_gather(rows, mine, async_op=True), mine, rows)
    return torch.stack(rows).cpu()


def gather_objects(obj):
    """Return every rank's ``obj`` (picklable), in rank order: ``all_gather_object`` with held tensors."""
    mine = _pickled(obj)
    sizes = gather_rows([len(mine)])[:, 0].tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=mine.device)
    padded[:len(mine)] = mine
    everyone = [torch.empty_like(padded) for _ in sizes]
    _finish(dist.all_gather(everyone, padded, async_op=True), mine, padded, everyone)
    return [_unpickled(data[:size]) for data, size in zip(everyone, sizes)]


def broadcast_object(obj, src=0):
    """Return rank ``src``'s ``obj`` on every rank (the others' ``obj`` is ignored): ``broadcast_object_list``."""
    device = collective_device()
    mine = _pickled(obj) if dist.get_rank() == src else None
    size = torch.tensor([0 if mine is None else len(mine)], dtype=torch.int64, device=device)
    _finish(dist.broadcast(size, src, async_op=True), size)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device) if mine is None else mine
    _finish(dist.broadcast(data, src, async_op=True), data)
    return _unpickled(data)


def _finish(work, *tensors):
    """Wait for ``work``, then hold it and its tensors: see NOTE [fork after a collective]."""
    work.wait()
    _HELD.append((work, tensors))


def _pickled(obj):
    """Return ``obj`` pickled into a uint8 tensor that owns its memory (no Python buffer behind it)."""
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    tensor = torch.empty(len(data), dtype=torch.uint8)
    tensor.numpy()[:] = data
    return tensor.to(collective_device())


def _unpickled(tensor):
    return pickle.loads(tensor.cpu().numpy().tobytes())
