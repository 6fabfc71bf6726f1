# expect: host-read-in-loop@34 host-read-in-loop@35
# Written here, not copied: a metric helper fed device tensors at every step (TPUFitter style).
# The loss read by summary_loss.update(loss.detach().item(), ...) is found; the reads inside
# RocAucMeter.update (y_true.cpu().numpy()), called with the targets and outputs every step, are
# a known miss: the static pass does not follow calls into the file's helpers. Models
# PLSE-Lab/Python-MLAPI-expl @c8783d17fe82a606cab35414cc088347c825c178
# python_sources/torch-xla-melanoma-crazy-fast.py (l.418-420) and
# python_sources/tpu-training-super-fast-xlmroberta.py (l.642, 644).
# ruff: noqa
import numpy as np
import torch
import torch_xla.core.xla_model as xm
from sklearn import metrics


class RocAucMeter:
    def __init__(self):
        self.y_true, self.y_pred = [], []

    def update(self, y_true, y_pred):
        self.y_true.append(y_true.cpu().numpy().argmax(axis=1))
        self.y_pred.append(torch.softmax(y_pred, dim=1).detach().cpu().numpy()[:, 1])


def train_one_epoch(train_loader, model, optimizer, criterion, device, summary_loss):
    roc_auc_scores = RocAucMeter()
    for step, (images, targets) in enumerate(train_loader):
        images = images.to(device, dtype=torch.float32)
        targets = targets.to(device, dtype=torch.float32)
        optimizer.zero_grad()
        outputs = model(images)
        loss = criterion(outputs, targets)
        loss.backward()
        roc_auc_scores.update(targets, outputs)
        summary_loss.update(loss.detach().item(), images.size(0))
        xm.optimizer_step(optimizer)
    return summary_loss, roc_auc_scores
