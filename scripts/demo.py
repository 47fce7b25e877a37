"""End-to-end demo: sample photos -> packed .h5 / .arrow -> make_loader -> raw vs packed samples/s.

Run by scripts/demo.sh after set-up; everything lands in demo-data/ (git-ignored).
"""

import os
import subprocess
import sys

import numpy as np
from torch.utils.data import DataLoader

from fastdata import make_loader, open_dataset
from fastdata.converters import find_images
from fastdata.measure.baselines import RawFolderDataset
from fastdata.measure.engine import measure_rate
from fastdata.measure.synthetic import make_imagefolder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DATA = os.path.join(REPO, "demo-data")
SIZE, BATCH = 64, 256


def fastdata_cli(*args):
    """Run the `fastdata` command as a user would, echoing it."""
    print("$ fastdata", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "fastdata", *args], check=True)


def count_samples(loader):
    return sum(len(batch[-1]) for batch in loader)


def main():
    photos = os.path.join(DATA, "photos")
    if not os.path.isdir(photos):
        print("making 480 photo-like 500x375 JPEGs in", photos, flush=True)
        make_imagefolder(photos, num_classes=8, per_class=60, seed=0)
    packed = {
        "HDF5 raw": os.path.join(DATA, "photos.h5"),
        "Arrow raw": os.path.join(DATA, "photos.arrow"),
        "Arrow jpeg": os.path.join(DATA, "photos-jpeg.arrow"),
    }
    for name, path in packed.items():
        storage = name.split()[1]
        fastdata_cli("convert", "imagefolder", photos, path, "--size", str(SIZE), "--storage", storage, "--overwrite")
    fastdata_cli("info", packed["HDF5 raw"])

    images, labels = next(iter(make_loader(open_dataset(packed["HDF5 raw"]), BATCH, shuffle=True)))
    print(f"\nfirst batch: images {tuple(images.shape)} {images.dtype}, labels {tuple(labels.shape)} {labels.dtype}")

    classes, paths, folder_labels = find_images(photos)
    folder = RawFolderDataset(np.array([os.path.join(photos, p) for p in paths]), folder_labels, SIZE)
    rates = {"raw folder (Pillow per sample, DataLoader)": measure_rate(
        lambda: count_samples(DataLoader(folder, batch_size=BATCH)), repeats=1).samples_per_s}
    for name, path in packed.items():
        loader = make_loader(open_dataset(path), BATCH, shuffle=True)
        rate = measure_rate(lambda loader=loader: count_samples(loader), repeats=3)
        rates[f"{name} (make_loader defaults)"] = rate.samples_per_s
    baseline = next(iter(rates.values()))
    print(f"\n| {'method':<45} | {'samples/s':>10} | vs raw folder |")
    print(f"| {'-' * 45} | {'-' * 10} | ------------- |")
    for name, rate in rates.items():
        print(f"| {name:<45} | {rate:>10,.0f} | {rate / baseline:>12,.0f}x |")
    print("\nFull benchmark (30-45 minutes on 2 cores): .venv/bin/python benchmarks/run.py")


if __name__ == "__main__":
    main()
