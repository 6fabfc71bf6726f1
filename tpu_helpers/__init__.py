"""tpu_helpers: the small, tested toolbox the tpu-notebooks course teaches.

Copy the package into your project. Importing it (or any module in it) never touches the
XLA device, so it is safe before ``torch_xla.launch``. Modules, lowest layer first:

- ``env``: runtime detection (Colab/Kaggle/TPU VM/local), local XLA:CPU emulation,
  version checks, the notebooks' setup function (notebook 00)
- ``metrics``: compile/execute/transfer/fallback counts and limits (notebooks 00, 05)
- ``notebook_template``: the notebook template, badges and checker (all notebooks)

Higher layers (data, spmd, checkpoint, train, predict, lightning) are listed in the
README's module table.
"""

__version__ = "0.1.0"
