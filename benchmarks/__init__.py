"""The benchmark suite: thin sections over fastdata.measure; ``python benchmarks/run.py`` is the one entry.

run.py (command line, the run) -> sections/ (one module per section: images,
gpustep, text, peers, sweeps, memory, coldcache) -> rows (one row measured
in a fresh process), inputs (synthetic data made once and cached), fresh
(the fresh measuring processes), samplers, machine (CPU use, CUDA, page
cache) -> fastdata.measure (timed epochs, memory, limits, baselines). report
and plots turn the results into Markdown, targets and PNGs.

A new section is a module in sections/ with ``run(config, fresh)``, listed
in run.py's SECTIONS and report.py's renderers.
"""
