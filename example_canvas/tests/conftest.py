"""Fixtures of the canvas_demo tests: the project has two models on the same canvases.

``pyproject.toml`` makes the detector and its detection data the plugin's default ``model`` and
``dataset``. The multi-label reader and its data are the fixtures ``reader`` and ``ml_data`` below;
a gate names them with its role keywords (``model="reader", data="ml_data"``). Both data files hold
the same canvases in the same order, so one scenario table (``data/scenarios.csv``) serves both.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from pytest_dnnsafety import DetectionData, DetectionScore

from canvas_demo.models import build_reader

PROJECT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def reader(model):
    """The multi-label reader (models/reader.pt), in eval mode, on the detector's (the configured) device."""
    net = build_reader()
    net.load_state_dict(torch.load(PROJECT / "models" / "reader.pt", weights_only=True))
    return net.to(next(model.parameters(), torch.empty(0)).device).eval()


@pytest.fixture(scope="session")
def ml_data():
    """The evaluation canvases with their multi-label ground truth: x (N, 1, 48, 48), y (N, 10) 0/1."""
    with np.load(PROJECT / "data" / "eval_multilabel.npz") as f:
        return torch.utils.data.TensorDataset(torch.from_numpy(f["x"]), torch.from_numpy(f["y"]))


@pytest.fixture(scope="session")
def first_canvases(dataset):
    """The first 60 evaluation canvases (about 160 digits) with their boxes: the occlusion and attack
    gates query the detector hundreds of times per canvas, so they run on a sample."""
    return DetectionData(dataset.x[:60], dataset.targets.images(0, 60))


@pytest.fixture(scope="session")
def first_digit_masks():
    """The ink of each digit of ``first_canvases`` (M, 48, 48) bool, in the packed targets' order."""
    with np.load(PROJECT / "data" / "masks.npz") as f, np.load(PROJECT / "data" / "eval_detection.npz") as d:
        return torch.from_numpy(f["object_masks"][: int(d["offsets"][60])])


@pytest.fixture(scope="session")
def monitors():
    """The runtime monitor of the detector: 1 - its top detection score (fitted on data/monitor_fit.npz)."""
    return {"top_score": DetectionScore(k=1)}
