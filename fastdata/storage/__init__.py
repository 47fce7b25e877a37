"""Shard folders at a URL (s3://, gs://, https://...): the index read remotely, shards cached locally.

Sits beside ``formats/``: it imports formats and errors, and fsspec (the ``s3``
extra) only inside the functions that reach a URL, so importing it is cheap.
"""

from fastdata.storage.cache import ShardCache, cache_root
from fastdata.storage.prefetch import Prefetcher
from fastdata.storage.retry import RETRY_ATTEMPTS, RetryPolicy, is_transient, retried, retry_policy
from fastdata.storage.urls import filesystem, is_url, join, read_remote_index

__all__ = ["RETRY_ATTEMPTS", "Prefetcher", "RetryPolicy", "ShardCache", "cache_root", "filesystem", "is_transient",
           "is_url", "join", "read_remote_index", "retried", "retry_policy"]
