"""The usual PyTorch datasets that fastdata is compared against (imports torch)."""

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from _baselines import load_resized


class RawFolderDataset(Dataset):
    """Decode one image file per item with Pillow: the common ImageFolder-style baseline.

    Paths are a numpy array rather than a list, so DataLoader workers do not
    copy pages by touching refcounts. Items are ``(image uint8 [3, H, W], label int)``;
    the image is a permuted view, as torchvision's ``PILToTensor`` returns.
    """

    def __init__(self, paths, labels, size):
        self.paths = np.asarray(paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.size = size

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        pixels = load_resized(str(self.paths[index]), self.size)
        return torch.from_numpy(pixels).permute(2, 0, 1), int(self.labels[index])


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
