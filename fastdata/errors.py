"""Exceptions raised by fastdata; each also derives from the matching builtin.

The command line prints any FastdataError as one line (``--debug`` shows the
traceback); anything else is a bug and shows its traceback.
"""


class FastdataError(Exception):
    """Base class of every error fastdata raises on purpose."""


class OptionError(FastdataError, ValueError):
    """An argument of a function, or an option of a command, has a bad value."""


class NotFoundError(FastdataError, FileNotFoundError):
    """A file or folder fastdata was given, or should write into, does not exist."""


class OutputExistsError(FastdataError, FileExistsError):
    """The output file exists and replacing it was not asked for (``overwrite``)."""


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


class DiskFullError(FastdataError, OSError):
    """The disk fastdata writes to (a shard cache, an output folder) has no room left."""


class RemoteError(FastdataError, OSError):
    """A remote file (a URL) could not be read or written, after retrying what looked transient."""


class FastPathWarning(UserWarning):
    """A fast read path cannot apply to this data or system: batches are read a slower way (the message says why)."""
