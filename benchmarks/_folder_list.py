"""The raw-folder baseline with its paths in a Python list (row (b) of the image section).

A module of its own so that only the rows using it import the raw-folder
Dataset (from _datasets, which re-exports it from where it lives).
"""

from _datasets import RawFolderDataset


class RawFolderListDataset(RawFolderDataset):
    """RawFolderDataset with its paths in a Python list, as most tutorials keep them.

    Items are the same; each worker touches the reference count of every
    path it reads, which copies the pages holding those str objects (see
    the memory section).
    """

    def __init__(self, paths, labels, size):
        super().__init__(paths, labels, size)
        self.paths = [str(path) for path in paths]
