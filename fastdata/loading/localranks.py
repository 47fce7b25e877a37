"""The ranks of a process group that share one machine, and the file of shared windows they map (NOTE [shared
windows] in reading/sharedwindows.py)."""

import os
import secrets
import socket

import torch.distributed as dist

from fastdata.loading.collectives import gather_objects
from fastdata.reading import sharedwindows
from fastdata.reading.sharedwindows import SharedMemory


def in_process_group(world_size):
    """Whether this process is a rank of an initialized process group of ``world_size`` (> 1) ranks."""
    return world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size


def machine_id():
    """Return what names this machine: its host name and boot id (containers of one host share the boot id, and
    a /dev/shm of their own does not count as shared: the ranks find that out when they open the file)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def share_windows(store, order, wanted, reads_type):
    """Return ``(reads, None)``, the ``reads_type`` (a SharedWindowReads) of ``order`` over ``store`` read by this
    rank with the others of its machine, or ``(None, why not)``; a collective: every rank of the group calls it
    with the same order.

    ``wanted``: this rank would read windows (one reader, data bigger than the page cache). The ranks of a
    machine share windows only where every one of them wants to and can; ``why not`` is None where this rank
    did not want to or is alone on its machine.
    """
    reads, why = reads_type.of(store, order) if wanted else (None, None)
    sample_bytes, rows = reads.memory_bytes() if reads is not None else (0, 0)
    everyone = gather_objects({"machine": machine_id(), "can": reads is not None, "why": why})
    machines = {}
    for rank, info in enumerate(everyone):
        machines.setdefault(info["machine"], []).append(rank)
    mine = machines[everyone[dist.get_rank()]["machine"]]
    local = mine.index(dist.get_rank())
    sharing = {machine for machine, ranks in machines.items()
               if len(ranks) > 1 and all(everyone[rank]["can"] for rank in ranks)}
    if not sharing:  # the same answer on every rank: no more collectives
        return None, _why_not(everyone, mine, wanted)
    shares = everyone[mine[0]]["machine"] in sharing
    path, problem, fd = None, None, None
    size = SharedMemory.size(len(mine), sample_bytes, rows)
    if shares and local == 0:
        path = os.path.join(sharedwindows.SHARED_FOLDER, f"fastdata-windows-{secrets.token_hex(8)}")
        fd, problem = _make_file(path, size)
    made = gather_objects({"path": path, "problem": problem})[mine[0]]
    if shares and local != 0 and made["problem"] is None:
        fd, problem = _open_file(made["path"], size)
    opened = gather_objects(problem)  # a barrier too: the file is unlinked once every rank has it open
    if local == 0 and fd is not None:
        os.unlink(path)
    problems = [f"rank {rank}: {opened[rank]}" for rank in mine if opened[rank] is not None]
    try:
        if not shares:
            return None, _why_not(everyone, mine, wanted)
        if problems:
            return None, f"the file its ranks would share could not be made or opened ({'; '.join(problems)})"
        reads.attach(SharedMemory(fd, local, len(mine), sample_bytes, rows))
        return reads, None
    finally:
        if fd is not None:
            os.close(fd)


def _why_not(everyone, mine, wanted):
    """Why the ranks ``mine`` of this machine do not share windows, or None where this one wanted none or is alone."""
    if not wanted or len(mine) < 2:
        return None
    reasons = [f"rank {rank}: {everyone[rank]['why'] or 'reads no windows'}" for rank in mine
               if not everyone[rank]["can"]]
    return "; ".join(reasons)


def _make_file(path, size):
    """Make the shared file of ``size`` bytes, its memory taken now (a full /dev/shm fails here, not as a
    SIGBUS when a read lands); return ``(fd, None)`` or ``(None, what failed)``."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return None, f"cannot make {path!r}: {exc}"
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        return None, f"cannot take {size / 2**20:.0f} MiB in {sharedwindows.SHARED_FOLDER!r}: {exc}"
    return fd, None


def _open_file(path, size):
    """Open the shared file the machine's first rank made; return ``(fd, None)`` or ``(None, what failed)``."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return None, f"cannot open {path!r}, which rank 0 of this machine made: {exc}"
    if os.fstat(fd).st_size != size:
        os.close(fd)
        return None, f"{path!r} holds other bytes than this rank's windows need"
    return fd, None
