"""What a conversion did: counts, timing and every input it could not use.

Input names are printed quoted (``repr``), and reasons escaped where they
would not print on one line, so a newline in a file name can never split or
fake a line: one input is one line of the summary.
"""

import shlex
import warnings
from dataclasses import dataclass, field

from fastdata.errors import OptionError, SampleError

ON_ERROR = ("skip", "warn", "raise")
_SHOWN_SKIPS = 5


@dataclass
class ConversionReport:
    """Summary returned by every converter.

    Attributes:
        path: the packed file written.
        num_samples: samples stored.
        skipped: ``(input, reason)`` pairs for every input left out.
        seconds: wall-clock time of the conversion.
        unit: what a sample is called ("img", "doc").
        ignored: files left out as not inputs, by kind (".txt", "hidden", ...) -> count.
        finished: a resume found the output finished and intact: nothing was written.
        redone: ``(file name, what was wrong)`` of each file of a finished output that a resume found
            missing or damaged, and wrote again.
        redone_whole: the resume converted the whole output again for them (a text conversion).
    """

    path: str
    num_samples: int
    skipped: list = field(default_factory=list)
    seconds: float = 0.0
    unit: str = "img"
    ignored: dict = field(default_factory=dict)
    finished: bool = False
    redone: list = field(default_factory=list)
    redone_whole: bool = False

    def __str__(self):
        rate = self.num_samples / self.seconds if self.seconds else 0.0
        if self.finished:
            lines = [f"{self.path!r} is already finished: {self.num_samples} samples, {len(self.skipped)} skipped; "
                     f"every file as its index lists it, nothing rewritten (checked in {self.seconds:.1f}s)"]
        else:
            lines = [f"wrote {self.path!r}: {self.num_samples} samples in {self.seconds:.1f}s "
                     f"({rate:,.0f} {self.unit}/s), {len(self.skipped)} skipped" + _ignored_summary(self.ignored)]
        if self.redone:
            files = f"{len(self.redone)} missing or damaged " + ("file" if len(self.redone) == 1 else "files")
            lines[0] += f"; converted again whole for {files}" if self.redone_whole else f"; redid {files}"
        lines += [f"  redid {name!r}: it was {_printable(why)}" for name, why in self.redone]
        for source, reason in self.skipped[:_SHOWN_SKIPS]:
            lines.append(f"  skipped {source!r}: {_printable(reason)}")
        if len(self.skipped) > _SHOWN_SKIPS:
            path = shlex.quote(self.path) if self.path.isprintable() else repr(self.path)
            lines.append(
                f"  ... and {len(self.skipped) - _SHOWN_SKIPS} more "
                f"(all listed by: fastdata info --all {path})"
            )
        return "\n".join(lines)


def _ignored_summary(ignored):
    """``", 5 ignored (.txt: 3, hidden: 2)"``, or "" when nothing was ignored."""
    if not ignored:
        return ""
    kinds = ", ".join(f"{_printable(kind)}: {count}" for kind, count in ignored.items())
    return f", {sum(ignored.values())} ignored ({kinds})"


def _printable(text):
    """Return ``text`` as it is when it prints on one line, else escaped (``repr``)."""
    text = str(text)
    return text if text.isprintable() else repr(text)


def check_choice(name, value, choices):
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise OptionError(f"{name} should be one of {choices}, got {name}={value!r}")


def handle_bad_input(what, name, index, reason, on_error):
    """Apply the ``on_error`` policy to an unusable input: raise SampleError, warn, or pass.

    Args:
        what: "image" or "text", for the message.
        name: the input's path or name.
        index: its position in the sorted input.
        reason: why it cannot be used.
        on_error: "raise", "warn" or "skip".
    """
    if on_error == "raise":
        raise SampleError(
            f"cannot use {what} {name!r} (input {index}): {reason}; "
            "pass on_error='skip' (--on-error skip) to leave it out",
            path=name,
            index=index,
        )
    if on_error == "warn":
        warnings.warn(f"skipped {what} {name!r}: {reason}", stacklevel=4)
