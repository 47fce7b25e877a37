"""Packed files -> numpy rows, no torch: the shard store, read-ahead, row copies and the epoch order."""
