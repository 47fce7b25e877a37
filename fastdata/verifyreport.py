"""What `fastdata verify` found: a report of problems, each naming the damaged samples."""

from dataclasses import dataclass, field

import numpy as np

from fastdata.formats.layout import CHECKSUM_ALGORITHM, chunk_checksums


@dataclass
class Problem:
    """One kind of damage found in a file.

    Attributes:
        check: the check that found it: "structure", "checksum", "offsets", "labels", "jpeg" or "tokens";
            in a shard folder also "index", "shard" (a shard missing, of the wrong size or count) and
            "columns" (a column file missing, damaged, or not the shards' labels or lengths).
        message: what is wrong and where, for people.
        samples: int64 sorted indices of the damaged samples; empty where they cannot be told.
    """

    check: str
    message: str
    samples: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


@dataclass
class VerifyReport:
    """What ``verify`` found in one file; ``ok`` when nothing is damaged."""

    path: str
    quick: bool = False
    format_version: int | None = None
    num_samples: int | None = None
    checked: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def ok(self):
        return not self.problems

    @property
    def damaged_samples(self):
        """int64 sorted indices of every sample a problem names."""
        return np.unique(np.concatenate([np.empty(0, np.int64)] + [p.samples for p in self.problems]))

    def __str__(self):
        about = f"format version {self.format_version}, {self.num_samples} samples; checked: " + (
            ", ".join(self.checked) or "nothing"
        )
        state = "ok" if self.ok else f"DAMAGED, {count_of(len(self.problems), 'problem')}"
        lines = [f"{self.path!r}: {state} ({about})"]
        lines += [f"  {problem.check}: {problem.message}" for problem in self.problems]
        lines += [f"  note: {note}" for note in self.notes]
        if not self.ok:
            lines.append('  the file is damaged: re-run "fastdata convert" (or restore a good copy)')
        return "\n".join(lines)


def count_of(number, noun):
    """Return ``"1 chunk"`` or ``"3 chunks"``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def mismatched_chunks(report, metadata, arrays, stored):
    """Yield ``(column name, int64 chunk indices, chunk bytes)`` of each of ``arrays`` whose checksums differ.

    ``stored``: the file's ``{column name: uint32 checksums}``. A damaged checksum description, or a column
    without as many checksums as chunks, is added to ``report`` as a structure problem.
    """
    info = metadata.get("checksums")
    chunk_bytes = info.get("chunk_bytes") if isinstance(info, dict) else None
    if not isinstance(info, dict) or info.get("algorithm") != CHECKSUM_ALGORITHM or not isinstance(chunk_bytes, int) \
            or chunk_bytes < 1:
        report.problems.append(Problem("structure", f"the checksum description is missing or damaged: {info!r}"))
        return
    for name, array in arrays.items():
        actual, expected = chunk_checksums(array, chunk_bytes), stored.get(name)
        if expected is None or len(expected) != len(actual):
            found = "no" if expected is None else len(expected)
            report.problems.append(Problem("structure", f"column {name!r}: {count_of(len(actual), 'chunk')} but "
                                                        f"{found} stored checksums"))
            continue
        chunks = np.flatnonzero(actual != expected)
        if len(chunks):
            yield name, chunks, chunk_bytes
    report.checked.append(f"{CHECKSUM_ALGORITHM} checksums")
