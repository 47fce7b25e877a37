"""Ranks agree on a loader: its dataset, the settings of its order and where it resumes, compared by one collective.

NOTE [rank agreement]: every rank of a process group builds its own loader,
and nothing else makes them equal: with another seed on one rank an epoch
silently missed 26 of 101 samples and repeated 33 (2 gloo ranks, uniform
order), another dataset on one rank was mixed in, another shuffle mixed two
orders, and another batch size, remainder or a resume state loaded on one
rank only gave the ranks different numbers of steps, so the training loop's
collectives waited out the process group's timeout. So at a loader's first
iteration, in the process that iterates it (never in its workers), each rank
hashes each of FIELDS to one int64 and the ranks compare these rows with one
``all_gather`` of a [len(FIELDS)] tensor (on the CPU, or the current CUDA
device for nccl). Where the rows differ, every rank sees it in the same
gathered rows, so every rank then gathers the readable settings (a second
and third collective, only then) and raises the same OptionError naming each
setting that differs and which ranks hold which value. The group stays
usable after the refusal: every rank ran the same collectives.

It runs for a loader over an EpochSampler (make_loader's own, a
BucketBatchSampler) sharded over the whole default process group
(``world_size`` equal to the group's, more than 1); a loader of
``world_size=1`` (evaluation on rank 0 alone) or of a subgroup is not
compared. It runs once per loader, at its first iteration under the group
(the first one the ranks compared): an extra iteration on one rank later (a
peek at a batch on rank 0) adds no collective that the others would not
match. A state loaded before that iteration (as trainers resume) is
compared with the others' positions; one loaded later is not.

Measured on 2 shared cores (load ~5-6), 2 gloo ranks on loopback, 200
checks per run, 3 runs: 0.4-0.8 ms at best, 1.0-5.4 ms median, make_loader's
sampler or a BucketBatchSampler (hashing the settings: 70-290 us of it).
It is paid once per loader: against one epoch of 5,000 cached 64 px raw
images in batches of 128 (20 a rank, 14-94 ms) up to a third of the first
epoch at the worst median, 1-2% at best; an epoch of real size hides it.
"""

import hashlib
import json
import os

import numpy as np
import torch.distributed as dist

from fastdata.errors import OptionError
from fastdata.loading.collectives import gather_objects, gather_rows
from fastdata.loading.samplers import EpochSampler

FIELDS = ("sampler", "dataset", "num_samples", "batch_size", "shuffle", "seed", "block_size", "window", "remainder",
          "pool_batches", "lengths", "position")
_ADVICE = {
    "sampler": "use the same kind of batch sampler on every rank",
    "dataset": "open the same dataset on every rank (a copy of it is fine)",
    "num_samples": "open the same dataset on every rank",
    "lengths": "pass the same lengths to BucketBatchSampler on every rank",
    "position": "load the same state_dict on every rank (or none) and call set_epoch with the same epoch",
}


def check_agreement(loader) -> bool:
    """Compare ``loader`` with the other ranks' where it is sharded over the process group; see NOTE [rank agreement].

    Args:
        loader: a BatchLoader or WorkerLoader about to begin an iteration.

    Returns:
        whether the ranks compared it (False: no group yet, or not sharded over the whole group).

    Raises:
        OptionError: naming each setting that differs between the ranks and the ranks holding each value.
    """
    sampler = loader.sampler
    if not isinstance(sampler, EpochSampler) or not (dist.is_available() and dist.is_initialized()):
        return False
    sampler.bind()
    world_size = dist.get_world_size()
    if world_size == 1 or sampler.world_size != world_size:
        return False
    settings = loader_settings(loader)
    rows = gather_rows(_digest(settings))
    if (rows == rows[0]).all():
        return True
    everyone = gather_objects(settings)
    differing = [field for k, field in enumerate(FIELDS) if not (rows[:, k] == rows[0, k]).all()]
    raise OptionError(_disagreement(everyone, differing))


def loader_settings(loader) -> dict:
    """Return the readable settings of FIELDS that decide which samples ``loader`` yields on this rank."""
    sampler, dataset = loader.sampler, loader.packed_dataset
    described = sampler.describe()
    lengths = getattr(sampler, "lengths", None)  # a BucketBatchSampler's
    if lengths is not None:
        lengths = hashlib.blake2b(np.ascontiguousarray(lengths), digest_size=8).hexdigest()
    return {
        "sampler": type(sampler).__name__,
        "dataset": getattr(dataset, "fingerprint", None) or f"{type(dataset).__name__} of {len(dataset)} samples",
        "path": os.path.basename(os.fspath(getattr(dataset, "path", "") or "")),  # shown, not compared
        "num_samples": sampler.num_samples,
        "batch_size": sampler.batch_size,
        **{field: described.get(field) for field in ("shuffle", "seed", "block_size", "window", "remainder",
                                                      "pool_batches")},
        "lengths": lengths,
        "position": [sampler.epoch, sampler.start_step],
    }


def _digest(settings):
    """Return one signed 64-bit hash per field of FIELDS."""
    return [int.from_bytes(hashlib.blake2b(json.dumps(settings[field], sort_keys=True, default=str).encode(),
                                           digest_size=8).digest(), "little", signed=True) for field in FIELDS]


def _disagreement(everyone, differing):
    """Return the message naming each differing field with the ranks holding each value."""
    parts = []
    for field in differing:
        holders = {}
        for rank, settings in enumerate(everyone):
            holders.setdefault(_shown(field, settings), []).append(rank)
        values = " vs ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                             for value, ranks in holders.items())
        parts.append(f"{values}: {_ADVICE.get(field, f'pass the same {field} on every rank')}")
    return f"the ranks' loaders differ, so they would not read one global order: {'; '.join(parts)}"


def _shown(field, settings):
    value = settings[field]
    if field == "dataset":
        return f"dataset {settings['path']!r} ({value})" if settings["path"] else f"dataset {value}"
    if field == "position":
        return f"position epoch {value[0]} step {value[1]}"
    return f"{field}={value!r}"
