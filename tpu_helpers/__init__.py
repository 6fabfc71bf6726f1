"""tpu_helpers: the small, tested toolbox the tpu-notebooks course teaches.

Copy the package into your project. Importing it (or any module in it) never touches the
XLA device, so it is safe before ``torch_xla.launch``. Modules, lowest layer first
(imports point down only):

- ``env``: runtime detection (Colab/Kaggle/TPU VM/local), local XLA:CPU emulation,
  version checks, the notebooks' setup function (notebook 00)
- ``metrics``: compile/execute/transfer/fallback counts, limits and causes (00, 05)
- ``host_memory``: per-process RSS/USS/PSS of forked workers (01)
- ``data``: checked datasets, fixed-shape train/eval loaders with index + mask (01, 02)
- ``device_loader``: MpDeviceLoader that surfaces loader errors; feed measurements (02)
- ``spmd``: meshes, shard placements and bytes per device, sharded checkpoints (03, 07)
- ``models``: ``DigitsCNN``, the model the notebooks and benchmarks train (03)
- ``checkpoint``: complete, atomic, safely loaded training checkpoints (03)
- ``compile_cache``: a persistent compile cache path that outlives Colab/Kaggle (03)
- ``train``: one training step/loop, rank-naming launch, ``python -m tpu_helpers.train`` (03)
- ``predict``: exactly-once, ordered predictions from every replica (04)
- ``lightning``: Lightning 2.6 Trainer arguments, XLA:CPU accelerator, prediction writer (06)
"""

__version__ = "0.1.0"
