"""The order of an epoch: which samples each global batch holds, computed for any step without listing the epoch.

NOTE [global order]: an epoch is a sequence of sample indices, a function of
(num_samples, seed, epoch, shuffle, block_size, window) alone. Global step
``s`` holds its positions ``[s * G, (s + 1) * G)`` for a global batch of ``G``
samples, and rank ``r`` of ``W`` takes the contiguous slice ``[r * G / W,
(r + 1) * G / W)`` of it. So the union over ranks of every step's batch is
the same for any world size that divides ``G`` and any number of workers,
and resuming at step ``s`` on another topology continues the same sequence.

NOTE [keyed bijection]: the sequence is never materialized. Position ``p``
maps to a sample through keyed permutations (a Feistel network over the
smallest square ``m x m`` covering the domain, with modular addition and
cycle walking back into ``[0, n)``, which costs a second pass for at most
``2 sqrt(n)`` values; 4 rounds of a mixing function, keys from
SeedSequence(seed, epoch, purpose)), evaluated with numpy for just the
positions asked for. A rank holds O(batch) memory where ``permutation(N)``
holds 8 bytes per sample (0.8 GB at N = 10^8). A domain of up to 2**32
values is mixed in 32-bit words (halves below 2**16), a larger one in
64-bit words: numpy multiplies uint32 arrays with SIMD and uint64 ones an
element at a time. The permutation of a batch's 256 positions (chunks of
16,384, a domain of 30,000, best of 5 x 300 calls) cost 3.5 against 11.7
us; the sampler, uniform, 10-12 against 19-21 us a batch of 256 over
30,000 samples and 7.6-7.8 against 12.2 over 10^7 (best of 15 epochs, in
turn with the 64-bit mix, 2 cores).

NOTE [block order]: ``shuffle="block"`` cuts the samples into blocks of
``block_size`` consecutive samples, permutes the blocks, groups the permuted
blocks into windows of ``window`` blocks, and permutes the samples inside
each window. A window's reads are whole blocks (large and sorted, one
hint to the kernel each), and a batch draws from ``window`` blocks spread
over the dataset, which keeps classes mixed. ``shuffle="uniform"`` is the
same with blocks of one sample in windows of one, ``shuffle="none"`` the
identity.

NOTE [remainder]: when ``G`` does not divide the epoch, ``remainder`` says
what the last global batch is: "drop" leaves it out; "pad" fills it up by
wrapping to the start of the epoch's sequence (as DistributedSampler
pads), so every rank reads full batches; "partial" keeps it short, shared
evenly by the ranks (refused where it cannot be: some rank would get fewer
samples, or none at all).
"""

import math

import numpy as np

from fastdata.errors import OptionError

SHUFFLES = ("none", "uniform", "block")
REMAINDERS = ("partial", "pad", "drop")
_ROUNDS = 4  # Feistel rounds (Luby-Rackoff: 4 make a strong pseudo-random permutation); see NOTE [keyed bijection]
_PURPOSE_BLOCKS, _PURPOSE_WINDOW = 0, 1  # mixed into the keys so the two permutations differ
# word dtype -> (multipliers of the mix, its two shifts): splitmix64's for 64 bits, murmur3's finalizer for 32
_WORDS = {np.uint32: (np.uint32(0x9E3779B9), np.uint32(0x85EBCA6B), np.uint32(16), np.uint32(13)),
          np.uint64: (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(32), np.uint64(29))}
_SMALL_DOMAIN = 1 << 32  # domains up to this size are mixed in 32-bit words: see NOTE [keyed bijection]


class KeyedPermutation:
    """A bijection of ``[0, size)`` chosen by ``key``, evaluated on arrays (see NOTE [keyed bijection]).

    Args:
        size: the domain's size (at least 1).
        key: a sequence of non-negative ints (e.g. ``(seed, epoch, purpose)``).
    """

    def __init__(self, size: int, key):
        self.size = int(size)
        self._word = np.uint32 if self.size <= _SMALL_DOMAIN else np.uint64
        self._golden, self._m1, self._high, self._low = _WORDS[self._word]
        self._side = self._word(max(2, math.isqrt(max(self.size - 1, 0)) + 1))  # side * side >= size
        self._keys = np.random.SeedSequence(list(key)).generate_state(_ROUNDS, self._word)

    def __call__(self, values: np.ndarray) -> np.ndarray:
        """Return the images of int ``values`` in ``[0, size)`` as int64."""
        return self._walk(values, self._forward)

    def inverse(self, values: np.ndarray) -> np.ndarray:
        """Return the values whose images are ``values``, as int64."""
        return self._walk(values, self._backward)

    def _walk(self, values, step):
        """Apply ``step`` until every value is back in ``[0, size)`` (cycle walking: rarely a second round)."""
        out = step(np.asarray(values).astype(self._word))
        outside = np.flatnonzero(out >= self.size)
        while len(outside):
            out[outside] = step(out[outside])
            outside = outside[out[outside] >= self.size]
        return out.astype(np.int64)

    def _forward(self, values):
        side = self._side
        left, right = np.divmod(values, side)
        for key in self._keys:
            right_next = self._mix(right, key)
            right_next += left
            left, right = right, _below(right_next, side)  # (left + mix) % side: both are below side
        left *= side
        left += right
        return left

    def _backward(self, values):
        side = self._side
        left, right = np.divmod(values, side)
        for key in self._keys[::-1]:
            left_before = right + side
            left_before -= self._mix(left, key)
            left, right = _below(left_before, side), left  # (right + side - mix) % side: in [1, 2 side)
        left *= side
        left += right
        return left

    def _mix(self, half, key):
        """A keyed mix of ``half`` in the domain's words (xor-multiply-xorshift), cut to ``[0, side)``.

        Cut by the high half of the word times ``side`` (a multiply and shifts, as
        Lemire's fastrange), not ``% side``: numpy's uint64 modulo costs about six
        multiplies. With the in-place steps and the conditional subtracts (_below),
        a uniform sampler over 10^8 samples took 13.4 against 18.7 us a batch of
        256 (medians of 11 interleaved rounds, 2 shared cores); loading a 64 px raw
        batch takes ~500 us.
        """
        h = half ^ key
        h *= self._golden  # arrays wrap around silently (numpy checks overflow of scalars only)
        h ^= h >> self._high
        h *= self._m1
        h ^= h >> self._low
        h >>= self._high
        h *= self._side  # side fits half a word (side * side covers at most the word): the product fits one
        h >>= self._high
        return h


def _below(values, side):
    """Return ``values % side`` in place for uint64 ``values`` below ``2 * side``: past side, values - side."""
    return np.minimum(values, values - side, out=values)  # below side, values - side wraps to a huge value


class EpochOrder:
    """Every epoch's sequence of samples and its global batches (see NOTE [global order]).

    Args:
        num_samples: samples in the dataset.
        global_batch: samples per step over all ranks.
        shuffle: "none", "uniform" or "block" (see NOTE [block order]).
        seed: base seed; each epoch mixes in its number.
        remainder: "partial", "pad" or "drop" (see NOTE [remainder]).
        block_size: consecutive samples per block ("block" only).
        window: blocks whose samples are shuffled together ("block" only).
    """

    def __init__(self, num_samples: int, global_batch: int, *, shuffle: str = "uniform", seed: int = 0,
                 remainder: str = "partial", block_size: int = 1, window: int = 1):
        for name, value in (("global_batch", global_batch), ("block_size", block_size), ("window", window)):
            check_positive(name, value)
        _check_choice("shuffle", shuffle, SHUFFLES)
        _check_choice("remainder", remainder, REMAINDERS)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise OptionError(f"seed should be a non-negative integer, got seed={seed!r}")
        self.num_samples, self.global_batch = int(num_samples), global_batch
        self.shuffle, self.seed, self.remainder = shuffle, seed, remainder
        if shuffle != "block":
            block_size = window = 1
        self.block_size, self.window = block_size, window
        self.num_blocks = -(-self.num_samples // block_size)
        self._short = self.num_blocks * block_size - self.num_samples  # the last block's missing samples
        self._epoch_blocks = None  # (epoch, its block permutation): one epoch's, made on first use

    # ------------------------------------------------------------ steps

    @property
    def num_steps(self) -> int:
        """Global steps per epoch (every rank yields this many batches)."""
        if self.remainder == "drop":
            return self.num_samples // self.global_batch
        return -(-self.num_samples // self.global_batch)

    @property
    def epoch_length(self) -> int:
        """Positions per epoch: the samples, less a dropped or plus a padded last batch."""
        if self.remainder == "partial":
            return self.num_samples
        return self.num_steps * self.global_batch

    def step_positions(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[int, int]:
        """Return the positions ``[start, stop)`` that ``rank`` of ``world_size`` reads at global ``step``."""
        if self.global_batch % world_size:
            raise OptionError(f"the global batch ({self.global_batch}) should be a multiple of the world size "
                              f"({world_size})")
        share = self.global_batch // world_size
        last = self.num_samples - step * self.global_batch
        if self.remainder == "partial" and 0 < last < self.global_batch:  # the short last batch, shared evenly
            if last % world_size:
                raise OptionError(f"remainder='partial' leaves a last batch of {last} samples that {world_size} "
                                  "ranks cannot share evenly; use remainder='pad' or 'drop'")
            share = last // world_size
        start = step * self.global_batch + rank * share
        return min(start, self.epoch_length), min(start + share, self.epoch_length)

    def steps_positions(self, steps: range, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """Return int64 ``[len(steps), 2]``: ``step_positions`` of each of ``steps`` (a range of this epoch's), as
        one array (the sampler's chunks: ~1.5 us a step in Python)."""
        if not len(steps):
            return np.zeros((0, 2), np.int64)
        first = self.step_positions(steps[0], rank, world_size)  # checks the world size
        starts = np.arange(len(steps), dtype=np.int64) * (steps.step * self.global_batch) + first[0]
        bounds = np.minimum(np.stack([starts, starts + (self.global_batch // world_size)], axis=1), self.epoch_length)
        bounds[0] = first
        if len(steps) > 1 and steps[-1] == self.num_steps - 1:  # the last step may be short or shared evenly
            bounds[-1] = self.step_positions(steps[-1], rank, world_size)
        return bounds

    def batch(self, epoch: int, step: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """Return the sorted int64 sample indices ``rank`` reads at global ``step`` of ``epoch``."""
        start, stop = self.step_positions(step, rank, world_size)
        return np.sort(self.samples(epoch, np.arange(start, stop, dtype=np.int64)))

    # ------------------------------------------------------------ positions -> samples

    def samples(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Return the int64 sample at each of ``positions`` (in ``[0, epoch_length)``) of ``epoch``'s sequence."""
        positions = np.asarray(positions, dtype=np.int64) % max(self.num_samples, 1)  # "pad" wraps to the start
        if self.shuffle == "none" or not len(positions):
            return positions
        blocks, short_slot = self._blocks(epoch)
        if self.window == 1 and self.block_size == 1:  # uniform: the block permutation is the order
            return blocks(positions)
        windows, offsets = self._window_of(positions, short_slot)
        out = np.empty_like(positions)
        for window in np.unique(windows).tolist():
            mine = windows == window
            out[mine] = self._window_samples(epoch, window, offsets[mine], blocks, short_slot)
        return out

    def window_of(self, epoch: int, position: int) -> int:
        """Return the window holding ``position`` of ``epoch``'s sequence (``_window_of`` of one, in Python ints)."""
        position = int(position) % max(self.num_samples, 1)
        span, short_window = self.window * self.block_size, self._blocks(epoch)[1] // self.window
        boundary = (short_window + 1) * span - self._short
        return position // span if position < boundary else (position + self._short) // span

    def window_stop(self, epoch: int, window: int) -> int:
        """Return the first position of ``epoch``'s sequence past ``window`` (windows hold contiguous positions;
        those after the short block's window start ``_short`` earlier, as in ``_window_of``)."""
        short_window = self._blocks(epoch)[1] // self.window
        stop = (window + 1) * self.window * self.block_size - (self._short if window >= short_window else 0)
        return min(stop, self.num_samples)

    def window_after(self, epoch: int, window: int) -> tuple[int, int]:
        """Return ``(epoch, window)`` read after ``window`` of ``epoch``: the next, or the next epoch's first."""
        last = (window + 1) * self.window >= self.num_blocks
        return epoch + last, 0 if last else window + 1

    def block_ranges(self, epoch: int) -> np.ndarray:
        """Return int64 ``[num_blocks, 2]``: the samples ``[start, stop)`` of the block in each slot of ``epoch``.

        Window ``w`` holds slots ``[w * window, (w + 1) * window)``; ``window_ranges`` gives one window's, sorted.
        """
        blocks, _ = self._blocks(epoch)
        starts = blocks(np.arange(self.num_blocks, dtype=np.int64)) * self.block_size
        return np.stack([starts, np.minimum(starts + self.block_size, self.num_samples)], axis=1)

    def window_ranges(self, epoch: int, window: int) -> np.ndarray:
        """Return int64 ``[K, 2]`` sorted sample ranges ``[start, stop)``: the blocks of ``window`` of ``epoch``."""
        blocks, _ = self._blocks(epoch)
        slots = np.arange(window * self.window, min((window + 1) * self.window, self.num_blocks), dtype=np.int64)
        starts = np.sort(blocks(slots)) * self.block_size
        return np.stack([starts, np.minimum(starts + self.block_size, self.num_samples)], axis=1)

    def _blocks(self, epoch):
        """Return ``(epoch's permutation of the blocks, the slot where the short last block went)``."""
        if self._epoch_blocks is None or self._epoch_blocks[0] != epoch:
            blocks = KeyedPermutation(self.num_blocks, (self.seed, epoch, _PURPOSE_BLOCKS))
            self._epoch_blocks = (epoch, blocks, int(blocks.inverse(np.array([self.num_blocks - 1]))[0]))
        return self._epoch_blocks[1:]

    def _window_of(self, positions, short_slot):
        """Return ``(window, offset in it)`` of each position; windows after the short block's start earlier."""
        span = self.window * self.block_size
        short_window = short_slot // self.window
        boundary = (short_window + 1) * span - self._short  # the first position after the short block's window
        windows = np.where(positions < boundary, positions // span, (positions + self._short) // span)
        starts = windows * span - np.where(windows > short_window, self._short, 0)
        return windows, positions - starts

    def _window_samples(self, epoch, window, offsets, blocks, short_slot):
        """Return the samples at ``offsets`` of ``window``'s shuffled sequence."""
        first = window * self.window
        slots = min(self.window, self.num_blocks - first)
        short_slot -= first
        size = slots * self.block_size - (self._short if 0 <= short_slot < slots else 0)
        inner = KeyedPermutation(size, (self.seed, epoch, _PURPOSE_WINDOW, window))(offsets)
        # Blocks in the window are full except the short one; offsets past it start _short earlier.
        if 0 <= short_slot < slots:
            past = inner >= (short_slot + 1) * self.block_size - self._short
            slot = np.where(past, (inner + self._short) // self.block_size, inner // self.block_size)
            within = inner - slot * self.block_size + np.where(past, self._short, 0)
        else:
            slot, within = inner // self.block_size, inner % self.block_size
        return blocks(first + slot) * self.block_size + within

    def describe(self) -> dict:
        """Return the settings that decide the order, JSON-able (they go into a loader's state)."""
        return {"num_samples": self.num_samples, "global_batch": self.global_batch, "shuffle": self.shuffle,
                "seed": self.seed, "remainder": self.remainder, "block_size": self.block_size,
                "window": self.window}


def check_positive(name, value):
    """Raise OptionError unless ``value`` is a positive int (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OptionError(f"{name} should be a positive integer, got {name}={value!r}")


def _check_choice(name, value, choices):
    if value not in choices:
        raise OptionError(f"{name} should be one of {', '.join(map(repr, choices))}; got {name}={value!r}")
