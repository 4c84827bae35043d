"""A tiny deterministic object detector for the detection-task gates: bright square blobs on a dark background.

``blob_data(n)`` draws ``n`` images ``(1, 16, 16)``: a faint background texture (values in ``[0, 0.05)``)
and one bright square (side 4 or 5, values in ``[0.9, 1)``) of class 0 at a random place, its box
``x1, y1, x2, y2`` in pixels. ``BlobDetector`` finds the bright pixels (``> 0.5``) and returns their
bounding box with a score computed from the pixels, in torchvision's format (one dict per image).
Variants: ``shift`` moves the boxes off the objects; ``score="box_mean"`` (default) is the mean
intensity in the box; ``"exact"`` the share of box pixels in ``[0.9, 1]`` (collapses under noise);
``"clean_background"`` the box mean times how close the background is to its usual texture (drops on
noisy images: a monitor can read it); ``"constant"`` 0.9 for every box (a monitor can read nothing).

:func:`blob_project` writes a pytester project around it: the module as ``blobs.py``, a
``conftest.py`` whose ``model`` is ``BlobDetector(**MODEL)`` and whose ``dataset`` (and
``monitor_data``) are :class:`~pytest_dnnsafety.data.tasks.DetectionData`, and one test per gate.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

SIZE = 16


def blob_data(n: int = 40, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.random((n, 1, SIZE, SIZE)) * 0.05).astype(np.float32)
    boxes = np.zeros((n, 4), dtype=np.float32)
    for i in range(n):
        side = int(rng.integers(4, 6))
        top, left = (int(v) for v in rng.integers(1, SIZE - side - 1, size=2))
        x[i, 0, top:top + side, left:left + side] = 0.9 + 0.1 * rng.random((side, side))
        boxes[i] = (left, top, left + side, top + side)
    return {"x": x, "boxes": boxes, "labels": np.zeros(n, dtype=np.int64), "offsets": np.arange(n + 1)}


class BlobDetector(nn.Module):
    def __init__(self, score: str = "box_mean", shift: float = 0.0) -> None:
        super().__init__()
        self.score, self.shift = score, shift
        self.scale = nn.Parameter(torch.ones(()))  # a parameter: the model has a device

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        img = x[:, 0] * self.scale
        bright = img > 0.5
        rows, cols = bright.any(dim=2), bright.any(dim=1)
        found = rows.any(dim=1)
        ar = torch.arange(SIZE, device=x.device)
        big = SIZE + 1
        y1 = torch.where(rows, ar, big).amin(dim=1)
        y2 = torch.where(rows, ar + 1, -1).amax(dim=1)
        x1 = torch.where(cols, ar, big).amin(dim=1)
        x2 = torch.where(cols, ar + 1, -1).amax(dim=1)
        inside = ((ar[None, :, None] >= y1[:, None, None]) & (ar[None, :, None] < y2[:, None, None])
                  & (ar[None, None, :] >= x1[:, None, None]) & (ar[None, None, :] < x2[:, None, None]))
        area = inside.sum(dim=(1, 2)).clamp_min(1)
        if self.score == "constant":
            score = torch.full((x.shape[0],), 0.9, device=x.device)
        elif self.score == "exact":
            ok = (img >= 0.9) & (img <= 1.0)
            score = (ok & inside).sum(dim=(1, 2)) / area
        else:
            score = (img * inside).sum(dim=(1, 2)) / area
            if self.score == "clean_background":
                outside = (~inside).sum(dim=(1, 2)).clamp_min(1)
                dev = ((img - 0.025).abs() * ~inside).sum(dim=(1, 2)) / outside
                score = score * (1 - 6 * dev).clamp(0, 1)
        boxes = torch.stack([x1, y1, x2, y2], dim=1).float() + self.shift
        out = []
        for i in range(x.shape[0]):
            keep = found[i:i + 1]
            out.append({"boxes": boxes[i:i + 1][keep], "scores": score[i:i + 1].float()[keep],
                        "labels": torch.zeros(int(keep.sum()), dtype=torch.int64, device=x.device)})
        return out


CONFTEST = """
import pytest
import torch
import blobs
from pytest_dnnsafety.data.tasks import DetectionData

MODEL = {model}


def _data(n, seed):
    d = blobs.blob_data(n, seed)
    return DetectionData.from_offsets(d["x"], d["boxes"], d["labels"], d["offsets"])


@pytest.fixture(scope="session")
def model():
    return blobs.BlobDetector(**MODEL)


@pytest.fixture(scope="session")
def dataset():
    return _data({n}, 0)


@pytest.fixture(scope="session")
def monitor_data():
    return _data(60, 1)
{extra}
"""


def blob_project(gate_project, gates: dict, model: dict | None = None, n: int = 24, extra: str = ""):
    """A pytester project: this module as ``blobs.py``, the detector ``BlobDetector(**model)``, one test per gate."""
    from pathlib import Path

    gate_project.write("blobs.py", Path(__file__).read_text())
    gate_project.write("conftest.py", CONFTEST.format(model=repr(model or {}), n=n, extra=extra))
    gate_project.ini["dnnsafety_seed"] = "0"
    lines = ["import pytest", ""]
    for name, marker in gates.items():
        lines += [f"@pytest.mark.{marker}", f"def test_{name}(model, dataset):", "    pass", ""]
    gate_project.tests("\n".join(lines))
    return gate_project


def gates_of(project) -> dict:
    """The evidence file's gates by test name (``test_<name>``)."""
    import json

    evidence = json.loads((project.pytester.path / "evidence.json").read_text())
    return {g["nodeid"].split("::test_")[1]: g for g in evidence["gates"]}
