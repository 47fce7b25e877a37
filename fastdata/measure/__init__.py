"""Measuring, built on fastdata.loading and fastdata.converters and never imported by them.

engine (timed epochs), memory (what workers cost), machine (what it ran on),
tables (rows, Markdown, JSON), limits (copy and decode bounds), baselines
(what a user would write without fastdata), bench (`fastdata bench`), tune
(`fastdata tune`), profiler (`fastdata.profile`), synthetic (test data),
pagecache (a memory cgroup bounding the page cache, disk read counters).
"""
