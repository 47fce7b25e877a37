"""The values of the command line's options: byte sizes, durations, counts, sizes, parts, storage options.

Each parser raises OptionError (or click's error, for a ParamType) naming the option and what it takes.
"""

import json
import re

import click

from fastdata.errors import OptionError


class ByteSize(click.ParamType):
    """A number of bytes: plain (65536), or with a unit, decimal (64MB, 1GB) or binary (256MiB)."""

    name = "size"
    _UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    _PATTERN = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([a-z]*)\s*", re.IGNORECASE)

    def convert(self, value, param, ctx):
        match = self._PATTERN.fullmatch(str(value))
        unit = match and self._UNITS.get(match[2].lower())
        size = int(float(match[1]) * unit) if unit else 0
        if size < 1:
            self.fail(f"should be a positive number of bytes: plain, or with a unit (64MB, 256MiB, 1GB), "
                      f"got {value!r}", param, ctx)
        return size


def parse_counts(name, text):
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise OptionError(f"{name} should be non-negative integers separated by commas, e.g. 0,2; got {text!r}")
    return counts


_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(s|sec|m|min|h)?\s*", re.IGNORECASE)
_SECONDS_PER = {None: 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}


def parse_duration(name, text):
    match = _DURATION.fullmatch(text)
    seconds = float(match[1]) * _SECONDS_PER[match[2] and match[2].lower()] if match else 0
    if not seconds > 0:
        raise OptionError(f"{name} should be a positive duration: seconds (60, 60s) or minutes (2m), got {text!r}")
    return seconds


def parse_part(text):
    """Return ``"I/N"`` as ``(I, N)``; None for None."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not int(match[1]) < int(match[2]):
        raise OptionError(f"--part should be I/N with 0 <= I < N (e.g. 0/4 for the first of 4 parts), got {text!r}")
    return int(match[1]), int(match[2])


_TEXT_OPTIONS = ("key", "secret", "token", "password", "username", "profile")  # kept as given, even "0123"


def parse_storage_options(pairs):
    """Return ``("KEY=VALUE", ...)`` as a dict, each VALUE read as JSON where it is (true, 3, {...}); None if empty."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OptionError(f"--storage-option should be KEY=VALUE (e.g. endpoint_url=http://host:9000), "
                              f"got {pair!r}")
        try:
            options[key] = value if key in _TEXT_OPTIONS else json.loads(value)
        except ValueError:
            options[key] = value
    return options or None


def parse_size(text):
    parts = text.lower().split("x")
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise OptionError(f"--size should be N or HxW with positive integers, got {text!r}")
    return sizes[0] if len(sizes) == 1 else tuple(sizes)
