# expect:
# Precision traps that must stay clean (written here, not copied): an SPMD trainer (one process
# per host) whose gloo process group only coordinates hosts, an evaluation loader without a
# sampler (sampler=None, drop_last=True), a step compiled with torch_xla.compile called as
# self.train_step(batch), the loss read in a step closure every logging_steps, an `if` on the
# training mode (a Python string). Models weirayao/torchprime torchprime/torch_xla_models/train.py
# @f1b2653d3ce23fbd559f08105409740bbb0fed62 (l.78, 225, 441-470, 554).
# ruff: noqa
import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
from torch.utils.data import DataLoader, DistributedSampler

xr.use_spmd()
dist.init_process_group(backend="gloo", init_method="xla://")


class Trainer:
    def _get_train_dataloader(self):
        sampler = DistributedSampler(self.train_dataset, num_replicas=self.num_hosts,
                                     rank=self.host_index, shuffle=True, drop_last=True)
        loader = DataLoader(self.train_dataset, batch_size=self.batch_size, sampler=sampler,
                            drop_last=True)
        return pl.MpDeviceLoader(loader, torch_xla.device(), input_sharding=self.sharding)

    def _get_eval_dataloader(self):
        loader = DataLoader(self.eval_dataset, batch_size=self.batch_size, sampler=None,
                            drop_last=True)
        return pl.MpDeviceLoader(loader, torch_xla.device(), input_sharding=self.sharding)

    @torch_xla.compile(full_graph=True)
    def train_step(self, batch):
        loss = self.model(**batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def train_loop(self):
        train_iterator = iter(self._get_train_dataloader())
        for step in range(self.max_steps):
            batch = next(train_iterator)
            if self.config.training_mode == "sft":
                self.validate(batch)
            loss = self.train_step(batch)
            if step % self.config.logging_steps == 0:
                xm.add_step_closure(lambda loss: print(f"step {step}: {loss.item():.4f}"),
                                    args=(loss,))
