"""The machine a measurement ran on: CPU, memory, versions of the packages that matter, the code's commit."""

import datetime
import importlib.util
import os
import platform
import subprocess
from importlib import metadata

from fastdata._cpu import usable_cpus
from fastdata._optional import optional


def available_memory():
    """Return the bytes of memory available to new allocations, or None where unknown."""
    return _memory("available", "MemAvailable")


def _memory(psutil_field, meminfo_key):
    """Return one ``psutil.virtual_memory()`` field, else the matching /proc/meminfo line, in bytes; or None."""
    psutil = optional("psutil")
    if psutil is not None:
        return getattr(psutil.virtual_memory(), psutil_field)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields[meminfo_key].split()[0]) * 1024  # "MemTotal:   N kB"
    except (OSError, KeyError, ValueError):
        return None


_VERSIONS = ("fastdata", "torch", "numpy", "pillow", "h5py", "pyarrow")


def describe_machine():
    """Describe this machine and the software versions, for a results file."""
    fastdata_file = _origin("fastdata")
    package = os.path.dirname(fastdata_file) if fastdata_file else None
    commit = _git(package, "rev-parse", "HEAD")  # of the checkout fastdata is imported from
    changes = _git(package, "status", "--porcelain", "--untracked-files=no", "--", ".")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "cpu_model": _cpu_model(),
        "ram_bytes": _memory("total", "MemTotal"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: installed_version(name) for name in _VERSIONS},
        "fastdata_file": fastdata_file,
        "fastdata_git_commit": commit,
        "fastdata_git_dirty": None if commit is None else bool(changes),
    }


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def installed_version(name):
    """Return the installed version of package ``name``, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _origin(name):
    spec = importlib.util.find_spec(name)  # where it would be imported from, without importing it
    return spec.origin if spec else None


def _git(folder, *args):
    if folder is None:
        return None
    try:
        done = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
