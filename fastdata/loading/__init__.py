"""Numpy rows -> torch batches: datasets, decoders, samplers, the loader, its workers and device feeding."""
