"""Train a small classifier with accelerate from a fastdata file, resuming mid-epoch from its last checkpoint.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_ddp.py   # 2 CPU processes (gloo)
    python examples/accelerate_ddp.py --data train.h5 --workers 2

``Accelerator().prepare`` hands the loader back as it is, and
``register_for_checkpointing`` puts its position into ``save_state``
(README, "Lightning and accelerate"). Run it twice with ``--stop-after``
on the first run: the second one continues at the step the first stopped.
"""

import argparse
import os

import torch
from accelerate import Accelerator

from fastdata import convert_imagefolder, make_loader, open_dataset
from fastdata.measure.synthetic import make_imagefolder


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a packed file or shard folder (default: synthetic photos in --workdir)")
    parser.add_argument("--workdir", default="accelerate-example", help="where synthetic data and checkpoints go")
    parser.add_argument("--epochs", type=int, default=2, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per batch of each process")
    parser.add_argument("--workers", type=int, default=0, help="make_loader's num_workers")
    parser.add_argument("--stop-after", type=int, help="save the state and stop after this many steps")
    return parser.parse_args()


def data_path(args, accelerator):
    """Return ``--data``, or a file of 128 synthetic photos converted once into ``--workdir``."""
    if args.data:
        return args.data
    path = os.path.join(args.workdir, "photos-32px-raw.h5")
    with accelerator.main_process_first():  # one process converts, the others wait for its file
        if not os.path.exists(path):
            src = make_imagefolder(os.path.join(args.workdir, "photos"), num_classes=4, per_class=32,
                                   size=(64, 48), vary=True)
            convert_imagefolder(src, path, size=32, progress=False)
    return path


def main():
    args = parse_args()
    accelerator = Accelerator(cpu=True)
    dataset = open_dataset(data_path(args, accelerator))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(16, int(dataset.labels.max()) + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = make_loader(dataset, args.batch_size, shuffle=True, num_workers=args.workers)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(loader)
    train(args, accelerator, model, optimizer, loader)
    accelerator.wait_for_everyone()  # no rank closes the group while another's last collective is still in flight
    accelerator.end_training()


def train(args, accelerator, model, optimizer, loader):
    """Train from the saved state if there is one; stop after ``--stop-after`` steps with the state saved."""
    checkpoint = os.path.join(args.workdir, "checkpoint")
    step = 0
    if os.path.exists(checkpoint):
        accelerator.load_state(checkpoint)
        state = loader.state_dict()
        step = state["epoch"] * len(loader) + state["samples_consumed"] // loader.sampler.global_batch
        accelerator.print(f"resumed at step {step}")
    for epoch in range(step // len(loader), args.epochs):
        loader.sampler.set_epoch(epoch)  # as with a DistributedSampler; a resumed epoch keeps its step
        for images, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(images.float() / 255), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.stop_after:
                accelerator.save_state(checkpoint)
                accelerator.print(f"saved the state after step {step}")
                return
        accelerator.print(f"epoch {epoch}: loss {loss.item():.3f}")
    accelerator.print(f"trained {step} steps: {len(loader)} batches of {args.batch_size} per process per epoch")


if __name__ == "__main__":
    main()
