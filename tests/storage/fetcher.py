"""A process using a pickled ShardCache, for the tests of sharing one cache: ``python fetcher.py CACHE MODE SHARDS``.

MODE "fetch" fetches SHARDS in turn and prints each path; "hold" holds SHARDS,
prints "held" and waits for its stdin to close, then releases them.
"""

import pickle
import sys
import warnings


def main(cache_file, mode, shards):
    warnings.simplefilter("ignore")  # a cache over its limit warns; the parent checks what matters
    with open(cache_file, "rb") as f:
        cache = pickle.load(f)
    shards = [int(shard) for shard in shards.split(",")]
    if mode == "fetch":
        for shard in shards:
            print(cache.fetch(shard), flush=True)
    else:
        for shard in shards:
            cache.hold(shard)
        print("held", flush=True)
        sys.stdin.read()
        for shard in shards:
            cache.release(shard)


if __name__ == "__main__":
    main(*sys.argv[1:])
