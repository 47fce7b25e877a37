"""Exceptions raised by fastdata; each also derives from the matching builtin."""


class FastdataError(Exception):
    """Base class of every error fastdata raises on purpose."""


class FormatError(FastdataError, ValueError):
    """A file is missing, foreign, truncated or from another format version."""


class SampleError(FastdataError, ValueError):
    """One input sample could not be used.

    Attributes:
        path: the input file the sample came from.
        index: position of the sample in the sorted input, or None.
    """

    def __init__(self, message, path=None, index=None):
        super().__init__(message)
        self.path = path
        self.index = index


class SourceError(FastdataError, ValueError):
    """A conversion source has nothing usable in it (empty, wrong layout)."""


class MissingDependencyError(FastdataError, ImportError):
    """An optional package is needed for this feature and is not installed."""
