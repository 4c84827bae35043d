"""A user project on real images for the gate tests: the digits CNN, its weights and held-out digits.

``write_digits_files(root)`` writes ``netdef.py`` (the example's CNN, ``build()`` and ``trained()``),
``models/digits.pt`` (weights trained in seconds, see :mod:`_digits`) and ``data/eval.npz`` (the
300 digits the model did not train on, ``(N, 1, 8, 8)`` in [0, 1]); ``digits_project`` copies them
into a pytester project with the ini options set and one test per gate marker; ``gates_of``
reads the evidence file back by test name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from _digits import digits_cnn, digits_images
from conftest import GateProject

__all__ = ["NETDEF", "COUNTING_CONFTEST", "write_digits_files", "digits_project", "gates_of", "forward_rows"]

NETDEF = '''
import torch
from torch import nn


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.classifier(self.flatten(self.features(x)))


def build():
    return DigitsCNN()


def trained():
    net = DigitsCNN()
    net.load_state_dict(torch.load(__file__.replace("netdef.py", "models/digits.pt"), weights_only=True))
    return net.eval()
'''


def write_digits_files(root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """netdef.py, models/digits.pt and data/eval.npz under ``root``; returns the evaluation (x, y)."""
    (root / "models").mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(parents=True, exist_ok=True)
    torch.save(digits_cnn().state_dict(), root / "models" / "digits.pt")
    x, y = digits_images()
    x, y = x[1200:1500], y[1200:1500]
    np.savez(root / "data" / "eval.npz", x=x.numpy(), y=y.numpy())
    (root / "netdef.py").write_text(NETDEF)
    return x, y


def digits_project(gate_project: GateProject, files: Path, gates: dict[str, str], conftest: str = "",
                   **ini: str) -> GateProject:
    """``files`` copied into the pytester project, the model and data configured, one test per gate."""
    for path in files.rglob("*"):
        if path.is_file():
            target = gate_project.pytester.path / path.relative_to(files)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    gate_project.ini.update({"dnnsafety_model": "models/digits.pt", "dnnsafety_model_factory": "netdef:build",
                             "dnnsafety_data": "data/eval.npz", "dnnsafety_batch_size": "128"})
    gate_project.ini.update({f"dnnsafety_{key}": value for key, value in ini.items()})
    lines = ["import pytest", ""]
    for name, marker in gates.items():
        lines += [f"@pytest.mark.{marker}", f"def test_{name}(model, dataset):", "    pass", ""]
    gate_project.tests("\n".join(lines))
    if conftest:
        gate_project.write("conftest.py", conftest)
    return gate_project


def gates_of(project: GateProject) -> dict[str, dict]:
    """The evidence file's gates by test name (``test_<name>``)."""
    evidence = json.loads((project.pytester.path / "evidence.json").read_text())
    return {g["nodeid"].split("::test_")[1]: g for g in evidence["gates"]}


#: A conftest.py whose ``model`` counts the rows of every forward pass (written to calls.txt at the end).
COUNTING_CONFTEST = """
import pytest
import netdef
from pytest_dnnsafety.engines.core.guard import probing

CALLS = []


class Counting(netdef.DigitsCNN):
    def forward(self, x):
        if not probing():  # the guard's determinism probe (a few rows, once per model) is not counted
            CALLS.append(x.shape[0])
        return super().forward(x)


@pytest.fixture(scope="session")
def model():
    net = Counting()
    net.load_state_dict(netdef.trained().state_dict())
    return net.eval()


def pytest_sessionfinish(session):
    (session.config.rootpath / "calls.txt").write_text(str(sum(CALLS)))
"""


def forward_rows(project: GateProject) -> int:
    """Rows the counting model saw in the last run (see :data:`COUNTING_CONFTEST`)."""
    return int((project.pytester.path / "calls.txt").read_text())
