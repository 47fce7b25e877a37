"""Image section of run.py: images.py at each output size, sharing one photo folder."""

import os

import images

SLOW_KINDS = ("folder",)  # rows of a few hundred samples/s: one process is enough (and costs 10-20 s)


def run(config, fresh):
    """Run images.py's conversions and rows at every size of ``config["sizes"]``; return ``{size: results}``."""

    def runner(fn, *args):  # see NOTE [process to process] in _fresh.py
        if fn is not images.measure_row or args[0][3] in SLOW_KINDS:
            return fresh.run(fn, *args)  # slow rows, and interleaved measurements: one process
        return fresh.run_median(config["process_repeats"], fn, *args)

    results = {}
    for size in config["sizes"]:
        argv = ["--num-images", str(config["num_images"]), "--size", str(size),
                "--batch-size", str(config["batch_size"]), "--repeats", str(config["repeats"]),
                "--workers", str(config["workers"]), "--min-pass-seconds", str(config["min_seconds"]),
                "--seed", str(config["seed"]), "--workdir", os.path.join(config["workdir"], "images")]
        argv += ["--paired-rounds", "2"] if config["quick"] else []
        print(f"-- images at {size}x{size}", flush=True)
        results[str(size)] = images.run(images.parse_args(argv), runner=runner)
        results[str(size)]["config"].pop("out", None)  # run.py writes the results
    return {"sizes": results, "process_repeats": config["process_repeats"]}
