"""The checks of a store's shard files: in full against the index when first opened, then by fingerprint.

NOTE [shard fingerprint]: as for one file (NOTE [fingerprint] in
datasets.py), a shard's ``(size, mtime_ns, inode)`` is taken when it is
first opened and checked (its size against the index, its structure, offsets
and labels), and compared again when it is reopened. While a shard stays
open it is compared at most once every RECHECK_SECONDS, not before every
batch: a sorted batch of shuffled samples touches many shards, and one
``os.stat`` per shard per batch cost a quarter to a third of the rate.
Measured on 2 shared cores, read_batch of sorted shuffled batches of 256
over 8,000 raw 64x64 images, best of 7 epochs, 3 runs: one file 555-723k
img/s; 2000-sample shards (4 parts a batch) 447-590k, with a stat per part
256-492k; 250-sample shards (32 parts) 371-432k, with a stat 299-323k;
32-sample shards (162 parts) 119-196k, with a stat 72-141k. A shard
truncated under a reader is thus reported within a second of reading it,
where the window of one file is one batch. One file is a store of one shard,
compared before every read.
"""

from fastdata.errors import FormatError
from fastdata.formats.shards import INDEX_NAME, shard_differences, shard_mismatch
from fastdata.reading import sources

RECHECK_SECONDS = 1.0  # see NOTE [shard fingerprint]


class ShardChecks:
    """The checks of ShardStore's files (store.py), mixed into it: what a shard file was when checked, and whether
    it still is (see NOTE [shard fingerprint]).

    Uses the store's ``index``, ``source``, ``_read``, ``_paths``, ``_path(shard)`` and ``_fingerprints``
    (shard -> the fingerprint its file was checked with).
    """

    def check_unchanged(self, shard, stat):
        """Raise FormatError unless ``stat`` of ``shard``'s file matches the fingerprint it was checked with.

        ``stat``: an ``os.stat_result`` (of the descriptor the caller reads), or None where the file is gone.
        """
        self._compare_fingerprint(shard, None if stat is None else sources.fingerprint_of(stat))

    def changed_files(self):
        """Return ``{path: what changed}`` of the local shard files that are not the ones this store was opened on.

        A shard checked in this process is compared with its fingerprint, any other with its size in the index
        (one stat per shard: for explaining a failure, not for every batch). A cached store's copies: none.
        """
        if self.source.local_paths is None:
            return {}
        changed = {}
        for shard, path in enumerate(self.source.local_paths):
            try:
                now = self.source.fingerprint(path)
            except FileNotFoundError:
                now = None
            before = self._fingerprints.get(shard)
            if before is not None and now != before:
                changed[path] = _change(before, now)
            elif before is None and (now is None or now[0] != self.index.sizes[shard]):
                size = self.index.sizes[shard]
                changed[path] = "was deleted" if now is None else f"has {now[0]} bytes, the index says {size}"
        return changed

    def _check_unchanged(self, shard):
        """Raise FormatError if ``shard`` is not the file it was when first checked (see NOTE [shard fingerprint])."""
        try:
            now = self.source.fingerprint(self._path(shard))
        except FileNotFoundError:
            now = None
        self._compare_fingerprint(shard, now)

    def _compare_fingerprint(self, shard, now):
        before = self._fingerprints[shard]
        if now != before:
            raise FormatError(
                f"{self._paths[shard]!r} {_change(before, now)} after this dataset was opened; a packed file must "
                "not change while it is read. Open it again (open_dataset) to read the new file, or put the old one "
                "back."
            )

    def _checked(self, shard, path):
        """Return the Columns of ``shard``'s file ``path``, checked in full: size, structure, samples, fingerprint."""
        try:
            fingerprint = self.source.fingerprint(path)
        except FileNotFoundError:
            raise self._damaged(shard, "is missing") from None
        if fingerprint[0] != self.index.sizes[shard]:
            raise self._damaged(shard, f"has {fingerprint[0]} bytes, the index says {self.index.sizes[shard]}")
        try:
            columns, metadata = self._read(path)
        except FormatError as exc:
            raise self._damaged(shard, f"is damaged ({exc})") from exc
        expected = int(self.index.starts[shard + 1] - self.index.starts[shard])
        differ = shard_differences(metadata, self.index.metadata)
        if metadata["num_samples"] != expected or differ:
            raise self._damaged(shard, f"holds {metadata['num_samples']} samples, the index says {expected}" if
                                not differ else f"differs from the dataset in {', '.join(differ)}")
        if (mismatch := shard_mismatch(self.index, shard, metadata)) is not None:  # see NOTE [shard identity]
            raise self._damaged(shard, mismatch)
        self._fingerprints[shard] = fingerprint
        return columns

    def _damaged(self, shard, what):
        return FormatError(
            f"{self._paths[shard]!r} {what}: shard {shard} of {self.index.root!r} does not match its {INDEX_NAME}. "
            + self.source.damage_advice()
        )


def _change(before, now):
    if now is None:
        return "was deleted"
    if now[2] != before[2]:
        return "was replaced by another file"
    if now[0] != before[0]:
        return f"changed size from {before[0]} to {now[0]} bytes"
    return "was modified"
