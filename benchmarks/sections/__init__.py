"""One module per section of benchmarks/run.py; each has ``run(config, fresh) -> results``."""
