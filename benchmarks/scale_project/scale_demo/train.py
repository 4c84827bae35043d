"""Brief training of the project's three models on ``data/train`` (a minute or two on a CPU).

``python -m scale_demo.train [--width 8] [--epochs 2]`` writes to ``models/``:

* ``resnet18_w8.pt``: the ResNet-18-style model at 224x224 (ImageNet stem) — most gates;
* ``vit_d64_l2.pt``: the ViT-style model (patch 16, dim 64, depth 2, 2 heads) — the scenario,
  confusion and adversarial gates in ``tests/test_vit.py``;
* ``resnet18_cifar_w8_16px.pt``: the ResNet-18-style model with the CIFAR stem on the images averaged
  down to 16x16 — the certified gates (CROWN bounds Conv/BatchNorm/ReLU/residual additions, not
  LayerNorm or softmax, and its cost grows with the image) and ``min_safe_radius``;
* ``train.json``: each model's training accuracy and seconds.

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
from .data import ShardImages

__all__ = ["train", "main"]


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
    parser.add_argument("--models", nargs="+", default=["resnet", "vit", "resnet_small"])
    args = parser.parse_args(argv)
    folder = project.data_dir() / "train"
    out = project.models_dir()
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    for kind in args.models:
        epochs = args.epochs * (3 if kind == "resnet_small" else 1)  # small images are cheap: more epochs
        model, record = train(kind, folder, epochs=epochs, w=args.width)
        path = project.weights_path(kind, args.width)
        torch.save(model.state_dict(), path)
        log[path.name] = record
        print(f"{path.name}: {record}")
    log_path.write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
