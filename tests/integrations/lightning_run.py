"""One Lightning run of test_trainers.py: ``python lightning_run.py SPEC`` (see trainer_record.py).

``Trainer(accelerator="cpu", devices=2, strategy="ddp")``, defaults otherwise
(``use_distributed_sampler`` left on): Lightning's launcher starts rank 1 by
running this script again. A ModelCheckpoint saves after global step
``checkpoint_step``; with ``resume`` the run continues from that checkpoint.
Validation runs 2 of its batches at the end of each epoch.
"""

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from trainer_record import Samples, loader_of, read_spec

from fastdata import make_loader, open_dataset

spec = read_spec()


class Model(L.LightningModule):
    def __init__(self, early_loader):
        super().__init__()
        self.layer = torch.nn.Linear(3, 8)
        self.early_loader = early_loader
        self.samples = Samples(spec["path"])

    def train_dataloader(self):
        self.loader = self.early_loader or loader_of(spec)
        return self.loader

    def training_step(self, batch, batch_idx):
        images, labels = batch
        self.samples.length = len(self.loader)
        self.samples.record(self.current_epoch, self.global_step, images)
        logits = self.layer(images.float().mean((2, 3)) / 255)
        return torch.nn.functional.cross_entropy(logits, labels % 8)

    def val_dataloader(self):  # cut short by limit_val_batches: an iteration left early every epoch
        return make_loader(open_dataset(spec["path"]), spec["batch_size"], num_workers=spec["num_workers"])

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.samples.validated += 1
        self.log("val_loss", torch.nn.functional.cross_entropy(self.layer(images.float().mean((2, 3)) / 255),
                                                               labels % 8), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


model = Model(loader_of(spec) if spec["made"] == "early" else None)  # early: before the process group exists
checkpoint = ModelCheckpoint(dirpath=spec["out"], filename="{step}", every_n_train_steps=spec["checkpoint_step"],
                             save_top_k=-1)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=spec["epochs"], callbacks=[checkpoint],
                    logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    limit_val_batches=2, default_root_dir=spec["out"])
trainer.fit(model, ckpt_path=spec["resume"])
model.samples.write(spec, trainer.global_rank)
if torch.distributed.is_initialized():  # Lightning leaves the group up: end it on both ranks together, as
    torch.distributed.barrier()  # torch asks (a rank exiting with gloo's threads alive aborted once in CI)
    torch.distributed.destroy_process_group()
