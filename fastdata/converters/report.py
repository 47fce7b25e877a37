"""What a conversion did: counts, timing and every input it could not use."""

from dataclasses import dataclass, field

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
    """

    path: str
    num_samples: int
    skipped: list = field(default_factory=list)
    seconds: float = 0.0
    unit: str = "img"

    def __str__(self):
        rate = self.num_samples / self.seconds if self.seconds else 0.0
        lines = [
            f"wrote {self.path!r}: {self.num_samples} samples in {self.seconds:.1f}s "
            f"({rate:,.0f} {self.unit}/s), {len(self.skipped)} skipped"
        ]
        for source, reason in self.skipped[:_SHOWN_SKIPS]:
            lines.append(f"  skipped {source}: {reason}")
        if len(self.skipped) > _SHOWN_SKIPS:
            lines.append(
                f"  ... and {len(self.skipped) - _SHOWN_SKIPS} more "
                f"(all listed by: fastdata info {self.path})"
            )
        return "\n".join(lines)
