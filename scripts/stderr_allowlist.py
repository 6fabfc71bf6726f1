"""The stderr lines a notebook may show a learner, each with the reason it stays.

``scripts/notebook_budget.py`` (the notebooks' pytest plugin) fails a notebook whose executed
output has a non-blank stderr line that matches none of these patterns. Anything else is noise:
silence it at its source (a logger level, a library option, a ``warnings`` filter scoped to the
call) or explain it once in the notebook and add it here with the reason."""

from __future__ import annotations

import re

# (regular expression matched against one stderr line, why a learner may see it)
ALLOWED: list[tuple[str, str]] = [
    # notebook 06
    (r"callbacks/model_checkpoint\.py:\d+: Checkpoint directory .* exists and is not empty",
     "section 6 calls fit again on the same Trainer on purpose (one process: it returns at "
     "once); Lightning's ModelCheckpoint warns that the first fit's checkpoint is in its "
     "folder, and the markdown explains why a new Trainer per run avoids it"),
    # notebooks 07 and 10, where jax and flax are installed without TensorFlow (Colab's TPU image)
    (r"^WARNING:absl:Tensorflow library not found, tensorflow\.io\.gfile operations will use",
     "torch_xla 2.9's bundled torchax imports flax at the first xs.mark_sharding; flax 0.11.2 "
     "(flax/io.py) logs this once when TensorFlow is absent, as on Colab's TPU image; harmless "
     "(notebook 07, section 3, says so); seen in the jax lane"),
    # notebook 09
    (r"^Unexpected Execution Analysis: ",
     "torch_xla's own report when torch_xla.compile(full_graph=True) meets a host read: it names "
     "the Python line, which is what section 6 of notebook 09 shows on purpose"),
]

_COMPILED = [(re.compile(p), why) for p, why in ALLOWED]


def unexplained(lines: list[str]) -> list[str]:
    """The non-blank lines of ``lines`` that no allow-list pattern explains."""
    return [ln for ln in lines if ln.strip() and not any(p.search(ln) for p, _ in _COMPILED)]
