"""The one CPU count every layer may ask for."""

import os


def usable_cpus():
    """Return the number of CPU cores this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
