"""URLs of shard folders: telling them from local paths, their file system, their index."""

import os
import re

from fastdata._optional import require
from fastdata.errors import MissingDependencyError, NotFoundError
from fastdata.formats.shards import INDEX_NAME, parse_index
from fastdata.storage.retry import retried, retry_policy

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_EXTRAS = {"s3": "s3", "s3a": "s3"}  # scheme -> fastdata's extra that installs its backend


def is_url(path):
    """Return whether ``path`` (a str or PathLike) is a URL such as ``s3://bucket/train/`` rather than a local path."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        return False
    text = os.fspath(path)
    return isinstance(text, str) and bool(_SCHEME.match(text))


def filesystem(url, storage_options=None):
    """Return ``(fs, path)``: the fsspec file system of ``url`` and the path within it.

    Args:
        url: an fsspec URL, e.g. ``s3://bucket/train``.
        storage_options: keywords for the file system (credentials, ``endpoint_url``...).

    Raises:
        MissingDependencyError: fsspec, or the backend of the URL's scheme, is not installed.
    """
    scheme = url.split("://", 1)[0].lower()
    extra = _EXTRAS.get(scheme, "s3")
    fsspec = require("fsspec", extra, f"reading {url!r}")
    options = _with_timeouts(scheme, dict(storage_options or {}))
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:  # fsspec names the backend package it lacks
        hint = f"pip install 'fastdata[{extra}]'" if scheme in _EXTRAS else "install the fsspec backend it names"
        raise MissingDependencyError(f"reading {url!r} needs a package for {scheme}://: {exc}; {hint}") from exc
    if scheme in _EXTRAS:
        fs.retries = 1  # s3fs's own loop around each call (a class default of 5)
    return fs, path


def _with_timeouts(scheme, options):
    """Return fsspec ``options`` with one backend attempt a call and the policy's timeouts, unless they set their own.

    See NOTE [one retry layer] and NOTE [retry budget] in retry.py.
    """
    timeout = retry_policy().timeout
    if scheme in _EXTRAS:  # botocore: one attempt (ours retry), connect and read timeouts
        options["config_kwargs"] = {"retries": {"total_max_attempts": 1}, "connect_timeout": timeout,
                                    "read_timeout": timeout, **options.get("config_kwargs", {})}
    elif scheme in ("http", "https") and "timeout" not in options.get("client_kwargs", {}):
        aiohttp = require("aiohttp", "s3", f"reading {scheme}:// URLs")
        options["client_kwargs"] = {**options.get("client_kwargs", {}),
                                    "timeout": aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout)}
    return options


# NOTE [one retry layer]: every remote call of fastdata goes through
# ``retried`` (retry.py), which knows which errors are worth another try and
# names the URL when it gives up. botocore (5 attempts by default) and s3fs
# (5 around each call, for timeouts and SlowDown) retry as well, so the
# layers multiplied: through a proxy failing every request with 503, reading
# an index made 30 requests and took over a minute before its error, and a
# port nobody listens on took 47 s. For s3:// s3fs's loop makes one attempt,
# and botocore's too unless ``storage_options`` sets its retries
# (``config_kwargs={"retries": ...}``); ours makes RETRY_ATTEMPTS: 6
# requests and 3.5 s to the error for that port.


# NOTE [one index request]: opening a URL costs round trips before the
# first shard is asked for. s3fs's cat_file of a whole object asks for its
# size first (a HEAD, to split big objects into concurrent ranges); a range
# from byte 0 is one GET, on any fsspec file system. With open_dataset
# reading the index once (it passes it to the class it picks), opening went
# from 4 requests to 1: 0.127 s to 0.043 s through a 20 ms proxy
# (s3fs's debug log of the calls; the streaming section's 224 px jpeg folder).


def join(url, name):
    """Return the URL of file ``name`` in the folder ``url``."""
    return url.rstrip("/") + "/" + name


def read_remote_index(url, storage_options=None):
    """Fetch and check ``url/index.json`` (retried); return a ShardIndex whose root is ``url`` without a final "/".

    Raises:
        NotFoundError: there is no index at ``url``.
        FormatError: the index is damaged or from a newer fastdata.
        RemoteError: the storage kept failing.
    """
    root = os.fspath(url).rstrip("/")
    where = join(root, INDEX_NAME)
    fs, path = filesystem(where, storage_options)
    try:
        data = retried(lambda: fs.cat_file(path, start=0), where)  # see NOTE [one index request]
    except FileNotFoundError as exc:
        raise NotFoundError(
            f"{where!r} does not exist: {root!r} is not a finished shard folder. Check the URL, or finish the "
            "conversion that writes it (run it again with --resume)."
        ) from exc
    return parse_index(data, where, root)
