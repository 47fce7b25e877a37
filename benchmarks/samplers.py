"""Memory baselines and the samplers of the sweeps (raw-file baselines: fastdata.measure.baselines).

Kept at module level so that spawned DataLoader workers can unpickle them
(imports torch; the image ones live in _datasets.py and _folder_list.py).
"""

import numpy as np
from torch.utils.data import Dataset

# ---------------------------------------------------------------- memory baselines


class PathListDataset(Dataset):
    """One Python str per sample (``self.paths``), as an ImageFolder-style list keeps them.

    Items are ``(len(path), label)``: no file is read, so a pass measures
    what holding the per-sample objects costs, not decoding.
    """

    def __init__(self, paths, labels):
        self.paths = list(paths)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        return len(self.paths[index]), int(self.labels[index])


class RecordListDataset(Dataset):
    """One Python dict per sample (``{"path": str, "label": int}``), as JSON-manifest datasets keep them."""

    def __init__(self, paths, labels):
        self.records = [{"path": path, "label": int(label)} for path, label in zip(paths, labels)]

    def __len__(self):
        return len(self.records)

    def __getitem__(self, index):
        record = self.records[index]
        return len(record["path"]), record["label"]


class PathArrayDataset(Dataset):
    """The same paths in one numpy array (``np.asarray(paths)``, fixed-width str) and labels int64 ``[N]``."""

    def __init__(self, paths, labels):
        self.paths = np.asarray(paths)
        self.labels = np.asarray(labels, dtype=np.int64)

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        return len(str(self.paths[index])), int(self.labels[index])


# ---------------------------------------------------------------- samplers


class StreamBatches:
    """Yield sorted int64 index batches of shuffled epochs without end (full batches only).

    Used as a ``batch_sampler`` so that a pass can be any number of batches
    from one running iterator: workers stay busy across epoch boundaries
    and a pass need not be a whole epoch of a small file.

    Args:
        num_samples: size of the dataset.
        batch_size: samples per batch (at most ``num_samples``).
        seed: seed of the permutations.
    """

    def __init__(self, num_samples, batch_size, seed=0):
        self.num_samples, self.batch_size, self.seed = num_samples, min(batch_size, num_samples), seed

    def __len__(self):
        return 2**31 - 1  # endless; DataLoader only needs a number

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        while True:
            order = rng.permutation(self.num_samples)
            for start in range(0, self.num_samples - self.batch_size + 1, self.batch_size):
                yield np.sort(order[start : start + self.batch_size])


class EpochBatches(StreamBatches):
    """``num_batches`` batches of StreamBatches per iteration: an epoch of a chosen length.

    Counts epochs like fastdata's samplers (``epoch``, ``set_epoch``; the
    count advances when an iteration starts), so a loader that reads ahead
    into the next epoch treats it as it treats its own sampler.
    """

    def __init__(self, num_samples, batch_size, num_batches, seed=0):
        super().__init__(num_samples, batch_size, seed)
        self.num_batches = num_batches
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_batches

    def __iter__(self):
        stream = StreamBatches(self.num_samples, self.batch_size, [self.seed, self.epoch])
        self.epoch += 1
        for _, batch in zip(range(self.num_batches), stream):
            yield batch
