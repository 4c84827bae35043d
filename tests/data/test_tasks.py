"""The task notion (issue #22): data formats, inference, the guard per task, and gates refusing tasks they cannot measure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pytest_dnnsafety.data.forms import as_tensors, iter_batches, known_length
from pytest_dnnsafety.engines.core.runner import Runner
from pytest_dnnsafety.errors import DataError, MarkerError, MetricError
from pytest_dnnsafety.gates import builtin_registry, evaluate, parse_marker
from pytest_dnnsafety.files.loading import load_dataset
from pytest_dnnsafety.engines.core.guard import ForwardGuard
from pytest_dnnsafety.files.provenance import fingerprint
from pytest_dnnsafety.data.boxes import box_iou
from pytest_dnnsafety.data.tasks import (
    BoxSet,
    DetectionData,
    as_boxset,
    detection_collate,
    infer_task,
    matched_scores,
)

from _hostile import make_settings

GATES = dict(builtin_registry())


def _detection_data(n: int = 5) -> DetectionData:
    x = torch.rand(n, 1, 16, 16)
    boxes = torch.tensor([[0, 0, 4, 4], [1, 1, 5, 5], [2, 2, 8, 8], [8, 8, 15, 15]], dtype=torch.float32)
    labels = torch.tensor([1, 2, 3, 1])
    offsets = torch.tensor([0, 2, 2, 3, 4, 4])[: n + 1]
    return DetectionData.from_offsets(x, boxes[: int(offsets[-1])], labels[: int(offsets[-1])], offsets)


class BlobDetector(torch.nn.Module):
    """A deterministic detector: one box per image at a fixed place, scored from the pixels."""

    def __init__(self, shift: float = 0.0, nan: bool = False) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3)
        self.shift, self.nan = shift, nan

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        h = self.conv(x).mean(dim=(1, 2, 3)).sigmoid()
        box = torch.tensor([[0.0, 0.0, 4.0, 4.0]]) + self.shift
        if self.nan:
            box = box * float("nan")
        return [{"boxes": box, "scores": h[i].reshape(1), "labels": torch.tensor([1])} for i in range(x.shape[0])]


# ------------------------------------------------------------------------------------- data


def test_detection_data_from_offsets_slices_batches_without_per_image_dicts() -> None:
    data = _detection_data()
    assert len(data) == 5 and known_length(data) == 5 and infer_task(data) == "detection"
    x0, t0 = data[0]
    assert t0["boxes"].shape == (2, 4) and t0["labels"].tolist() == [1, 2]
    assert data[1][1]["boxes"].shape == (0, 4)
    batches = list(iter_batches(data, 2))
    assert [b[1].n_images for b in batches] == [2, 2, 1]
    assert [b[1].image.tolist() for b in batches] == [[0, 0], [0, 1], []]
    joined = BoxSet.cat([b[1] for b in batches])
    assert torch.equal(joined.boxes, data.targets.boxes) and torch.equal(joined.image, data.targets.image)
    assert joined.offsets().tolist() == [0, 2, 2, 3, 4, 4]


def test_a_dataloader_of_image_target_pairs_is_packed_by_detection_collate() -> None:
    data = _detection_data()
    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=detection_collate)
    assert infer_task(loader) == "detection"
    got = [y.image.tolist() for _, y in iter_batches(loader, 99)]
    assert got == [[0, 0], [0, 1], []]
    # torchvision's own collate (tuples of images and of dicts) is packed too
    tv = torch.utils.data.DataLoader(data, batch_size=3, collate_fn=lambda items: tuple(zip(*items)))
    (x, y), *_ = list(iter_batches(tv, 99))
    assert x.shape == (3, 1, 16, 16) and isinstance(y, BoxSet) and y.image.tolist() == [0, 0, 2]


@pytest.mark.parametrize("change, problem", [
    ({"boxes": np.zeros((4, 3))}, r"expected \(M, 4\)"),
    ({"offsets": np.array([0, 2, 1, 3, 4, 4])}, "offsets must rise"),
    ({"offsets": np.array([0, 2, 4])}, r"offsets must be N \+ 1"),
    ({"labels": np.array([1.0, 2.0, 3.0, 1.0])}, "labels must be"),
    ({"boxes": np.array([[0, 0, 4, 4], [5, 1, 1, 5], [2, 2, 8, 8], [8, 8, 15, 15]], dtype=np.float32)}, "x2 < x1"),
    ({"boxes": np.array([[0, 0, 4, np.nan], [1, 1, 5, 5], [2, 2, 8, 8], [8, 8, 15, 15]], dtype=np.float32)}, "NaN"),
    ({"labels": np.array([1, -2, 3, 1])}, "negative"),
])
def test_bad_detection_files_are_refused_naming_the_problem(tmp_path: Path, change: dict[str, Any],
                                                            problem: str) -> None:
    arrays = {"x": np.random.rand(5, 1, 16, 16).astype(np.float32),
              "boxes": np.array([[0, 0, 4, 4], [1, 1, 5, 5], [2, 2, 8, 8], [8, 8, 15, 15]], dtype=np.float32),
              "labels": np.array([1, 2, 3, 1]), "offsets": np.array([0, 2, 2, 3, 4, 4])}
    arrays.update(change)
    np.savez(tmp_path / "det.npz", **arrays)
    with pytest.raises(DataError, match=problem):
        load_dataset(make_settings(tmp_path, data="det.npz"))


def test_detection_and_multilabel_files_load_safely(tmp_path: Path) -> None:
    np.savez(tmp_path / "det.npz", x=np.random.rand(5, 1, 16, 16).astype(np.float32),
             boxes=np.array([[0, 0, 4, 4]], dtype=np.float32), labels=np.array([3]), offsets=np.array([0, 0, 1, 1, 1, 1]))
    data = load_dataset(make_settings(tmp_path, data="det.npz"))
    assert isinstance(data, DetectionData) and data.targets.image.tolist() == [1]
    record = fingerprint(data)
    assert record["digest"] and "boxes" in record.get("what", "") + str(record)
    np.savez(tmp_path / "det2.npz", x=np.random.rand(5, 1, 16, 16).astype(np.float32), boxes=np.zeros((0, 4)))
    with pytest.raises(DataError, match="offsets"):
        load_dataset(make_settings(tmp_path, data="det2.npz"))
    np.savez(tmp_path / "ml.npz", x=np.random.rand(6, 3).astype(np.float32), y=np.eye(3, dtype=np.uint8)[[0, 1, 2, 0, 1, 2]])
    ml = load_dataset(make_settings(tmp_path, data="ml.npz"))
    assert infer_task(ml) == "multi-label" and ml.tensors[1].shape == (6, 3)
    np.savez(tmp_path / "ml_bad.npz", x=np.random.rand(2, 3).astype(np.float32), y=np.array([[0, 2, 1], [1, 0, 0]]))
    with pytest.raises(DataError, match="0 or 1"):
        load_dataset(make_settings(tmp_path, data="ml_bad.npz"))


def test_infer_task() -> None:
    x = torch.rand(4, 3)
    assert infer_task(torch.utils.data.TensorDataset(x, torch.tensor([0, 1, 2, 0]))) == "single-label"
    assert infer_task(torch.utils.data.TensorDataset(x, torch.eye(3)[[0, 1, 2, 0]].long())) == "multi-label"
    assert infer_task(torch.utils.data.TensorDataset(x)) is None
    assert infer_task({"x": x, "y": torch.zeros(4, 3)}) == "multi-label"
    assert infer_task((x, [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0)}] * 4)) == "detection"
    assert infer_task(x) is None


# ------------------------------------------------------------------------------------- runner and guard


def test_runner_moves_packed_targets_and_flags_bad_target_boxes() -> None:
    x = torch.rand(3, 1, 8, 8)
    good = BoxSet(torch.tensor([[0.0, 0, 2, 2]]), torch.tensor([0]), torch.tensor([1]), 3)
    bad = BoxSet(torch.tensor([[3.0, 0, 2, 2]]), torch.tensor([0]), torch.tensor([1]), 3)
    seen: list[BoxSet] = []
    Runner("pass").run_local(DetectionData(x, good), lambda batch: seen.append(batch.y))
    assert isinstance(seen[0], BoxSet) and seen[0].image.tolist() == [1]
    with pytest.raises(DataError, match="target boxes.*batch 1"):
        Runner("pass", batch_size=1).run_local(DetectionData(x, bad), lambda batch: None)
    with pytest.raises(DataError, match="must be 0 or 1"):
        Runner("pass").run_local((x, torch.tensor([[0, 1], [1, 2], [0, 0]])), lambda batch: None)


def test_guard_per_task() -> None:
    x = torch.rand(4, 1, 8, 8)
    detector = BlobDetector().eval()
    guard = ForwardGuard("det", task="detection", num_classes=3)
    out = guard(detector, x)
    assert isinstance(out, BoxSet) and out.n_images == 4 and out.scores is not None
    guard.check()
    with pytest.raises(MetricError, match="returned detections.*object detector.*task='detection'"):
        ForwardGuard("classifier gate")(detector, x)
    with pytest.raises(MetricError, match="not detections; the task is 'detection'"):
        ForwardGuard("det", task="detection")(torch.nn.Flatten(), x)
    nan = ForwardGuard("det", task="detection")
    nan(BlobDetector(nan=True).eval(), x)
    with pytest.raises(MetricError, match="NaN/inf, have x2 < x1"):
        nan.check()
    few = ForwardGuard("det", task="detection", num_classes=1)  # label 1 is outside one class
    few(detector, x)
    with pytest.raises(MetricError, match="outside the 1 classes"):
        few.check()

    class Noisy(BlobDetector):
        def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
            out = super().forward(x)
            for item in out:
                item["scores"] = torch.rand(1)
            return out

    with pytest.raises(MetricError, match="not deterministic"):
        ForwardGuard("det", task="detection")(Noisy().eval(), x)


def test_box_iou_and_matched_scores_against_brute_force() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(7, 2, generator=gen) * 10
    a = torch.cat([a, a + torch.rand(7, 2, generator=gen) * 5], dim=1)
    b = torch.rand(5, 2, generator=gen) * 10
    b = torch.cat([b, b + torch.rand(5, 2, generator=gen) * 5], dim=1)
    iou = box_iou(a, b)
    al, bl = a.tolist(), b.tolist()
    area = lambda r: (r[2] - r[0]) * (r[3] - r[1])  # noqa: E731
    for i in range(7):
        for j in range(5):
            w = max(0.0, min(al[i][2], bl[j][2]) - max(al[i][0], bl[j][0]))
            h = max(0.0, min(al[i][3], bl[j][3]) - max(al[i][1], bl[j][1]))
            assert float(iou[i, j]) == pytest.approx(w * h / (area(al[i]) + area(bl[j]) - w * h), rel=1e-6)
    dets = BoxSet(a, torch.tensor([0, 1, 0, 1, 0, 1, 0]), torch.tensor([0, 0, 0, 1, 1, 1, 1]), 2,
                  torch.linspace(0.1, 0.7, 7))
    targets = BoxSet(b, torch.tensor([0, 1, 0, 1, 0]), torch.tensor([0, 0, 1, 1, 1]), 2)
    got = matched_scores(dets, targets, iou=0.1)
    for j in range(5):
        ok = [float(dets.scores[i]) for i in range(7) if int(dets.image[i]) == int(targets.image[j])
              and int(dets.labels[i]) == int(targets.labels[j]) and float(iou[i, j]) >= 0.1]
        assert float(got[j]) == pytest.approx(max(ok, default=0.0))


def test_as_boxset_refuses_malformed_detections() -> None:
    with pytest.raises(DataError, match="2 dicts of boxes for 3 images"):
        as_boxset([{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0)}] * 2, 3, "t")
    with pytest.raises(DataError, match="has no 'scores'"):
        as_boxset([{"boxes": torch.zeros(1, 4), "labels": torch.zeros(1)}], 1, "t", scores=True)
    with pytest.raises(DataError, match="1 boxes but labels of shape"):
        as_boxset([{"boxes": torch.zeros(1, 4), "labels": torch.zeros(2, dtype=torch.long)}], 1, "t")


def test_as_tensors_returns_packed_targets_for_detection_data() -> None:
    x, y = as_tensors(_detection_data())
    assert x.shape == (5, 1, 16, 16) and isinstance(y, BoxSet) and len(y) == 4


# ------------------------------------------------------------------------------------- gates and tasks


_CANDIDATES = ("conv", 0.1, 2, ["lighting"], "msp")


def _minimal_options(marker: str) -> dict[str, Any]:
    """A valid value for every required keyword of the gate (the first candidate its Param accepts)."""
    from pytest_dnnsafety.gates import REQUIRED

    return {p.name: next(v for v in _CANDIDATES if p.validate(v) is None)
            for p in GATES[marker].params if p.default is REQUIRED}


@pytest.mark.parametrize("task", ["detection", "multi-label"])
def test_every_gate_that_cannot_measure_a_task_refuses_it_naming_the_task_and_the_fix(tmp_path: Path,
                                                                                      task: str) -> None:
    """A gate given data of a task it does not support errors before measuring — never a pass."""
    data: Any = (_detection_data() if task == "detection"
                 else torch.utils.data.TensorDataset(torch.rand(6, 1, 16, 16), torch.eye(3)[[0, 1, 2, 0, 1, 2]].long()))
    settings = make_settings(tmp_path)
    refused = []
    for marker, gate in GATES.items():
        if task in gate.tasks:
            continue
        lo, hi = gate.threshold_range
        threshold = lo if gate.op == ">=" else hi
        spec = parse_marker(marker, (threshold if np.isfinite(threshold) else 0.0,), _minimal_options(marker),
                            "t.py::test", GATES)
        fixtures = {role: (data if role == "data" else object()) for role in spec.fixtures}
        result = evaluate(spec, fixtures, settings, "t.py::test", {})
        assert result.status == "error", (marker, result.summary)
        assert f"task {task!r} inferred from the data's labels" in result.summary, result.summary
        assert "Fix:" in result.summary and "dnnsafety_task" in result.summary
        refused.append(marker)
    assert refused, "some gate must refuse the task"


def test_the_task_setting_wins_over_inference_and_the_marker_keyword_over_the_setting(tmp_path: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.rand(6, 3), torch.tensor([0, 1, 2, 0, 1, 2]))
    spec = parse_marker("max_pmi_ub", (0.1,), {}, "t.py::test", GATES)
    result = evaluate(spec, {"data": data, "model": object(), "profile": object()},
                      make_settings(tmp_path, task="detection"), "t.py::test", {})
    assert result.status == "error" and "task 'detection' set by" in result.summary
    with pytest.raises(MarkerError, match="argument task: max_pmi_ub does not support task 'detection'"):
        parse_marker("max_pmi_ub", (0.1,), {"task": "detection"}, "t.py::test", GATES)
    with pytest.raises(MarkerError, match="argument task"):
        parse_marker("max_pmi_ub", (0.1,), {"task": "segmentation"}, "t.py::test", GATES)


def test_neuron_and_scene_coverage_gates_measure_a_detector(tmp_path: Path) -> None:
    from pytest_dnnsafety.scenarios import Conditions, ScenarioTable

    data = _detection_data()
    model = BlobDetector().eval()
    spec = parse_marker("min_neuron_k_activation", (0.1,), {"layer": "conv", "k": 1}, "t.py::test", GATES)
    result = evaluate(spec, {"model": model, "data": data}, make_settings(tmp_path), "t.py::test", {})
    assert result.status in ("passed", "failed") and result.value is not None, result.summary
    assert result.value == pytest.approx(0.5, abs=0.5)
    table = ScenarioTable(Conditions({"lighting": ["day", "night"]}),
                          [{"lighting": v} for v in ["day", "night", "day", "night", "day"]])
    spec = parse_marker("min_scene_coverage", (1.0,), {"k": 1, "data": "dataset"}, "t.py::test", GATES)
    result = evaluate(spec, {"scenarios": table, "data": data}, make_settings(tmp_path), "t.py::test", {})
    assert result.status == "passed", result.summary


def test_the_runner_checks_the_labels_form_of_its_task() -> None:
    x = torch.rand(3, 2)
    multi = (x, torch.tensor([[0, 1], [1, 0], [1, 1]]))
    with pytest.raises(DataError, match=r"labels of shape \(3, 2\) for 3 inputs; the task is 'single-label'"):
        Runner("pass", task="single-label").run_local(multi, lambda batch: None)
    with pytest.raises(DataError, match="the task is 'multi-label', which needs a \\(n, classes\\) 0/1 matrix"):
        Runner("pass", task="multi-label").run_local((x, torch.tensor([0, 1, 1])), lambda batch: None)
    with pytest.raises(DataError, match="boxes per image for 5 inputs; the task is 'single-label'"):
        Runner("pass", task="single-label").run_local(_detection_data(), lambda batch: None)
    Runner("pass", task="multi-label").run_local(multi, lambda batch: None)
    Runner("pass", task="detection").run_local(_detection_data(), lambda batch: None)


def test_a_resampling_bound_is_labelled_an_estimate_in_every_report(tmp_path: Path) -> None:
    from pytest_dnnsafety.gates import GateDef, GateRegistry
    from pytest_dnnsafety.results import ESTIMATE_SUFFIX, Measurement

    gate = GateDef(marker="min_boot", metric="bootstrap F1", op=">=", threshold_range=(0.0, 1.0), params=(),
                   fixtures={}, doc="t", tasks=("multi-label",),
                   measure=lambda spec, fx, ctx: Measurement(value=0.9, bound=0.8,
                                                             details={"bound_kind": "estimate"}))
    registry = GateRegistry()
    registry.add(gate)
    spec = parse_marker("min_boot", (0.5,), {"task": "multi-label"}, "t.py::test", registry)
    result = evaluate(spec, {}, make_settings(tmp_path), "t.py::test", {})
    assert result.status == "passed" and "(bound) (estimate)" in result.summary
    assert result.metric.endswith(ESTIMATE_SUFFIX) and result.label == "min_boot (estimate)"
    assert result.details["task"] == "multi-label"


def test_by_takes_one_condition_name_as_a_string_in_every_grouping_gate() -> None:
    from pytest_dnnsafety.scenarios.groups import by_names as _by_names

    for marker in ("min_scenario_accuracy", "max_scenario_degradation", "min_detection_map", "min_detection_recall"):
        spec = parse_marker(marker, (0.5,), {"by": "lighting"}, "t.py::test", GATES)
        assert spec.options["by"] == "lighting"
    assert _by_names({"by": "lighting"}) == ["lighting"] and _by_names({"by": ("a", "b")}) == ["a", "b"]


def test_detection_data_from_a_pt_dict_of_tensors(tmp_path: Path) -> None:
    torch.save({"x": torch.rand(3, 1, 8, 8), "boxes": torch.tensor([[0.0, 0, 4, 4], [1, 1, 3, 3]]),
                "labels": torch.tensor([2, 0]), "offsets": torch.tensor([0, 1, 1, 2])}, tmp_path / "det.pt")
    data = load_dataset(make_settings(tmp_path, data="det.pt"))
    assert isinstance(data, DetectionData) and data.targets.image.tolist() == [0, 2]
    torch.save({"x": torch.rand(3, 1, 8, 8), "boxes": torch.zeros(1, 4)}, tmp_path / "bad.pt")
    with pytest.raises(DataError, match=r"\['labels', 'offsets'\] missing"):
        load_dataset(make_settings(tmp_path, data="bad.pt"))
