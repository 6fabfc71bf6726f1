# expect: ragged-batches@29
# Defaults read before judging (written here, not copied): FLAGS from pytorch/xla's
# test/args_parse.py parse_common_options (--drop_last is store_true, --num_cores defaults to None),
# the training loader's drop_last=flags.drop_last is False unless set (found); the test loader
# without a sampler or drop_last is evaluation (clean); xmp.spawn(nprocs=FLAGS.num_cores) is None
# by default (a note, not an alarm). Models pytorch/xla test/test_train_mp_mnist.py @c4f507c112965
# 773da4289addc53e31574fda2f2 (l.93, 179) and @5fab7053df86c8d503b98d9e7202ca8b8d4978c7 (v2.9.0,
# l.116, 123), test/test_train_mp_imagenet.py @f2f8f445e5f1cc5550db7d95003a743e3cfae9c1
# (l.165, 272), test/test_train_mp_mnist_fsdp_with_ckpt.py @c62c5a5aad1394c9a4fa5863146bbb8ceb3e2bc6
# (l.137, 282) and test/test_train_mp_imagenet_amp.py @500e1c27530a21408fbd181a7296eda9cdcbe834.
# ruff: noqa
import args_parse

FLAGS = args_parse.parse_common_options(datadir="/tmp/mnist-data", batch_size=128, lr=0.01)

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr


def train_mnist(flags, train_dataset, test_dataset):
    train_sampler = None
    if xr.world_size() > 1:
        train_sampler = torch.utils.data.distributed.DistributedSampler(
            train_dataset, num_replicas=xr.world_size(), rank=xr.global_ordinal(), shuffle=True)
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=flags.batch_size, sampler=train_sampler,
        drop_last=flags.drop_last, shuffle=False if train_sampler else True)
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=flags.batch_size, drop_last=flags.drop_last, shuffle=False)
    device = torch_xla.device()
    model = MNIST().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=flags.lr, momentum=flags.momentum)
    loss_fn = torch.nn.NLLLoss()

    def train_loop_fn(loader):
        for step, (data, target) in enumerate(loader):
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            xm.optimizer_step(optimizer)
            if step % flags.log_steps == 0:
                xm.add_step_closure(print, args=(step, loss))

    def test_loop_fn(loader):
        correct = 0
        for data, target in loader:
            output = model(data)
            correct += output.max(1, keepdim=True)[1].eq(target.view_as(output)).sum()
        return xm.mesh_reduce("test_accuracy", correct.item(), sum)

    train_device_loader = pl.MpDeviceLoader(train_loader, device)
    test_device_loader = pl.MpDeviceLoader(test_loader, device)
    for epoch in range(1, flags.num_epochs + 1):
        train_loop_fn(train_device_loader)
        print(f"epoch {epoch}: accuracy {test_loop_fn(test_device_loader)}")


def _mp_fn(index, flags):
    torch.set_default_dtype(torch.float32)
    train_mnist(flags, *datasets(flags))


if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=(FLAGS,), nprocs=FLAGS.num_cores)
