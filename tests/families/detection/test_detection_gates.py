"""The detection quality gates end to end: a pytester project with a detection .npz, a scenario table and a detector.

The images encode their own objects (row j of an image: box j's corners / 100, its class / 10, a
presence flag; the last column the scene's brightness), so a "detector" that reads them back with a
pixel of jitter finds every object — except the night-blind one, which returns nothing on dark
images. The good detector passes, the night-blind one fails naming ``lighting=night``, a classifier
is an error naming the task, and bad marker arguments are collection errors naming the argument.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _digits_project import gates_of
from conftest import GateProject

LIGHT = {"day": 1.0, "dusk": 0.7, "night": 0.3}
N = 60  # 20 images per lighting value; every tenth image (camera "b") holds no object

CONFTEST = '''
import pathlib

import pytest
import torch
from torch import nn

ROWS = {False: 0, True: 0}  # images forwarded, by night_blind


def pytest_sessionfinish(session):
    pathlib.Path("rows.txt").write_text(f"{ROWS[False]} {ROWS[True]}")


class Reader(nn.Module):
    """Reads the boxes an image encodes; ``night_blind`` returns nothing on dark images."""

    def __init__(self, night_blind=False):
        super().__init__()
        self.night_blind = night_blind

    def forward(self, x):
        ROWS[self.night_blind] += x.shape[0]
        out = []
        for image in x[:, 0]:
            rows = image[image[:, 5] > 0.5]
            boxes = rows[:, :4] * 100 + torch.tensor([1.0, 0.0, 1.0, 1.0])
            labels = (rows[:, 4] * 10).round().long()
            scores = torch.full((rows.shape[0],), 0.9)
            clutter = torch.tensor([[0.0, 0.0, 3.0, 3.0]])  # one low-scored false positive per image
            boxes, labels = torch.cat([boxes, clutter]), torch.cat([labels, torch.tensor([0])])
            scores = torch.cat([scores, torch.tensor([0.1])])
            if self.night_blind and float(image[0, 7]) < 0.5:
                boxes, labels, scores = boxes[:0], labels[:0], scores[:0]
            out.append({"boxes": boxes, "labels": labels, "scores": scores})
        return out


class Classifier(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :10]


@pytest.fixture(scope="session")
def model():
    return Reader()


@pytest.fixture(scope="session")
def night_blind():
    return Reader(night_blind=True)


@pytest.fixture(scope="session")
def classifier():
    return Classifier()
'''


def _write_files(root: Path) -> None:
    rng = np.random.default_rng(7)
    lighting = [list(LIGHT)[i % 3] for i in range(N)]
    x = np.zeros((N, 1, 4, 8), dtype=np.float32)
    boxes, labels, offsets = [], [], [0]
    for i in range(N):
        n = 0 if i % 10 == 9 else int(rng.integers(1, 4))  # camera "b" images hold no object
        for j in range(n):
            x1, y1 = rng.integers(0, 50, size=2)
            w, h = rng.integers(15, 40, size=2)
            box = [x1, y1, x1 + w, y1 + h]
            label = int(rng.integers(0, 3))
            boxes.append(box)
            labels.append(label)
            x[i, 0, j, :4] = np.asarray(box) / 100
            x[i, 0, j, 4] = label / 10
            x[i, 0, j, 5] = 1.0
        x[i, 0, :, 7] = LIGHT[lighting[i]]
        offsets.append(offsets[-1] + n)
    (root / "data").mkdir(exist_ok=True)
    np.savez(root / "data" / "eval.npz", x=x, boxes=np.asarray(boxes, dtype=np.float32),
             labels=np.asarray(labels, dtype=np.int64), offsets=np.asarray(offsets, dtype=np.int64))
    rows = [f"{lighting[i]},{'b' if i % 10 == 9 else 'a'}" for i in range(N)]
    (root / "data" / "scenarios.csv").write_text("lighting,camera\n" + "\n".join(rows) + "\n")
    (root / "data" / "conditions.toml").write_text('[conditions]\nlighting = ["day", "dusk", "night"]\n'
                                                   'camera = ["a", "b"]\n')


def _project(gate_project: GateProject, gates: dict[str, tuple[str, str]]) -> GateProject:
    _write_files(gate_project.pytester.path)
    gate_project.ini.update({"dnnsafety_data": "data/eval.npz", "dnnsafety_batch_size": "16"})
    gate_project.write("conftest.py", CONFTEST)
    lines = ["import pytest", ""]
    for name, (marker, fixture) in gates.items():
        lines += [f"@pytest.mark.{marker}", f"def test_{name}({fixture}, dataset):", "    pass", ""]
    gate_project.tests("\n".join(lines))
    return gate_project


SMALL = "min_images=15, bootstrap=200"


def test_good_detector_passes_and_night_blind_fails_naming_night(gate_project: GateProject) -> None:
    gates = {
        "map_good": (f'min_detection_map(0.5, by="lighting", {SMALL})', "model"),
        "recall_good": (f'min_detection_recall(0.8, by="lighting", {SMALL})', "model"),
        "map50_good": (f'min_detection_map(0.8, iou="0.5", {SMALL})', "model"),
        "map_blind": (f'min_detection_map(0.5, by="lighting", model="night_blind", {SMALL})', "night_blind"),
        "recall_blind": (f'min_detection_recall(0.5, by=["lighting"], model="night_blind", {SMALL})', "night_blind"),
        "estimate_blind": (f'min_detection_map(0.5, by="lighting", model="night_blind", statistic="estimate", '
                           f'{SMALL})', "night_blind"),
    }
    project = _project(gate_project, gates)
    result = project.run("--dnnsafety-json=evidence.json")
    found = gates_of(project)
    status = {name: g["status"] for name, g in found.items()}
    assert status == {"map_good": "passed", "recall_good": "passed", "map50_good": "passed",
                      "map_blind": "failed", "recall_blind": "failed", "estimate_blind": "failed"}, \
        result.stdout.str()
    good = found["map_good"]
    assert good["bound"] is not None and good["bound"] <= good["value"]
    rows = good["details"]["map_groups"]
    assert [r["group"] for r in rows] == ["lighting=day", "lighting=dusk", "lighting=night"]
    assert all(r["images"] == 20 and r["lower"] <= r["map"] <= r["upper"] for r in rows)
    blind = found["map_blind"]
    assert "lighting=night" in blind["summary"] and blind["details"]["worst_group"] == "lighting=night"
    assert blind["value"] == 0.0
    assert "lighting=night" in found["recall_blind"]["summary"]
    estimate = found["estimate_blind"]
    assert estimate["bound"] is None and "statistic='estimate'" in estimate["summary"]
    assert found["map50_good"]["details"]["map_groups"][0]["group"] == "all"
    # one matching pass per model serves its mAP and recall gates (plus the guard's determinism probe)
    good_rows, blind_rows = map(int, (project.pytester.path / "rows.txt").read_text().split())
    assert N <= good_rows < 2 * N and N <= blind_rows < 2 * N


def test_a_classifier_is_an_error_naming_the_task_and_small_groups_are_not_assessed(
        gate_project: GateProject) -> None:
    gates = {"cls": (f'min_detection_map(0.5, model="classifier", {SMALL})', "classifier"),
             "no_objects": ('min_detection_map(0.1, by="camera", min_images=5, bootstrap=100)', "model"),
             "no_objects_recall": ('min_detection_recall(0.1, by="camera", per_class=False, min_images=5, '
                                   'bootstrap=100)', "model"),
             "strict": ('min_detection_map(0.1, by="lighting", min_images=25, bootstrap=100)', "model"),
             "allowed": ('min_detection_map(0.1, by="lighting", min_images=20, bootstrap=100)', "model")}
    project = _project(gate_project, gates)
    project.run("--dnnsafety-json=evidence.json")
    found = gates_of(project)
    gate = found["cls"]
    assert gate["status"] == "error"
    assert "detection" in gate["details"]["error"] and "not detections" in gate["details"]["error"]
    assert found["strict"]["status"] == "error"  # no group has min_images images: nothing measured, never a pass
    assert "nothing to assess" in found["strict"]["details"]["error"]
    assert found["allowed"]["status"] == "passed"
    for name in ("no_objects", "no_objects_recall"):  # camera=b has images but no object: undefined, never a pass
        assert found[name]["status"] == "inconclusive", found[name]
        assert "camera=b" in found[name]["summary"] and "no ground-truth object" in found[name]["summary"]
    assert found["no_objects_recall"]["details"]["worst_class"] == "all classes"


BAD_MARKERS = [
    ("min_detection_map(0.5, iou='0.3:0.9')", "argument iou*"),
    ("min_detection_map(0.5, bootstrap=5)", "argument bootstrap*outside*"),
    ("min_detection_map(0.5, statistic='median')", "argument statistic*'median' is not one of*"),
    ("min_detection_recall(0.5, method='bootstrap')", "argument method*'bootstrap' is not one of*"),
    ("min_detection_map(0.5, by='')", "argument by*"),
    ("min_detection_map(0.5, confidence=1.0)", "argument confidence*strictly between*"),
    ("min_detection_recall(0.5, score_threshold=2.0)", "argument score_threshold*outside*"),
    ("min_detection_recall(0.5, iou=0.0)", "argument iou*outside*"),
    ("min_detection_map(1.5)", "argument threshold*outside*"),
]


def test_bad_marker_arguments_are_collection_errors(gate_project: GateProject) -> None:
    for n, (marker, _expected) in enumerate(BAD_MARKERS):  # one module each: one run reports every error
        gate_project.tests(f"import pytest\n\n@pytest.mark.{marker}\ndef test_x(model, dataset):\n    pass\n",
                           name=f"test_bad_{n}.py")
    result = gate_project.run()
    assert result.ret != 0
    for marker, expected in BAD_MARKERS:
        result.stdout.fnmatch_lines([f"*@pytest.mark.{marker.split('(')[0]}: {expected}Fix: *"])


@pytest.mark.slow
def test_xdist_gives_the_serial_numbers(gate_project: GateProject) -> None:
    """Under ``-n 2`` each worker measures its own gates: the same statuses, values and bounds as one process."""
    gates = {f"{kind}_{i}": (f'min_detection_{kind}(0.5, by="lighting", {SMALL})', "model")
             for i in range(2) for kind in ("map", "recall")}
    project = _project(gate_project, gates)
    project.run("--dnnsafety-json=evidence.json", subprocess=True)
    serial = {name: (g["status"], g["value"], g["bound"]) for name, g in gates_of(project).items()}
    project.run("--dnnsafety-json=evidence.json", "-n", "2", subprocess=True)
    parallel = {name: (g["status"], g["value"], g["bound"]) for name, g in gates_of(project).items()}
    assert len(serial) == 4 and parallel == serial


def test_too_many_by_groups_are_refused_before_the_forward_pass(tmp_path: Path) -> None:
    """Issue #29 §3: three conditions of 100 values make 10^6 groups; the gate is an error naming by= and the cap,
    and the detector never runs (the check comes before the shared pass, as the performance gate's does)."""
    import torch

    from pytest_dnnsafety import Conditions, DetectionData, ScenarioTable
    from pytest_dnnsafety.data.tasks import BoxSet
    from pytest_dnnsafety.gates import evaluate, parse_marker
    from pytest_dnnsafety.settings import SETTINGS, Settings

    class Untouchable(torch.nn.Module):
        def forward(self, x):  # pragma: no cover - must not run
            raise AssertionError("the detector ran")

    n = 4
    values = [str(i) for i in range(100)]
    table = ScenarioTable(Conditions({"a": values, "b": values, "c": values}),
                          [{"a": "0", "b": "0", "c": "0"}] * n)
    data = DetectionData(torch.rand(n, 3, 8, 8), BoxSet(torch.tensor([[1.0, 1.0, 5.0, 5.0]] * n),
                                                         torch.zeros(n, dtype=torch.int64), torch.arange(n), n))
    settings = Settings(cli={}, ini={SETTINGS["device"].ini: "cpu"}.get, env={}, ini_file=tmp_path / "pyproject.toml",
                        invocation_dir=tmp_path)
    spec = parse_marker("min_detection_map", (0.5,), {"by": ["a", "b", "c"]}, "t.py::t")
    result = evaluate(spec, {"model": Untouchable(), "data": data, "scenarios": table}, settings, "t.py::t", {})
    assert result.status == "error", result.summary
    error = result.details["error"]
    assert "by=['a', 'b', 'c'] gives 1,000,000 groups" in error and "Fix:" in error, error
    assert "the detector ran" not in error
