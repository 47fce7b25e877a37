"""One rank of a gloo group that forks a child right after each collective: ``python fork_after_collective.py
RANK WORLD_SIZE FORKS WHOSE OUT`` (MASTER_ADDR and MASTER_PORT in the environment).

WHOSE is "fastdata" (fastdata.loading.collectives) or "torch" (all_gather_object and broadcast_object_list,
the comparison: NOTE [fork after a collective]). Each child exits at once; one that has not exited within
HUNG_SECONDS is counted hung, and killed. Writes ``OUT`` (JSON): the forks, the hung ones and, for the
fastdata collectives, what each returned on this rank at step 1.
"""

import json
import os
import signal
import sys
import time

import torch.distributed as dist

from fastdata.loading.collectives import broadcast_object, gather_objects, gather_rows

HUNG_SECONDS = 5


def collectives(whose, rank, world_size, step):
    """Run one step's collectives; return what they returned."""
    mine = {"rank": rank, "text": "é\u2028\U0001f600" * (rank + 1) * (step % 3), "step": step}
    if whose == "torch":
        everyone, chosen = [None] * world_size, [mine]
        dist.all_gather_object(everyone, mine)
        dist.broadcast_object_list(chosen, src=step % world_size)
        return everyone, chosen[0], None
    rows = gather_rows([rank, step, -rank - 1]).tolist()
    return gather_objects(mine), broadcast_object(mine, src=step % world_size), rows


def fork_and_wait():
    """Fork a child that exits at once; return whether it hung (then it is killed)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + HUNG_SECONDS
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return True
        time.sleep(0.0005)
    return False


def main(rank, world_size, forks, whose, out):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    hung, returned_at_1 = 0, None
    for step in range(forks):
        returned = collectives(whose, rank, world_size, step)
        returned_at_1 = returned if step == 1 else returned_at_1
        hung += fork_and_wait()
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"forks": forks, "hung": hung, "returned_at_1": returned_at_1}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
