# expect: stale-install-pin@18 stale-install-pin@19 launch-nprocs@21 removed-api@35 deprecated-api@39 launch-nprocs@40
# Written here, not copied: the TPU-Node era of Colab. COLAB_TPU_ADDR required and XRT_TPU_CONFIG
# set (notes: torch_xla 2.8/2.9 read neither), 1.x wheels from the tpu-pytorch bucket through
# $NAME variables (each line), transformers' xla_spawn.py --num_cores 8, a loss
# read every log_steps (a note), nprocs from a dict of flags (8). Models pytorch/xla
# contrib/colab/mnist-training.ipynb @f2f8f445e5f1cc5550db7d95003a743e3cfae9c1 (cells 1, 4, 6, 7),
# contrib/colab/resnet18-training-xrt-1-15.ipynb @bec9c0e3d70eb6d03211f9a4a57cf1b4a7dafa2e (the
# gsutil/pip cells, the XRT server call) and huggingface/blog notebooks/13_pytorch_xla.ipynb (copy
# in charlesxu90/Huggingface_demo @dc07f9c55996a10d04e5f587a57b40b4acffe444, cells 2 and 5), their
# ! lines as nbconvert writes them.
# ruff: noqa
import os

assert os.environ["COLAB_TPU_ADDR"], "Make sure to select TPU from Edit > Notebook settings"
os.environ["XRT_TPU_CONFIG"] = "localservice;0;localhost:51011"
DIST_BUCKET = "gs://tpu-pytorch/wheels"
TORCH_XLA_WHEEL = "torch_xla-1.15-cp36-cp36m-linux_x86_64.whl"
get_ipython().system('gsutil cp "$DIST_BUCKET/$TORCH_XLA_WHEEL" .')
get_ipython().system('pip install "$TORCH_XLA_WHEEL"')
get_ipython().system('nvidia-smi')
get_ipython().system('python transformers/examples/xla_spawn.py --num_cores 8 run_mlm.py --do_train')
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_multiprocessing as xmp

FLAGS = {"num_cores": 8, "log_steps": 20}


def train_loop_fn(loader, model, optimizer, loss_fn):
    for x, (data, target) in enumerate(loader):
        loss = loss_fn(model(data), target)
        loss.backward()
        xm.optimizer_step(optimizer)
        if x % FLAGS["log_steps"] == 0:
            print(f"[xla:{xm.get_ordinal()}]({x}) Loss={loss.item():.5f}")


def _mp_fn(rank, flags):
    train_loop_fn(pl.MpDeviceLoader(train_loader, xm.xla_device()), model, optimizer, loss_fn)
xmp.spawn(_mp_fn, args=(FLAGS,), nprocs=FLAGS["num_cores"], start_method="fork")
