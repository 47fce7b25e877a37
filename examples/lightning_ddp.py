"""Train a small classifier with Lightning DDP from a fastdata file: 2 processes on the CPU (gloo).

    python examples/lightning_ddp.py                        # synthetic photos, converted into --workdir
    python examples/lightning_ddp.py --data train.h5 --workers 2 --epochs 3

The loader goes to the Trainer as it is, made before the process group
exists: it takes its rank from the group when Lightning first asks for its
length (README, "Lightning and accelerate"). Lightning's launcher starts
the second process by running this script again.
"""

import argparse
import os

import lightning as L
import torch

from fastdata import convert_imagefolder, make_loader, open_dataset
from fastdata.measure.synthetic import make_imagefolder


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a packed file or shard folder (default: synthetic photos in --workdir)")
    parser.add_argument("--workdir", default="lightning-example", help="where synthetic data and checkpoints go")
    parser.add_argument("--epochs", type=int, default=2, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per batch of each process")
    parser.add_argument("--workers", type=int, default=0, help="make_loader's num_workers")
    return parser.parse_args()


def data_path(args):
    """Return ``--data``, or a file of 128 synthetic photos converted once into ``--workdir``."""
    if args.data:
        return args.data
    path = os.path.join(args.workdir, "photos-32px-raw.h5")
    if not os.path.exists(path):  # the first process converts before the second one starts
        src = make_imagefolder(os.path.join(args.workdir, "photos"), num_classes=4, per_class=32, size=(64, 48),
                               vary=True)
        convert_imagefolder(src, path, size=32, progress=False)
    return path


class Classifier(L.LightningModule):
    def __init__(self, num_classes):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                       torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                       torch.nn.Linear(16, num_classes))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(images.float() / 255), labels)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main():
    args = parse_args()
    dataset = open_dataset(data_path(args))
    loader = make_loader(dataset, args.batch_size, shuffle=True, num_workers=args.workers)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs, logger=False,
                        default_root_dir=args.workdir, enable_progress_bar=False)
    trainer.fit(Classifier(int(dataset.labels.max()) + 1), train_dataloaders=loader)
    if trainer.is_global_zero:
        print(f"trained {trainer.global_step} steps: {len(loader)} batches of {args.batch_size} per process "
              f"per epoch, {len(dataset)} samples")
    if torch.distributed.is_initialized():  # Lightning leaves the process group up: end it on every rank together
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
