# expect:
# "TPU training (Basic)", Lightning's own docs page (an older version): its "Run on TPU cores"
# code. Still correct for Lightning 2.6: the doctor must find nothing.
from lightning.pytorch import Trainer

# run on as many TPUs as available by default
trainer = Trainer(accelerator="auto", devices="auto", strategy="auto")
# equivalent to
trainer = Trainer()

# run on one TPU core
trainer = Trainer(accelerator="tpu", devices=1)
# run on multiple TPU cores
trainer = Trainer(accelerator="tpu", devices=8)
# run on one specific TPU core: the 2nd core (index 1)
trainer = Trainer(accelerator="tpu", devices=[1])
# choose the number of cores automatically
trainer = Trainer(accelerator="tpu", devices="auto")
