"""One rank of a gloo process group, started by test_ddp.py: ``python ddp_worker.py SPEC RANK``.

SPEC is a JSON file: ``path`` (a packed file or shard folder), ``world_size``,
``timeout`` (seconds, the process group's), ``out`` (a folder), optionally
``cgroups`` (rank -> the ``cgroup.procs`` of a memory cgroup it joins once
the group is up) and ``runs``, each a dict of ``batch_size``, ``options``
(make_loader keywords), ``epochs`` and optionally ``bucket``
(BucketBatchSampler keywords with ``lengths``: a bucketed loader of this
rank), ``early`` (the loader is made before the process group exists:
NOTE [late rank] in samplers.py), ``available_memory`` (bytes: what
make_loader sees free, as on a machine whose page cache holds less than
the dataset), ``shared_folder`` (where shared windows are made), ``state``
(loaded before the first epoch), ``stop`` (``[epoch,
steps]``: take the state after that many batches of that epoch, then end
the run), ``sleep`` (seconds per step), ``announce`` (the rank that
prints each step), ``reduce`` (false: no collective per step) and ``ranks``
(rank -> keys of the run that rank has otherwise: another seed in
``options``, another dataset's ``path``, a ``state``...: ranks that
disagree). Rank and world size come from the process group. Every
step does an ``all_reduce`` of the batch's size, so ranks that disagree on
the number of steps hang until the group's timeout; so does the barrier at
the end, where a rank that ended sooner waits. Writes
``out/rank<RANK>.json``: per run its ``len``, its state at the end (or at
``stop``), ``alone`` (what ``shuffle=True`` picks on this rank by itself)
and per epoch per step the labels this rank got (``rows``: a loader of
sequences' ``input_ids``) and the global batch size the reduce summed, and
``readahead`` (the type, rank and world size of the loader's read-ahead at
the end and whether it follows the sampler's order, or null; with its
``ids_read``, ``ids_held`` and ``misses`` where it is a
SharedSequenceWindows), ``read_paths`` (the dataset's, at the end), ``warnings``
(the FastPathWarnings the run gave) and per step, with ``sums`` in the
run, ``sum`` (of the batch's image bytes); a run refused with a FastdataError gives ``error`` (its
message) and ``seconds`` (from the run's start) instead, and the next run
goes on in the same group.
"""

import datetime
import faulthandler
import json
import os
import signal
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from fastdata import make_loader, open_dataset
from fastdata.errors import FastdataError, FastPathWarning
from fastdata.loading.samplers import BucketBatchSampler
from fastdata.reading import sharedwindows, shuffles
from fastdata.reading.shuffles import choose_shuffle


def make_rank_loader(dataset, spec):
    """Return the loader ``spec`` asks for: make_loader's own sampler, or a BucketBatchSampler of this rank."""
    if spec.get("available_memory") is not None:
        shuffles.available_memory = lambda: (spec["available_memory"], "test")
    if spec.get("shared_folder") is not None:  # where the ranks' shared windows are made (NOTE [shared windows])
        sharedwindows.SHARED_FOLDER = spec["shared_folder"]
    if spec.get("bucket") is None:
        return make_loader(dataset, spec["batch_size"], **spec["options"])
    keywords = {key: value for key, value in spec["bucket"].items() if key != "lengths"}
    sampler = BucketBatchSampler(np.asarray(spec["bucket"]["lengths"]), spec["batch_size"], **keywords)  # the group's
    if not spec.get("early"):  # rank, by default (an early one takes it when first asked: NOTE [late rank])
        assert (sampler.rank, sampler.world_size) == (dist.get_rank(), dist.get_world_size())
    return make_loader(dataset, batch_sampler=sampler, **spec["options"])


def rank_spec(spec, rank):
    """Return ``spec`` with what ``spec["ranks"]`` gives ``rank`` otherwise."""
    return {**spec, **spec.get("ranks", {}).get(str(rank), {})}


def run(dataset, spec, loader=None):
    """Iterate one loader (``loader``, or one made now) as ``spec`` says; return what the parent checks."""
    start = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FastPathWarning)
            result = iterate(dataset, spec, loader)
        return {**result, "warnings": [str(w.message) for w in caught if issubclass(w.category, FastPathWarning)]}
    except FastdataError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}


def iterate(dataset, spec, loader=None):
    """Iterate as ``run`` says, raising what the loader raises."""
    if "path" in spec:  # this rank's own dataset
        dataset = open_dataset(spec["path"])
    if loader is None:
        loader = make_rank_loader(dataset, spec)
    if spec.get("state") is not None:
        loader.load_state_dict(spec["state"])
    epochs, stop, state = [], spec.get("stop"), None
    for epoch in range(spec["epochs"]):
        steps = []
        for batch in loader:
            got = batch["input_ids"] if isinstance(batch, dict) else batch[-1]  # sequences' rows, or labels
            size = torch.tensor([len(got)])
            if spec.get("reduce", True):
                dist.all_reduce(size)
            steps.append({"rows" if isinstance(batch, dict) else "labels": got.tolist(), "global": int(size)})
            if spec.get("sums"):
                steps[-1]["sum"] = int(batch[0].numpy().sum(dtype=np.int64))
            if spec.get("announce") == dist.get_rank():
                print(f"step {len(steps)}", flush=True)
            time.sleep(spec.get("sleep", 0))
            if stop == [epoch, len(steps)]:
                state = loader.state_dict()
                break
        epochs.append(steps)
        if state is not None:
            break
    result = {"len": len(loader), "epochs": epochs, "state": state or loader.state_dict(),
              "alone": choose_shuffle(dataset)[0], "readahead": readahead_of(loader, settle=state is None),
              "read_paths": dataset.read_paths()}
    if hasattr(loader, "close"):
        loader.close()
    return result


def readahead_of(loader, settle):
    """Return the type, rank and world size of ``loader``'s read-ahead, and whether it follows its order; or None.

    ``settle``: the epochs ran whole, so the read of the next epoch's first window is waited for.
    """
    readahead = loader.steps.readahead
    if readahead is None:
        return None
    described = {"type": type(readahead).__name__, "rank": readahead.rank, "world_size": readahead.world_size,
                 "follows": readahead.order is loader.sampler.order}
    if hasattr(readahead, "ids_read"):  # SharedSequenceWindows: what it read and held, and its misses
        if settle and readahead._reader is not None:  # after whole epochs every rank's thread reads the next
            readahead._reader.join()  # epoch's first window; stopped early, a rank may have read further ahead
        described.update(ids_read=readahead.ids_read, ids_held=readahead.ids_held, misses=readahead.misses)
    return described


def main(spec_path, rank):
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # test_ddp.py asks a hung rank where it waits
    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(1)
    runs = [rank_spec(one, rank) for one in spec["runs"]]
    early = {run_number: make_rank_loader(open_dataset(one.get("path", spec["path"])), one)
             for run_number, one in enumerate(runs) if one.get("early")}
    dist.init_process_group("gloo", rank=rank, world_size=spec["world_size"],
                            timeout=datetime.timedelta(seconds=spec["timeout"]))
    if str(rank) in spec.get("cgroups", {}):  # joined now, its memory so far stays charged where it was
        with open(spec["cgroups"][str(rank)], "w") as f:
            f.write(f"{os.getpid()}\n")
    dataset = open_dataset(spec["path"])
    results = [run(dataset, one, early.get(run_number)) for run_number, one in enumerate(runs)]
    dist.barrier()  # as a trainer's last checkpoint: a rank that ends its epochs sooner waits for the others
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
