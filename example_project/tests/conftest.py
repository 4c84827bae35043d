"""Project fixtures and gates for the digits_demo tests.

Besides registering the project's own gate, this file sets up the runtime-monitor tests
(``tests/test_monitors.py``): a second reader that never learned the digits 8 and 9, the
evaluation digits it knows (in-distribution) and those it does not (novel classes), and the
monitors the gates may name.
"""

from pathlib import Path

import pytest
import torch

from pytest_dnnsafety import Energy, Mahalanobis, MSP, ODIN, OutsideTheBox, hookimpl

from digits_demo.calibration import MAX_CALIBRATION_ERROR
from digits_demo.model import build_model
from digits_demo.train import KNOWN_DIGITS

PROJECT = Path(__file__).resolve().parent.parent


@hookimpl
def pytest_dnnsafety_register_gates(registry):
    registry.add(MAX_CALIBRATION_ERROR)


@pytest.fixture(scope="session")
def reader_0to7(model):
    """The reader trained on the digits 0-7 only, on the same device as the main model."""
    reader = build_model(num_classes=KNOWN_DIGITS)
    reader.load_state_dict(torch.load(PROJECT / "models" / "digits_cnn_0to7.pt", weights_only=True))
    return reader.to(next(model.parameters(), torch.empty(0)).device).eval()  # an ONNX model has none: CPU


@pytest.fixture(scope="session")
def known_digits(dataset):
    """The evaluation images of the digits 0-7: in-distribution for ``reader_0to7``."""
    x, y = dataset.tensors
    keep = y < KNOWN_DIGITS
    return torch.utils.data.TensorDataset(x[keep], y[keep])


@pytest.fixture(scope="session")
def ood_data(dataset):
    """The evaluation images of 8 and 9: classes ``reader_0to7`` never saw (the novel-class faults)."""
    x, y = dataset.tensors
    return torch.utils.data.TensorDataset(x[y >= KNOWN_DIGITS])


@pytest.fixture(scope="session")
def monitors():
    """The runtime monitors the gates may name; each is fitted once per session on data/monitor_fit.npz."""
    return {
        "msp": MSP(),
        "odin": ODIN(temperature=1000.0, epsilon=0.0014),
        "energy": Energy(),
        # 64 ReLU features before the last layer, 3 boxes per digit, each widened by 10 % of its size
        "oob": OutsideTheBox(layer="classifier.1", clusters=3, enlarge=0.1),
        "mahalanobis": Mahalanobis(layer="classifier.1"),
    }


@pytest.fixture(scope="session")
def first_100_digits(dataset):
    """The first 100 evaluation images: the safe-radius search polls 128 directions per step, so the
    gate runs on a sample (every image costs about 50,000 forward evaluations on a CPU)."""
    x, y = dataset.tensors
    return torch.utils.data.TensorDataset(x[:100], y[:100])
