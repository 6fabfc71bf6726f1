"""tpu_helpers: the tested toolbox the tpu-notebooks course teaches (course code: ``course/``).

Importing it (or any module in it) never touches the XLA device. Modules (notebook):
- ``env``: runtime detection, XLA:CPU emulation, versions (00); ``metrics``: XLA counts, limits (05)
- ``data``: checked data, fixed-shape loaders (01); ``device_loader``: strict MpDeviceLoader (02)
- ``checkpoint``: atomic, safely loaded checkpoints; ``train``: the training loop, ``fit`` (03)
- ``launch``: torch_xla.launch naming the failing rank (03); ``spmd``: meshes, annotations,
  bytes per device (07); ``sharded_checkpoint``: SPMD checkpoints, atomic, loaded safely (07)
- ``ordering``: exactly-once ordering, rank files; ``predict``: predictions from every replica (04)
- ``tpu_lightning``: Lightning 2.6 Trainer arguments, atomic checkpoint IO; ``lightning_writer``:
  exactly-once predictions from ``trainer.predict`` on several processes (06)
- ``buckets``: text of any length in length buckets (09)
- ``doctor`` (with ``doctor_run``, ``doctor_static``): a tool beside the library that reads a
  script and says what will go wrong on a TPU; ``python -m tpu_helpers.doctor``, ``tpu-doctor`` (05)
"""

__version__ = "0.1.0"
