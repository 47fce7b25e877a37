"""Packed files -> torch batches: datasets, decoders, samplers, the loader, its read-ahead and worker transport."""
