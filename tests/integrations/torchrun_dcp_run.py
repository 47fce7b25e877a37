"""One plain torchrun run of test_trainers.py: ``torchrun --nproc-per-node 2 torchrun_dcp_run.py SPEC``.

On CPU with gloo (see trainer_record.py), checkpointed as torchtitan and
torchdata's StatefulDataLoader users do: the loader goes into
``torch.distributed.checkpoint`` as a ``Stateful`` beside the model, saved
collectively after global step ``checkpoint_step`` and loaded (with
``resume``) into a fresh loader before it is iterated.
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful
from trainer_record import Samples, loader_of, read_spec

spec = read_spec()
early = loader_of(spec) if spec["made"] == "early" else None  # before the process group exists
dist.init_process_group("gloo")
loader = early or loader_of(spec)
assert isinstance(loader, Stateful), "torch.distributed.checkpoint would pickle the loader, not ask for its state"
model = torch.nn.Linear(3, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
samples = Samples(spec["path"])
samples.length = len(loader)
step = 0  # global steps done
if spec["resume"]:
    dcp.load({"model": model, "loader": loader}, checkpoint_id=spec["resume"])
    resumed = loader.state_dict()
    step = resumed["epoch"] * len(loader) + resumed["samples_consumed"] // loader.sampler.global_batch
for epoch in range(step // len(loader), spec["epochs"]):
    for images, labels in loader:  # each iter() starts the loader's next epoch, or the resumed one's rest
        samples.record(epoch, step, images)
        loss = torch.nn.functional.cross_entropy(model(images.float().mean((2, 3)) / 255), labels % 8)
        loss.backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == spec["checkpoint_step"]:
            dcp.save({"model": model, "loader": loader}, checkpoint_id=os.path.join(spec["out"], "checkpoint"))
samples.write(spec, dist.get_rank())
dist.destroy_process_group()
