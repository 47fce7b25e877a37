"""Results for people and files: a measured row, Markdown tables, JSON."""

import json
import os
from dataclasses import dataclass, field


@dataclass
class Row:
    """One measured method: its key, what it is, its workers as shown, and how to build it.

    ``build`` is the caller's: a loader factory in `fastdata bench`, a
    module-level factory of epoch functions called with ``options`` in
    benchmarks/ (rows travel to fresh processes there). ``kind`` groups rows
    a caller treats alike.
    """

    key: str
    method: str
    workers: str  # as shown: "0 (defaults)", "2 (persistent)", "2 threads"
    build: object = None
    options: dict = field(default_factory=dict)
    kind: str = ""
    memory: bool = False  # record the memory of the worker processes
    limit: bool = False  # a limit row (see limits.py), not a loader
    dataset: object = None  # `fastdata bench`: the dataset whose read paths this row's loader counts in this process

    def result(self, rate, **more):
        """Return this row's line of results: key, method, workers, ``more``, then the Rate's fields."""
        return {"key": self.key, "method": self.method, "workers": self.workers, **more, **rate.to_dict()}


def markdown_table(headers, rows, align=None):
    """Return a Markdown table; ``align`` is a string of "l"/"r" per column."""
    align = align or "l" * len(headers)
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]

    def line(values):
        padded = [v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(values, widths, align)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2)) for w, a in zip(widths, align)) + "|"
    return "\n".join([line([str(h) for h in headers]), rule, *(line(row) for row in cells)])


def write_json(data, path):
    """Write ``data`` as indented JSON to ``path`` (replacing it); return ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    return os.fspath(path)
