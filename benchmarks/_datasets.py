"""The usual PyTorch datasets that fastdata is compared against (imports torch).

``RawFolderDataset`` lives in ``fastdata.measure.engine`` (`fastdata bench` compares
a user's folder with it) and is re-exported here.
"""

import h5py
from torch.utils.data import Dataset

from fastdata.measure.baselines import RawFolderDataset

__all__ = ["RawFolderDataset", "TutorialH5Dataset"]


class TutorialH5Dataset(Dataset):
    """What most h5py tutorials show: open the file in ``__init__``, index it per item.

    Items are ``(dset[index] uint8 [3, H, W] ndarray, label int)``; the labels
    are read into memory once. Only safe with 0 workers (an open HDF5 handle
    does not survive fork).
    """

    def __init__(self, path, name="samples"):
        self.file = h5py.File(path, "r")
        self.samples = self.file[name]
        self.labels = self.file["labels"][:]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index], int(self.labels[index])

    def close(self):
        self.file.close()
