"""Atomic output: a conversion writes into a hidden staging folder beside OUT.

OUT appears (by one rename) only once the file is complete; any failure,
Ctrl-C or SIGTERM removes the staging folder, so no half-written file is
ever left behind or mistaken for a finished one.
"""

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager

from fastdata.errors import FastdataError
from fastdata.formats import format_of


@contextmanager
def staged_output(out, overwrite=False):
    """Yield ``(staging_dir, staged_path)``; move ``staged_path`` to ``out`` on success.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is false.
        FastdataError: the disk filled up (nothing is left behind).
    """
    out = os.path.abspath(os.fspath(out))
    format_of(out)  # fail on a bad extension before any work
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"{out!r} already exists; pass --overwrite to replace it")
    parent, name = os.path.split(out)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"output folder {parent!r} does not exist")
    staging = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=parent)
    try:
        staged_path = os.path.join(staging, name)
        yield staging, staged_path
        os.replace(staged_path, out)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise FastdataError(
                f"no space left on the device while writing {out!r}; nothing was "
                "written. Free some space and run the conversion again."
            ) from exc
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
