"""Brief training of the project's three models on ``data/train`` (a minute or two on a CPU).

``python -m scale_demo.train [--width 8] [--epochs 2]`` writes to ``models/``:

* ``resnet18_w8.pt``: the ResNet-18-style model at 224x224 (ImageNet stem) — most gates;
* ``vit_d64_l2.pt``: the ViT-style model (patch 16, dim 64, depth 2, 2 heads) — the scenario,
  confusion and adversarial gates in ``tests/test_vit.py``;
* ``resnet18_cifar_w8_16px.pt``: the ResNet-18-style model with the CIFAR stem on the images averaged
  down to 16x16 — the certified gates (CROWN bounds Conv/BatchNorm/ReLU/residual additions, not
  LayerNorm or softmax, and its cost grows with the image) and ``min_safe_radius``;
* ``detector_resnet18_w8.pt``: the one-object detector (the same ResNet-18-style backbone, a class head
  and a box head), trained on :class:`~scale_demo.data.ShardBoxes` with cross-entropy plus smooth-L1
  on the normalised (cx, cy, w, h) and GIoU on the box — the detection gates in ``tests/test_detection.py``;
* ``train.json``: each model's training accuracy (the detector's mean IoU too) and seconds.

A random model's gates are inconclusive (no signal); a briefly trained one is what the gates measure.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import project
from .data import SIZE, ShardBoxes, ShardImages

__all__ = ["train", "train_detector", "box_loss", "main"]


def _corners(b: torch.Tensor) -> torch.Tensor:
    """(cx, cy, w, h) -> (x1, y1, x2, y2)."""
    return torch.cat([b[:, :2] - b[:, 2:] / 2, b[:, :2] + b[:, 2:] / 2], 1)


def _giou(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IoU and generalised IoU of paired boxes ``(n, 4)`` x1, y1, x2, y2 (Rezatofighi et al. 2019)."""
    lo, hi = torch.maximum(a[:, :2], b[:, :2]), torch.minimum(a[:, 2:], b[:, 2:])
    inter = (hi - lo).clamp(min=0).prod(1)
    union = (a[:, 2:] - a[:, :2]).prod(1) + (b[:, 2:] - b[:, :2]).prod(1) - inter
    hull = (torch.maximum(a[:, 2:], b[:, 2:]) - torch.minimum(a[:, :2], b[:, :2])).prod(1)
    return inter / union, inter / union - (hull - union) / hull


def box_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Smooth-L1 on normalised (cx, cy, w, h) plus 1 - GIoU, for ``pred``/``target`` ``(n, 4)`` in that form."""
    return 5.0 * F.smooth_l1_loss(pred, target, beta=0.05) + (1.0 - _giou(_corners(pred), _corners(target))[1]).mean()


def train_detector(folder: Path, *, epochs: int = 2, batch_size: int = 32, lr: float = 2e-3, seed: int = 0,
                   w: int | None = None, num_workers: int = 2) -> tuple[torch.nn.Module, dict]:
    """Train the detector on the split ``folder`` (:class:`ShardBoxes`); returns it in eval mode."""
    data = ShardBoxes(folder)
    model = project.build("detector", w).train()
    gen = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, generator=gen,
                                         num_workers=num_workers)  # default collate: boxes (B, 1, 4), labels (B, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(loader), pct_start=0.2)
    began = time.perf_counter()
    for epoch in range(epochs):
        correct = seen = 0
        iou_sum = 0.0
        for x, target in loader:
            y, box = target["labels"][:, 0], target["boxes"][:, 0] / SIZE  # one object per image
            goal = torch.cat([(box[:, :2] + box[:, 2:]) / 2, box[:, 2:] - box[:, :2]], 1)  # (cx, cy, w, h)
            logits, pred = model.heads(x)
            loss = F.cross_entropy(logits, y) + box_loss(pred, goal)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            correct += int((logits.argmax(1) == y).sum())
            seen += len(y)
            iou_sum += float(_giou(_corners(pred.detach()), box)[0].sum())
    model.eval()
    return model, {"train_accuracy_last_epoch": correct / max(seen, 1),
                   "train_mean_iou_last_epoch": round(iou_sum / max(seen, 1), 4), "epochs": epochs,
                   "images": len(data), "seconds": round(time.perf_counter() - began, 1)}


def train(kind: str, folder: Path, *, epochs: int = 2, batch_size: int = 32, lr: float = 2e-3, seed: int = 0,
          w: int | None = None, num_workers: int = 2) -> tuple[torch.nn.Module, dict]:
    """Train ``kind`` (see :func:`scale_demo.project.build`) on the split ``folder``; returns it in eval mode."""
    size = project.SMALL if kind == "resnet_small" else 224
    data: torch.utils.data.Dataset = ShardImages(folder, size=size)
    if size != 224:  # small images: average them down once (through the loader), not every epoch
        xs, ys = zip(*torch.utils.data.DataLoader(data, batch_size=256, num_workers=num_workers))
        data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    model = project.build(kind, w).train()
    gen = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, generator=gen,
                                         num_workers=num_workers if size == 224 else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.2)
    began, correct, seen = time.perf_counter(), 0, 0
    for epoch in range(epochs):
        correct = seen = 0
        for x, y in loader:
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            correct += int((out.argmax(1) == y).sum())
            seen += len(y)
    model.eval()
    return model, {"train_accuracy_last_epoch": correct / max(seen, 1), "epochs": epochs, "images": len(data),
                   "seconds": round(time.perf_counter() - began, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=project.width(), help="the 224x224 ResNet's width (default 8)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["resnet", "vit", "resnet_small", "detector"])
    args = parser.parse_args(argv)
    folder = project.data_dir() / "train"
    out = project.models_dir()
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    for kind in args.models:
        # small images are cheap: more epochs; the detector learns two heads: with 2 epochs its scores stayed under
        # 0.5 (recall at score 0.5 near 0 in most classes), with 4 (46 s on 2 shared cores) its mAP@0.5 is ~0.9
        epochs = args.epochs * {"resnet_small": 3, "detector": 2}.get(kind, 1)
        if kind == "detector":
            model, record = train_detector(folder, epochs=epochs, w=args.width)
        else:
            model, record = train(kind, folder, epochs=epochs, w=args.width)
        path = project.weights_path(kind, args.width)
        torch.save(model.state_dict(), path)
        log[path.name] = record
        print(f"{path.name}: {record}")
    log_path.write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
