"""Baselines that fastdata is measured against: raw files read and decoded per item.

torch is imported on first use (see NOTE [whole epochs] in bench.py), so
benchmark scripts importing this stay light.
"""

import numpy as np
from PIL import Image


def load_resized(path, size):
    """Decode ``path`` fully (no draft) and resize as torchvision's ``Resize(size)`` + ``CenterCrop(size)``.

    The shorter side becomes ``size`` (the longer one ``int(size * long /
    short)``), bilinear, then a centered crop with ``round((side - size) / 2)``
    offsets.

    Returns:
        uint8 ``[size, size, 3]``.
    """
    with Image.open(path) as img:
        img = img.convert("RGB")
    width, height = img.size
    if width <= height:
        new_size = (size, int(size * height / width))
    else:
        new_size = (int(size * width / height), size)
    img = img.resize(new_size, Image.Resampling.BILINEAR)
    left = int(round((new_size[0] - size) / 2.0))
    top = int(round((new_size[1] - size) / 2.0))
    return np.array(img.crop((left, top, left + size, top + size)))  # writable, as PILToTensor's copy


class RawFolderDataset:
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
        import torch  # on first use, see the module docstring

        pixels = load_resized(str(self.paths[index]), self.size)
        return torch.from_numpy(pixels).permute(2, 0, 1), int(self.labels[index])


class RawTextDataset:
    """Read and tokenize one ``.txt`` file per item: the raw-text baseline.

    Items are ``(ids int64 [L], label int)``, encoded by ``tokenizer`` (e.g.
    the one a packed file was converted with) as the converter reads them.
    """

    def __init__(self, paths, labels, tokenizer):
        self.paths = np.asarray(paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        import torch  # on first use, see the module docstring

        with open(str(self.paths[index]), encoding="utf-8-sig") as f:
            ids = self.tokenizer.encode(f.read())
        return torch.from_numpy(ids), int(self.labels[index])


class PadCollate:
    """Collate ``(ids int64 [L], label)`` items into ``(ids [B, T], lengths [B], labels [B])``, padded with pad_id."""

    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, items):
        import torch
        from torch.nn.utils.rnn import pad_sequence

        ids = [item[0] for item in items]
        lengths = torch.tensor([len(i) for i in ids], dtype=torch.int64)
        labels = torch.tensor([item[1] for item in items], dtype=torch.int64)
        return pad_sequence(ids, batch_first=True, padding_value=self.pad_id), lengths, labels


class PerItem:
    """A dataset seen through ``__getitem__`` only, so a stock DataLoader reads it item by item."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]


