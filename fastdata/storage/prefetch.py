"""Background threads that fetch the shards a reader wants next into its ShardCache."""

import threading
import weakref


class _Schedule:
    """What the fetching threads share: the wanted sequence, the consumer's place in it, what is done.

    Holds no reference to the Prefetcher, so that the Prefetcher can be collected (and its finalizer
    stop the threads) while they run.
    """

    def __init__(self, cache, ahead):
        self.cache, self.ahead = cache, ahead
        self.cond = threading.Condition()
        self.sequence, self.position = [], 0
        self.started, self.done = set(), set()
        self.stopped = False

    def want(self, shards, keep):
        with self.cond:
            self.sequence = list(dict.fromkeys(int(shard) for shard in shards))
            self.position = 0
            kept = set(self.sequence) if keep else set()
            self.started &= kept
            self.done &= kept
            self._wake()

    def advance(self, position):
        """Move the reader to ``position``; wake only as many threads as shards became due (NOTE [quiet advance])."""
        with self.cond:
            position = max(0, int(position))
            if position != self.position:
                self.position = position
                self._wake()

    def _wake(self):
        """Wake a thread for each due shard not in the cache; mark the present ones done here (the lock held)."""
        due = [shard for shard in self.sequence[self.position : self.position + self.ahead]
               if shard not in self.started]
        missing = [shard for shard in due if not self.cache.is_present(shard)]
        present = set(due) - set(missing)
        self.started |= present
        self.done |= present
        if missing:
            self.cond.notify(len(missing))

    def next_shard(self):
        """Return the next shard to fetch (waiting for one), or None once stopped."""
        with self.cond:
            while not self.stopped:
                window = self.sequence[self.position : self.position + self.ahead]
                for shard in window:
                    if shard not in self.started:
                        self.started.add(shard)
                        return shard
                self.cond.wait()
            return None

    def finished(self, shard, error):
        with self.cond:  # no thread waits for a fetch to finish: nobody to wake
            self.done.add(shard)
        if error is not None:
            self.cache.defer_error(shard, error)

    def stop(self):
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


# NOTE [quiet advance]: the reader advances every step, and waking every
# fetching thread each time cost the reader their GIL hand-offs: a cached
# 64 px raw folder read through a file:// URL (10,000 samples, 33 shards,
# batches of 256) ran at 0.55-0.70 of the same folder read locally. A step
# that makes no shard due wakes nobody, and a due shard already in the
# cache (one stat, in the reader) wakes nobody either: with every shard
# cached, a thread that only found it present cost the reader its GIL
# hand-offs again (the prefetch bookkeeping took 150-230 us a step of a
# ~500 us copy, 64 shards of 6,000 64 px images). A prefetch never waits for room in
# the cache (fetch(wait=False)): it would hold the shard's download lock
# while the reader, who may be the one to free room, waits for that lock.


def _fetch_wanted(schedule):
    """A fetching thread: fetch the shards the schedule hands out until it stops."""
    while (shard := schedule.next_shard()) is not None:
        try:
            schedule.cache.fetch(shard, wait=False)  # no room: the reader fetches it when it gets there
        except Exception as exc:  # kept for the reader: see Prefetcher
            schedule.finished(shard, exc)
        else:
            schedule.finished(shard, None)


def _stop(schedule, threads):
    schedule.stop()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()


class Prefetcher:
    """Keep the next ``ahead`` shards of a reader's sequence fetched into ``cache``, with ``threads`` threads.

    The reader says which shards it will read, in order (``want``), and where
    it is in that sequence (``advance``); the threads fetch the shards at
    positions ``position`` to ``position + ahead - 1``, never further. An error
    fetching a shard is not swallowed: the reader's next ``cache.fetch`` of that
    shard in this process raises it. ``close`` (or collecting the Prefetcher)
    stops the threads after their current fetch.

    Args:
        cache: the ShardCache to fill.
        ahead: how many shards of the sequence, from the reader's position on, to keep fetched.
        threads: parallel fetches.
    """

    def __init__(self, cache, ahead, threads=4):
        if ahead < 0 or threads < 1:
            raise ValueError(f"ahead should be >= 0 and threads >= 1, got ahead={ahead}, threads={threads}")
        self.cache, self.ahead = cache, int(ahead)
        self._schedule = _Schedule(cache, self.ahead)
        self._threads = [threading.Thread(target=_fetch_wanted, args=(self._schedule,), daemon=True,
                                          name=f"fastdata-prefetch-{n}") for n in range(threads)]
        for thread in self._threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._schedule, self._threads)

    def want(self, shards, keep=False):
        """Set the shards the reader reads next, in order (repeats after the first are dropped); position 0.

        ``keep``: the sequence goes on the last one (the same pass over the data), so its shards fetched
        or being fetched are not fetched again; otherwise (a new epoch) each is checked anew.
        """
        self._schedule.want(shards, keep)

    def advance(self, position):
        """Say that the reader is at ``position`` in the sequence (the shard it reads now)."""
        self._schedule.advance(position)

    def fetched(self):
        """Return the set of shards of the current sequence fetched (or failed) so far."""
        with self._schedule.cond:
            return set(self._schedule.done)

    def close(self):
        """Stop the threads (after their current fetch) and wait for them."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        schedule = self._schedule
        return (f"<Prefetcher ahead={self.ahead} threads={len(self._threads)}: position {schedule.position} of "
                f"{len(schedule.sequence)} shards{', closed' if schedule.stopped else ''}>")
