"""Where the project's data and weights live, and the model factories its pytest configuration names.

Paths default to ``data/`` and ``models/`` next to ``pyproject.toml``; the environment overrides
them (``SCALE_DATA``, ``SCALE_MODELS``), ``SCALE_WIDTH`` picks the ResNet's width (default 8) and
``SCALE_CERTIFIED_SIZE`` the side of the certified gates' images (16: the CIFAR-stem model on images
averaged down; 224: the ResNet itself on the full images), so the benchmark runner and the suite's
test can point one project at other folders and sizes. :func:`export` writes the ResNet as a
``torch.export`` program (``.pt2``), the format users deploy; the runner's ``--pt2`` gates that file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .models import Detector, ResNet, ViT, detector as _detector, resnet18, vit

__all__ = ["ROOT", "data_dir", "models_dir", "width", "certified_size", "VIT", "SMALL", "weights_path", "build",
           "resnet", "vit_model", "resnet_small", "detector", "export"]

ROOT = Path(__file__).resolve().parent.parent
#: The ViT the project trains: small enough for a CPU (1,178 images/s at 224x224 on 2 cores, untrained).
VIT = {"dim": 64, "depth": 2, "heads": 2}
#: The side of the certified gates' images (averaged down from 224): CROWN on the CIFAR-stem ResNet-18 (width 8)
#: took 37 s for two 16x16 images and over 4 minutes for one 32x32 image on this 2-core machine under load.
SMALL = 16


def data_dir() -> Path:
    return Path(os.environ.get("SCALE_DATA", ROOT / "data")).resolve()


def models_dir() -> Path:
    return Path(os.environ.get("SCALE_MODELS", ROOT / "models")).resolve()


def width() -> int:
    return int(os.environ.get("SCALE_WIDTH", "8"))


def certified_size() -> int:
    """The side of the certified gates' images: :data:`SMALL` (default) or 224 (the full images, the ResNet)."""
    return int(os.environ.get("SCALE_CERTIFIED_SIZE", str(SMALL)))


def weights_path(kind: str, w: int | None = None) -> Path:
    """``resnet`` (224x224, ImageNet stem, width ``w``), ``vit``, ``resnet_small`` (SMALL x SMALL, CIFAR stem,
    width 8), ``detector`` (the ResNet backbone of width ``w`` with a class and a box head) or ``resnet_pt2`` (the
    trained ResNet exported by :func:`export`)."""
    w = width() if w is None else w
    names = {"resnet": f"resnet18_w{w}.pt", "resnet_pt2": f"resnet18_w{w}.pt2", "vit": "vit_d{dim}_l{depth}.pt".format(**VIT),
             "resnet_small": f"resnet18_cifar_w8_{SMALL}px.pt", "detector": f"detector_resnet18_w{w}.pt"}
    return models_dir() / names[kind]


def build(kind: str, w: int | None = None) -> ResNet | ViT | Detector:
    """The untrained module of ``kind`` (eval mode)."""
    if kind == "resnet":
        return resnet18(width=width() if w is None else w)
    if kind == "vit":
        return vit(**VIT)
    if kind == "resnet_small":
        return resnet18(width=8, stem="cifar")
    if kind == "detector":
        return _detector(width=width() if w is None else w)
    raise ValueError(f"unknown model kind {kind!r}: use 'resnet', 'vit', 'resnet_small' or 'detector'")


def _load(kind: str) -> ResNet | ViT | Detector:
    path = weights_path(kind)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m scale_demo.train` first (it writes "
                                f"{models_dir()})")
    model = build(kind)
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


def resnet() -> ResNet:
    """The trained ResNet-18-style model at 224x224 (``dnnsafety_model`` names this factory)."""
    return _load("resnet")


def vit_model() -> ViT:
    return _load("vit")


def resnet_small() -> ResNet:
    return _load("resnet_small")


def detector() -> Detector:
    """The trained one-object detector (ResNet-18-style backbone, width ``SCALE_WIDTH``)."""
    return _load("detector")


def export(w: int | None = None) -> Path:
    """The trained ResNet of width ``w`` as a ``torch.export`` program with a dynamic batch (written once)."""
    path = weights_path("resnet_pt2", w)
    if not path.exists():
        model = build("resnet", w)
        model.load_state_dict(torch.load(weights_path("resnet", w), weights_only=True))
        batch = torch.export.Dim("batch", min=1, max=1 << 16)
        program = torch.export.export(model.eval(), (torch.rand(2, 3, 224, 224),), dynamic_shapes=({0: batch},))
        torch.export.save(program, path)
    return path
