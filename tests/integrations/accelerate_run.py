"""One accelerate run of test_trainers.py: ``accelerate launch --multi_gpu --num_processes 2 accelerate_run.py SPEC``.

On CPU with gloo (see trainer_record.py). ``Accelerator().prepare`` gets the
loader with the model and optimizer; the loader is registered for
checkpointing, so ``save_state`` after global step ``checkpoint_step`` holds
its state and ``load_state`` (with ``resume``) continues there.
"""

import os

import torch
from accelerate import Accelerator
from trainer_record import Samples, loader_of, read_spec

spec = read_spec()
early = loader_of(spec) if spec["made"] == "early" else None  # before the process group exists
accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(3, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, loader = accelerator.prepare(model, optimizer, early or loader_of(spec))
accelerator.register_for_checkpointing(loader)
samples = Samples(spec["path"])
samples.length = len(loader)
step = 0  # global steps done
if spec["resume"]:
    accelerator.load_state(spec["resume"])
    resumed = loader.state_dict()
    step = resumed["epoch"] * len(loader) + resumed["samples_consumed"] // loader.sampler.global_batch
for epoch in range(step // len(loader), spec["epochs"]):
    loader.sampler.set_epoch(epoch)  # as with a DistributedSampler: a resumed epoch keeps its step
    for images, labels in loader:
        samples.record(epoch, step, images)
        loss = torch.nn.functional.cross_entropy(model(images.float().mean((2, 3)) / 255), labels % 8)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == spec["checkpoint_step"]:
            accelerator.save_state(os.path.join(spec["out"], "checkpoint"))
samples.write(spec, accelerator.process_index)
accelerator.wait_for_everyone()  # no rank closes the group while another's last collective is in flight
accelerator.end_training()
