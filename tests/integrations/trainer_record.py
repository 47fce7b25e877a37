"""What a rank of a trainer run (lightning_run.py, accelerate_run.py) records: which samples each batch held.

A run's SPEC is a JSON file: ``path`` (a packed file), ``out`` (a folder),
``name`` (of the run), ``num_workers``, ``batch_size`` (per rank), ``epochs``,
``made`` ("early": the loader is made before the process group exists, or
"late": after), ``checkpoint_step`` (the global step after which a
checkpoint is saved) and ``resume`` (a checkpoint to resume from, or None).
Each rank writes ``out/<name>-rank<RANK>.json``: ``len`` (of its loader),
``steps`` (per batch ``[epoch, global step, sample indices]``), ``validated``
(validation batches).
"""

import hashlib
import json
import os
import sys

import numpy as np

from fastdata import make_loader, open_dataset

SEED = 4


def read_spec():
    with open(sys.argv[1]) as f:
        return json.load(f)


def loader_of(spec):
    """Return the run's loader: shuffle=True, rank and world size left to torch.distributed.

    The file fits the page cache, so shuffle=True is "uniform"; rank 0 decides it for every rank.
    """
    return make_loader(open_dataset(spec["path"]), spec["batch_size"], shuffle=True, seed=SEED,
                       num_workers=spec["num_workers"], multiprocessing_context="fork" if spec["num_workers"] else None)


def image_key(image):
    return hashlib.blake2b(np.ascontiguousarray(image).tobytes(), digest_size=8).hexdigest()


class Samples:
    """Find each image's sample index in the file by its bytes; record the batches of this rank."""

    def __init__(self, path):
        images = open_dataset(path).read_batch(np.arange(len(open_dataset(path))))[0].numpy()
        self.index = {image_key(image): i for i, image in enumerate(images)}
        assert len(self.index) == len(images), "test images should differ from each other"
        self.steps, self.length, self.validated = [], None, 0

    def record(self, epoch, step, images):
        """Record the sample indices of ``images`` (uint8 ``[B, 3, H, W]``), global ``step`` of ``epoch``."""
        self.steps.append([int(epoch), int(step), [self.index[image_key(image)] for image in images.numpy()]])

    def write(self, spec, rank):
        with open(os.path.join(spec["out"], f"{spec['name']}-rank{rank}.json"), "w") as f:
            json.dump({"len": self.length, "steps": self.steps, "validated": self.validated}, f)
