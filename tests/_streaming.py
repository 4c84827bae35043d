"""A streaming data set and a one-gate-per-family user project, for the issue #20 acceptance tests.

* :class:`StreamingImages`: a map-style data set of ``n`` 3x32x32 images in [0, 1] generated from
  the index alone (the data set holds only ten class templates, 120 KiB, whatever ``n``), label
  ``index % 10``. It is read one input at a time: a slice, a list or a tensor of indices raises
  ``TypeError`` ("indexed all at once"), and it has no ``.tensors``; it counts the inputs it
  loaded (``loaded``) so a test can tell how much of it a gate (or a torchrun rank) read.
* :class:`StreamNet` and :func:`stream_net`: a small classifier whose weights match the class
  templates (set, not trained: instant), confident but not saturated, so that every family
  measures a signal (occlusion, robustness) rather than a random model's noise.
* :data:`FAMILIES`: every gate family, its markers and which data its gates read;
  :func:`write_project` writes a user project (conftest, one test per gate) whose data fixtures
  are ``DataLoader(StreamingImages(n))``; :data:`CONFTEST` sizes them from the environment
  (``STREAM_N`` for the evaluation data, ``STREAM_N_SMALL`` for the expensive families' data)
  and writes, at the end of the run, the process's peak RSS, the inputs each data set loaded and
  the rows each model forwarded to ``$STREAM_RECORD_DIR/rank<RANK or single>.json``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["SHAPE", "TINY", "StreamingImages", "StreamingBoxes", "StreamDetector", "StreamNet", "stream_net", "FAMILIES", "CONFTEST", "MODEL_FREE",
           "write_project"]

SHAPE = (3, 32, 32)
TINY = (1, 8, 8)
CLASSES = 10


@functools.lru_cache(maxsize=4)
def _templates(shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    """Ten class templates in twins (0, 1), (2, 3), ...: half of each is its pair's common pattern, so the
    twins look alike inside the model (DeepInspect's confusion and bias have pairs to rank)."""
    gen = torch.Generator().manual_seed(12345)
    common = torch.rand((CLASSES // 2, *shape), generator=gen).repeat_interleave(2, dim=0)
    return 0.5 * common + 0.5 * torch.rand((CLASSES, *shape), generator=gen)


class StreamingImages(torch.utils.data.Dataset):
    """``n`` images ``0.6 * template[index % 10] + 0.4 * noise(seed, index)``, label ``index % 10``.

    Indexed by one int at a time only: anything else is a ``TypeError`` (a gate that indexes the
    data set all at once, or slices it, materialises it).
    """

    def __init__(self, n: int, seed: int = 0, tag: str = "data", shape: tuple[int, ...] = SHAPE) -> None:
        self.n, self.seed, self.tag, self.shape = int(n), int(seed), tag, tuple(shape)
        self.loaded = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, int]:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"StreamingImages({self.n}) is read one input at a time; it was indexed all at once "
                            f"with {type(index).__name__} {index!r}")
        index = int(index)
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for StreamingImages({self.n})")
        self.loaded += 1
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % CLASSES
        return 0.6 * _templates(self.shape)[label] + 0.4 * torch.rand(self.shape, generator=gen), label


class StreamingBoxes(StreamingImages):
    """:class:`StreamingImages` as detection data: each image holds one object, its class's template, in the
    box ``BOX`` (every eighth image none: an empty image); read one input at a time, counted the same way."""

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # type: ignore[override]
        image, label = super().__getitem__(index)
        if int(index) % 8 == 7:
            return image, {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}
        return image, {"boxes": torch.tensor([BOX]), "labels": torch.tensor([label])}


#: The object box of :class:`StreamingBoxes` and the box :class:`StreamDetector` answers with.
BOX = (4.0, 4.0, 28.0, 28.0)


class StreamDetector(nn.Module):
    """A detector made of :class:`StreamNet`: one box per image at ``BOX`` (shifted by the class's logit margin,
    so some boxes miss), scored by the softmax top probability, labelled with the arg-max class."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        prob = torch.softmax(self.net(x), dim=1)
        score, label = prob.max(dim=1)
        shift = (1.0 - score) * 12.0  # unsure: the box drifts off the object
        boxes = torch.tensor(BOX, device=x.device) + shift[:, None]
        return [{"boxes": boxes[i:i + 1], "scores": score[i:i + 1], "labels": label[i:i + 1]}
                for i in range(x.shape[0])]


class StreamNet(nn.Module):
    """flatten fc(3x32x32 = 3072 -> 32) ReLU fc(32 -> 10), weights set by :func:`stream_net` (no training)."""

    def __init__(self, shape: tuple[int, ...] = SHAPE) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(nn.Linear(int(np.prod(shape)), 32), nn.ReLU(), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(x))


@functools.lru_cache(maxsize=4)
def _weights(shape: tuple[int, ...] = SHAPE) -> dict[str, torch.Tensor]:
    """Template matching: hidden unit c scores ``(T_c - T̄)·x`` centred on an image of another class (about 0),
    about 0.6·|T_c - T̄|² on its own class; the logits scale it to ``LOGIT`` (confident, not saturated). Units
    10..31 are small seeded random features (so the neuron gates see more than ten units)."""
    t = _templates(shape).flatten(1).double()
    centred = t - t.mean(0)
    gen = torch.Generator().manual_seed(7)
    w1 = torch.randn(32, t.shape[1], generator=gen, dtype=torch.float64) * 0.02
    b1 = torch.zeros(32, dtype=torch.float64)
    w1[:CLASSES] = centred
    b1[:CLASSES] = -(centred * (0.6 * t.mean(0) + 0.2)).sum(1)  # an image of another class scores about 0
    own = 0.6 * (centred * centred).sum(1)  # what a clean image of class c adds
    w2 = torch.zeros(CLASSES, 32, dtype=torch.float64)
    w2[:, :CLASSES] = torch.diag(LOGIT / own)
    return {"classifier.0.weight": w1.float(), "classifier.0.bias": b1.float(),
            "classifier.2.weight": w2.float(), "classifier.2.bias": torch.zeros(CLASSES)}


LOGIT = 6.0


def stream_net(shape: tuple[int, ...] = SHAPE) -> StreamNet:
    """A :class:`StreamNet` for images of ``shape`` in eval mode with its template-matching weights."""
    model = StreamNet(shape)
    model.load_state_dict(_weights(tuple(shape)))
    return model.eval()


#: family -> (its data: "dataset" = the evaluation data, "small" = a smaller loader for an expensive family,
#: "tiny" = a smaller loader of 1x8x8 images and a model for them (DeepQuant's pattern search polls every
#: input dimension: about 8 s per 3x32x32 image), "pmi" = labelled operational images, streamed in passes;
#: markers without the data= keyword).
FAMILIES: dict[str, tuple[str, list[str]]] = {
    "neurons": ("dataset", ["min_neuron_k_activation(0.0, layer='classifier.1', k=1)",
                            "max_neuron_pattern_deviation(1.0, layer='classifier.1', groups=4, "
                            "where={'light': 'night'})"]),
    "coverage": ("dataset", ["min_scene_coverage(0.0, k=2)"]),
    "performance": ("dataset", ["min_scenario_accuracy(0.0, by=['light'], min_samples=5)",
                                "max_scenario_degradation(1.0, by=['light'])"]),
    "weighted_confusion": ("dataset", ["max_weighted_confusion(9.0, confidence=0.95)"]),
    "inspection": ("dataset", ["max_class_confusion(1.0, layer='classifier.0')",
                               "max_class_bias(0.5, layer='classifier.0', label_filter=False)"]),
    "adversarial": ("dataset", ["max_adversarial_confidence_loss(1.0, eps=0.01, families=['fgsm', 'pgd'], "
                                "clip=(0, 1))",
                                "min_robust_accuracy(0.0, eps=0.01, families=['fgsm', 'pgd'], clip=(0, 1))"]),
    "occlusion": ("dataset", ["min_interpretation_precision(0.0, size=16, stride=8, fill=0.0, rho=0.95, "
                              "no_hot='zero')",
                              "min_occlusion_sensitivity(0.0, size=16, stride=8, fill=0.0, rho=0.95)",
                              "max_occlusion_sensitivity(1.0, size=16, stride=8, fill=0.0, rho=0.95)"]),
    "monitors": ("dataset", ["min_monitor_detection(-1.0, monitor='energy', faults='noise', severity=3)",
                             "max_monitor_selective_risk(1.0, monitor='maha')"]),
    # a wall-clock timing (GateDef.timed): under torchrun rank 0 times it, so it is a family of its own here
    "monitor_overhead": ("dataset", ["max_monitor_overhead(1000000.0, monitor='maha', repeats=1)"]),
    "certified": ("small", ["min_verified_robustness(0.0, eps=0.001, method='crown', clip=(0, 1))"]),
    "quantification": ("tiny", ["min_safe_radius(0.0, d=0.05, iterations=3, starts=1, ascent_starts=1, "
                                 "ascent_steps=2, certified_steps=3)"]),
    "pmi": ("pmi", ["max_pmi_ub(1.0, cells='balls', norm='linf', radius=0.02, clip=(0, 1), samples_per_cell=150, "
                    "bootstrap=0, profile='pmi_data')"]),
    "detection": ("boxes", ["min_detection_map(0.0, by=['light'], min_images=5, bootstrap=100)",
                            "min_detection_recall(0.0, by=['light'], min_images=5, bootstrap=100)"]),
}

#: Families whose gates read no model (min_scene_coverage reads the scenario table and the data's length).
MODEL_FREE = {"coverage"}

#: The project's conftest.py; :func:`write_project` fills in ``PER_FAMILY`` (family -> kind, or empty).
CONFTEST = '''
import json
import os
from pathlib import Path

import pytest
import torch

from _streaming import SHAPE, TINY, StreamDetector, StreamingBoxes, StreamingImages, stream_net
from pytest_dnnsafety import Energy, Mahalanobis, OperationalProfile, detection_collate
from pytest_dnnsafety.engines.core.guard import probing
from pytest_dnnsafety.engines.reliability.profile import PCA
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable

N = int(os.environ.get("STREAM_N", "256"))
N_SMALL = int(os.environ.get("STREAM_N_SMALL", "8"))
BATCH = int(os.environ.get("STREAM_BATCH", "64"))
BATCH_SMALL = int(os.environ.get("STREAM_BATCH_SMALL", "4"))
DATASETS, ROWS = [], {}
PER_FAMILY = {PER_FAMILY}


def _loader(n, seed=0, tag="data", shape=SHAPE, batch_size=BATCH):
    data = StreamingImages(n, seed=seed, tag=tag, shape=shape)
    DATASETS.append(data)
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def _box_loader(n, tag):
    data = StreamingBoxes(n, tag=tag)
    DATASETS.append(data)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, collate_fn=detection_collate)


def _counted(net, tag):
    """``net`` counting the rows of its forward passes under ``tag`` (the guard's determinism probe excepted)."""
    ROWS.setdefault(tag, 0)

    def count(module, args):
        if not probing():
            ROWS[tag] += int(args[0].shape[0])

    net.register_forward_pre_hook(count)
    return net


@pytest.fixture(scope="session")
def model():
    return _counted(stream_net(), "model")


@pytest.fixture(scope="session")
def dataset():
    return _loader(N, tag="dataset")


@pytest.fixture(scope="session")
def small_data():
    return _loader(N_SMALL, tag="small", batch_size=BATCH_SMALL)


@pytest.fixture(scope="session")
def tiny_data():
    return _loader(N_SMALL, tag="tiny", shape=TINY, batch_size=BATCH_SMALL)


@pytest.fixture(scope="session")
def tiny_model():
    return _counted(stream_net(TINY), "tiny")


@pytest.fixture(scope="session")
def box_data():
    return _box_loader(N, tag="boxes")


@pytest.fixture(scope="session")
def detector():
    return _counted(StreamDetector(stream_net()), "detector")


def _family_fixtures(family, kind):
    shape = TINY if kind == "tiny" else SHAPE

    def data():
        if kind == "dataset":
            return _loader(N, tag=family)
        if kind == "boxes":
            return _box_loader(N, tag=family)
        return _loader(N_SMALL, tag=family, shape=shape, batch_size=BATCH_SMALL)

    def model():
        if kind == "boxes":
            return _counted(StreamDetector(stream_net()), family)
        return _counted(stream_net(shape), family)

    return (pytest.fixture(scope="session", name="data_" + family)(data),
            pytest.fixture(scope="session", name="model_" + family)(model))


for _family, _kind in PER_FAMILY.items():  # one loader and model per family: nothing is shared between families
    globals()["data_" + _family], globals()["model_" + _family] = _family_fixtures(_family, _kind)


@pytest.fixture(scope="session")
def monitor_data():
    return _loader(512, seed=1, tag="monitor_data")


@pytest.fixture(scope="session")
def monitors():
    return {"energy": Energy(), "maha": Mahalanobis(layer="classifier.1")}


@pytest.fixture(scope="session")
def scenario_table():
    """light = index % 3, blur = (index // 3) % 2: one row per evaluation input, as codes (16 bytes a row)."""
    conditions = Conditions({"light": ["day", "dusk", "night"], "blur": ["none", "light"]})
    index = torch.arange(N)
    return ScenarioTable(conditions, torch.stack([index % 3, (index // 3) % 2], dim=1))


@pytest.fixture(scope="session")
def masks():
    """The central 16x16 square of every image: an expanded view (no memory per input)."""
    mask = torch.zeros(1, 32, 32, dtype=torch.bool)
    mask[:, 8:24, 8:24] = True
    n = max(N, N_SMALL)
    return mask.expand(n, 32, 32)


@pytest.fixture(scope="session")
def severity_matrix():
    index = torch.arange(10, dtype=torch.float64)
    return (index[:, None] - index[None, :]).abs()


def _operational():
    data = StreamingImages(60, seed=2, tag="pmi")
    x = torch.stack([data[i][0] for i in range(len(data))])
    return x, torch.arange(60) % 10


@pytest.fixture(scope="session")
def pmi_data():
    """The labelled operational images, streamed: max_pmi_ub (cells='balls') puts a ball around each, read in passes
    (3 ``N_SMALL`` of them: the peak-RSS test grows them tenfold with the other expensive families' data)."""
    return _loader(3 * N_SMALL, seed=2, tag="pmi")


@pytest.fixture(scope="session")
def operational_profile():
    x, _ = _operational()
    pca = PCA(2).fit(x)
    return OperationalProfile(x, encoder=pca.encode, decoder=lambda z: pca.decode(z).clamp(0, 1).float())


def pytest_unconfigure(config):
    folder = os.environ.get("STREAM_RECORD_DIR")
    if folder:
        loaded = {}
        for data in DATASETS:
            loaded[data.tag] = loaded.get(data.tag, 0) + data.loaded
        import resource  # POSIX: this process's peak resident set size, in KiB on Linux

        record = {"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "loaded": loaded, "rows": ROWS,
                  "n": N, "n_small": N_SMALL}
        Path(folder, "rank" + os.environ.get("RANK", "single") + ".json").write_text(json.dumps(record))
'''


def write_project(root: Path, families: dict[str, tuple[str, list[str]]] | None = None, *,
                  per_family: bool = False) -> dict[str, str]:
    """A user project under ``root``: conftest.py, pyproject.toml and test_gates.py, one test per gate.

    Tests are named ``test_<family>_<i>``. The gates read ``model`` and ``dataset`` (or
    ``small_data`` / ``tiny_data`` and ``tiny_model`` / ``pmi_data``); with ``per_family`` every
    family reads its own loader ``data_<family>`` and model ``model_<family>`` (so no computation is
    shared between families, and each family's loads and forward rows are counted apart). Returns
    the test names mapped to their markers.
    """
    families = FAMILIES if families is None else families
    root.mkdir(parents=True, exist_ok=True)
    kinds = {family: kind for family, (kind, _) in families.items()}
    (root / "conftest.py").write_text(CONFTEST.replace("{PER_FAMILY}", repr(kinds if per_family else {})))
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\ndnnsafety_seed = "1234"\n'
                                         'dnnsafety_batch_size = "64"\n')
    lines, tests = ["import pytest", ""], {}
    for family, (kind, markers) in families.items():
        data = {"dataset": "dataset", "small": "small_data", "tiny": "tiny_data", "pmi": "pmi_data",
                "boxes": "box_data"}[kind]
        model = {"tiny": "tiny_model", "boxes": "detector"}.get(kind, "model")
        if per_family:
            data = data if kind == "pmi" else f"data_{family}"
            model = model if family in MODEL_FREE else f"model_{family}"
        extra = (f", data={data!r}" if data != "dataset" else "") + (f", model={model!r}" if model != "model" else "")
        for i, marker in enumerate(markers):
            name = f"test_{family}_{i}"
            tests[name] = marker = f"{marker[:-1]}{extra})"
            lines += [f"@pytest.mark.{marker}", f"def {name}():", "    pass", ""]
    (root / "test_gates.py").write_text("\n".join(lines))
    return tests
