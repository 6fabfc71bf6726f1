# expect: lightning-removed-arg@7
# "How does PyTorch Lightning handle data parallelism on TPUs" (a knowledge-base answer citing
# Lightning 1.5's docs): "to use a full TPU pod with 8 cores, you would set tpu_cores=8 in the
# Trainer initialization" (notebooks 06 and 08 correct it).
from lightning.pytorch import Trainer

trainer = Trainer(tpu_cores=8)
