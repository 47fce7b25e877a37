"""Datasets mixed in set proportions: ``fastdata.mix({"web": a, "code": b}, weights={"web": 3, "code": 1})``.

NOTE [mixture order]: position ``i`` of an epoch is a sample of one source,
decided by arithmetic alone: the shares become whole counts ``c_s`` per
period of ``P`` positions (largest remainders, ``P`` = ``period``), laid out
evenly in one pattern (each position goes to the source furthest behind
its share), so every period holds exactly ``c_s`` samples of source ``s``
and any ``W`` consecutive positions within one of each share's
``W * c_s / P`` (proportions hold in every window, not only on average).
The ``n``-th draw of source ``s`` in an epoch is sample ``n % len(s)`` of
a permutation keyed by (seed, epoch, s, n // len(s)): a source that runs
out starts a new permutation (repeats, each sample once per cycle), one
with more samples than its share is cut, a different one each epoch.
Nothing is stored or counted as the epoch goes, so a mixture is a dataset
of positions: make_loader's ranks, workers and exact resume apply
unchanged, and the resumable state stays the loader's cursor (the
mixture's weights, seed and sources are its fingerprint: a state saved for
other weights is refused). The loader must read positions in order
(shuffle off): the sources are shuffled by the mixture itself.
"""

import hashlib
import json

import numpy as np
import torch

from fastdata.errors import OptionError

MIX_BY = ("samples", "tokens")
_PERMUTATIONS_KEPT = 16  # (epoch, source, cycle) permutations a process keeps


def mix(datasets, weights=None, *, by="samples", length=None, seed=0, period=1000):
    """Return a Mixture of ``datasets`` (a dict of name -> dataset) in proportion to ``weights``.

    Args:
        weights: name -> weight (any positive numbers); default: each dataset's length (every sample once
            an epoch, on average).
        by: "samples" (the weights are shares of samples) or "tokens" (shares of tokens: a text dataset's
            samples weigh their mean length, a TokenSequences' its seq_len).
        length: positions an epoch; default: the datasets' lengths summed.
        seed: keys every source's permutations.
        period: positions over which the shares are whole counts (NOTE [mixture order]).

    Example:
        >>> web, code = (TokenSequences(open_dataset(path), 2048, eod=0) for path in ("web.h5", "code.h5"))
        >>> loader = make_loader(mix({"web": web, "code": code}, weights={"web": 0.7, "code": 0.3}), 8)
    """
    return Mixture(datasets, weights, by=by, length=length, seed=seed, period=period)


class Mixture:
    """Samples of several datasets interleaved in set proportions (NOTE [mixture order]); read with shuffle off.

    A batch is the sources' batches joined in position order: tuples of tensors of one shape, or dict batches
    (zero-padded where a ragged field's width differs, as record batches are).
    """

    read_options = ("epoch",)

    def __init__(self, datasets, weights=None, *, by="samples", length=None, seed=0, period=1000):
        if not isinstance(datasets, dict) or not datasets:
            raise OptionError("mix takes a dict of name -> dataset, e.g. mix({'web': web, 'code': code})")
        self.names, self.sources = list(datasets), list(datasets.values())
        sizes = np.array([len(source) for source in self.sources], np.int64)
        if not sizes.all():
            raise OptionError(f"mix: {self.names[int(np.argmin(sizes))]!r} holds no sample")
        if by not in MIX_BY:
            raise OptionError(f"by should be one of {MIX_BY}, got by={by!r}")
        weights = _weights(weights, self.names, sizes)
        if by == "tokens":
            weights = weights / np.array([_tokens_per_sample(source, name) for name, source in datasets.items()])
        if isinstance(period, bool) or not isinstance(period, int) or period < len(self.sources):
            raise OptionError(f"period should be an integer of at least one position per source, got {period!r}")
        self.sizes, self.seed, self.period = sizes, seed, period
        self.counts = _whole_counts(weights / weights.sum(), period)
        self.pattern, self.ranks = _pattern(self.counts)
        self.length = int(sizes.sum()) if length is None else length
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise OptionError(f"length should be a positive number of positions, got length={length!r}")
        kinds = {getattr(source, "kind", None) for source in self.sources}
        self.kind = "image" if kinds == {"image"} else "mixture"  # image batches take the device's transforms
        self.path = "mix(" + ", ".join(self.names) + ")"
        self.is_remote = False
        described = {"sources": [getattr(source, "fingerprint", None) or len(source) for source in self.sources],
                     "names": self.names, "counts": self.counts.tolist(), "length": self.length, "seed": seed}
        self.fingerprint = hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]
        self._permutations = {}

    def __repr__(self):
        shares = ", ".join(f"{name} {count / self.period:.3f}" for name, count in zip(self.names, self.counts))
        return f"<Mixture of {len(self.names)}: {shares}; {self.length} positions an epoch>"

    def __len__(self):
        return self.length

    def __getstate__(self):
        return {**self.__dict__, "_permutations": {}}

    def locate(self, positions, epoch=0):
        """Return ``(source number, its sample index)`` of each of ``positions`` (int64) in ``epoch``."""
        positions = np.asarray(positions, np.int64)
        blocks, within = np.divmod(positions, self.period)
        sources = self.pattern[within]
        draws = blocks * self.counts[sources] + self.ranks[within]  # the n-th draw of its source this epoch
        cycles, picks = np.divmod(draws, self.sizes[sources])
        samples = np.empty(len(positions), np.int64)
        for key in set(zip(sources.tolist(), cycles.tolist())):
            mine = (sources == key[0]) & (cycles == key[1])
            samples[mine] = self._permutation(epoch, *key)[picks[mine]]
        return sources, samples

    def _permutation(self, epoch, source, cycle):
        key = (epoch, source, cycle)
        if key not in self._permutations:
            if len(self._permutations) >= _PERMUTATIONS_KEPT:
                self._permutations.pop(next(iter(self._permutations)))
            rng = np.random.default_rng([self.seed, epoch, source, cycle])
            self._permutations[key] = rng.permutation(int(self.sizes[source]))
        return self._permutations[key]

    def read_batch(self, indices, pin_memory=False, epoch=0, **options):
        """Return the batch of positions ``indices`` of ``epoch``: each source's rows read in one batch, joined."""
        indices = np.asarray(indices, np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= self.length):
            raise IndexError(f"position {int(indices[(indices < 0) | (indices >= self.length)][0])} is out of range "
                             f"for {self.length} positions of {self.path}")
        sources, samples = self.locate(indices, epoch)
        groups = [np.flatnonzero(sources == number) for number in range(len(self.sources))]
        pieces = [(self.names[number], self.sources[number].read_batch(samples[group], **options))
                  for number, group in enumerate(groups) if len(group)]
        order = torch.from_numpy(np.argsort(np.concatenate([group for group in groups if len(group)]),
                                            kind="stable"))
        batch = _joined(pieces, order, self.sources)
        if pin_memory:
            return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()} \
                if isinstance(batch, dict) else tuple(tensor.pin_memory() for tensor in batch)
        return batch

    def start_batches(self, indices, sizes, pin_memory=False, epoch=0, **options):
        """Read consecutive batches of ``sizes`` positions of ``indices`` as one (NOTE [grouped sequences] in
        sequences.py); return a function returning them, each as ``read_batch`` returns it."""
        whole = self.read_batch(indices, pin_memory, epoch, **options)
        wide = _batch_wide(whole, len(indices))
        batches, first = [], 0
        for size in sizes:
            batch = {key: value[first : first + size] for key, value in whole.items() if key not in wide}
            batches.append({**batch, **self.sources[0].derived_fields(batch)} if wide else batch)
            first += size
        return lambda: batches

    def batches_per_read(self, batch_size):
        """How many batches make_loader reads as one: as the sources say, where every one reads sequences."""
        if not all(hasattr(source, "batches_per_read") for source in self.sources):
            return 1
        return min(source.batches_per_read(batch_size) for source in self.sources)

    def max_batch_bytes(self, batch_size, **options):
        """The most bytes of a batch: the largest of the sources' (a batch of one source's rows)."""
        return max(source.max_batch_bytes(batch_size, **options) for source in self.sources)

    def changed_files(self):
        changed = {}
        for source in self.sources:
            changed.update(getattr(source, "changed_files", dict)())
        return changed


def _weights(weights, names, sizes):
    if weights is None:
        return sizes.astype(np.float64)
    if not isinstance(weights, dict) or set(weights) != set(names):
        raise OptionError(f"weights should give every dataset a weight: {names}, got {weights!r}")
    values = np.array([weights[name] for name in names], np.float64)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise OptionError(f"weights should be positive numbers, got {weights!r}")
    return values


def _tokens_per_sample(source, name):
    if hasattr(source, "seq_len"):  # TokenSequences: every sample is seq_len tokens
        return float(source.seq_len)
    if getattr(source, "kind", None) == "text":
        return max(float(np.asarray(source.lengths).mean()), 1.0)
    raise OptionError(f"by='tokens' weighs samples by their tokens; {name!r} is a "
                      f"{getattr(source, 'kind', type(source).__name__)!r} dataset: mix it by='samples'")


def _whole_counts(shares, period):
    """Return int64 counts per source summing to ``period``, each at least 1, by largest remainders."""
    exact = shares * period
    counts = np.maximum(np.floor(exact).astype(np.int64), 1)
    while counts.sum() > period:  # the floors of 1 took positions from the largest
        counts[np.argmax(counts)] -= 1
    remainders = exact - counts
    for number in np.argsort(-remainders, kind="stable")[: period - counts.sum()]:
        counts[number] += 1
    return counts


def _pattern(counts):
    """Return ``(source of each position of a period, its draw's rank in the period)``: sources evenly spread."""
    period = int(counts.sum())
    taken = np.zeros(len(counts), np.int64)
    sources, ranks = np.empty(period, np.int64), np.empty(period, np.int64)
    for position in range(period):
        behind = (position + 1) * counts / period - taken  # each source's share so far, less what it has
        number = int(np.argmax(behind))
        sources[position], ranks[position] = number, taken[number]
        taken[number] += 1
    return sources, ranks


def _joined(pieces, order, sources):
    """Join the sources' batches ``pieces`` (``(name, batch)``) and put the rows in position order.

    A dict batch's field that is not a row per sample (a TokenSequences' cu_seqlens) is made anew from the
    joined rows by the sources' ``derived_fields``.
    """
    batches = [batch for _, batch in pieces]
    if all(isinstance(batch, dict) for batch in batches):
        keys = list(batches[0])
        for name, batch in pieces:
            if list(batch) != keys:
                raise OptionError(f"mix: {name!r} gives fields {list(batch)}, {pieces[0][0]!r} gives {keys}; "
                                  "mix datasets of the same fields")
        rows = [len(next(value for value in batch.values() if isinstance(value, torch.Tensor))) for batch in batches]
        wide = sorted(set().union(*(_batch_wide(batch, count) for batch, count in zip(batches, rows))), key=keys.index)
        joined = {key: _rows([batch[key] for batch in batches], order, key, pieces, pad=True) for key in keys
                  if key not in wide}
        if wide:
            derive = {getattr(type(source), "derived_fields", None) for source in sources}
            if len(derive) != 1 or None in derive:
                raise OptionError(f"mix: the field(s) {', '.join(wide)} are not a row per sample, and the sources "
                                  "do not say how to make them for rows joined from several; mix datasets of one "
                                  "type, or leave those fields out")
            joined.update(sources[0].derived_fields(joined))
        return {key: joined[key] for key in keys}
    if any(isinstance(batch, dict) for batch in batches):
        raise OptionError("mix: some datasets give dict batches and others tuples; mix datasets of one kind")
    return tuple(_rows(list(column), order, number, pieces) for number, column in enumerate(zip(*batches)))


def _batch_wide(batch, rows):
    """Return the keys of a dict batch of ``rows`` rows whose tensors are not a row per sample (cu_seqlens)."""
    return [key for key, value in batch.items() if isinstance(value, torch.Tensor) and len(value) != rows]


def _rows(values, order, key, pieces, pad=False):
    """Return one column's values of every piece in position order: tensors concatenated, lists joined.

    ``pad``: a dict batch's ragged field, whose widths may differ, is zero-padded as record batches are (a tuple
    batch's tokens are padded with their file's own id: those must agree in width, batch by batch).
    """
    if not isinstance(values[0], torch.Tensor):
        joined = [item for value in values for item in value]
        return [joined[position] for position in order.tolist()]
    widths = {value.shape[1:] for value in values}
    if len(widths) > 1:
        if not pad or len({value.shape[2:] for value in values}) > 1 or values[0].dim() < 2:
            raise OptionError(f"mix: column {key!r} has rows of shapes {sorted(map(tuple, widths))} in "
                              f"{', '.join(name for name, _ in pieces)}; mix datasets of one sample shape")
        width = max(value.shape[1] for value in values)  # a ragged field, zero-padded as record batches are
        values = [torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, width - value.shape[1]))
                  for value in values]
    return torch.cat(values)[order]
