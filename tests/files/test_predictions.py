"""Recorded predictions (issue #32, item 2): a file of outputs stands in for the model in the output-only gates.

Checked against the model run it replaces: the shared pass's outputs (decision, confidence, raw scores, a
detector's packed detections) from recorded logits and from a COCO results file equal those of the model (no
forward pass), subsamples and shards follow their rows, gates read the same values; and every malformed file is a
DataError naming the problem: a row count other than the data's (both counts named), NaN rows, an image id or a
category id the data do not hold, a score outside [0, 1], detection data without COCO ids unless ``ids='rows'``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _blob_detector import BlobDetector, blob_data

from pytest_dnnsafety.data.tasks import DetectionData
from pytest_dnnsafety.engines.core.capture import ActivationCache
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.files.predictions import RecordedPredictions
from pytest_dnnsafety.gates import evaluate, parse_marker
from pytest_dnnsafety.runtime.torchrun import Shard
from pytest_dnnsafety.settings import Settings

N = 60


def _classifier() -> torch.nn.Module:
    """A 4-class linear model reading the first 4 of 16 features (plus a little of the others)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        net[1].weight.mul_(0.1)[:, :4] += torch.eye(4)
    return net.eval()


@pytest.fixture(scope="module")
def classified(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    y = torch.arange(N) % 4
    x = 0.6 * torch.randn(N, 1, 4, 4, generator=gen)
    x.view(N, 16)[torch.arange(N), y] += 1.0
    net = _classifier()
    with torch.no_grad():
        logits = net(x)
    root = tmp_path_factory.mktemp("recorded")
    np.save(root / "logits.npy", logits.numpy())
    return net, torch.utils.data.TensorDataset(x, y), root, logits


def _settings() -> Settings:
    return Settings(cli={}, ini=lambda name: "", env={})


def test_recorded_logits_are_the_model_runs_outputs_without_a_forward_pass(classified) -> None:
    net, data, root, _ = classified
    recorded = RecordedPredictions.from_file(root / "logits.npy", data)
    assert recorded.sha256 == "sha256:" + hashlib.sha256((root / "logits.npy").read_bytes()).hexdigest()
    cache = ActivationCache()
    got = cache.outputs(recorded, data, batch_size=16, device="cpu")
    assert cache.forward_passes == 0
    ran = cache.outputs(net, data, batch_size=16, device="cpu")
    assert torch.equal(got.predictions, ran.predictions) and torch.equal(got.labels, ran.labels)
    torch.testing.assert_close(got.confidence, ran.confidence, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.logits, ran.logits, rtol=0, atol=1e-6)
    assert got.num_classes == ran.num_classes == 4
    # a torchrun shard: its rows only
    shard = Shard(rank=1, world_size=2, batches=(2, 4), rows=(32, N), n_rows=N)
    part = cache.outputs(recorded, data, batch_size=16, device="cpu", shard=shard)
    assert torch.equal(part.predictions, ran.predictions[32:]) and torch.equal(part.labels, ran.labels[32:])
    # layers: a file of outputs has none
    with pytest.raises(ConfigError, match="recorded predictions only"):
        cache.get(recorded, data, ["1"], batch_size=16, device="cpu")


def test_predicted_class_indices_and_npz_keys(classified, tmp_path: Path) -> None:
    _, data, _, logits = classified
    np.save(tmp_path / "labels.npy", logits.argmax(1).numpy())
    got = ActivationCache().outputs(RecordedPredictions.from_file(tmp_path / "labels.npy", data), data,
                                    batch_size=16, device="cpu")
    assert torch.equal(got.predictions, logits.argmax(1)) and got.logits is None
    np.savez(tmp_path / "keyed.npz", logits=logits.numpy(), other=np.zeros(3))
    assert torch.equal(RecordedPredictions.from_file(tmp_path / "keyed.npz", data).rows, logits)
    np.savez(tmp_path / "unclear.npz", a=logits.numpy(), b=logits.numpy())
    with pytest.raises(DataError, match=r"which one holds the predictions.*logits, scores"):
        RecordedPredictions.from_file(tmp_path / "unclear.npz", data)


class _WithImageIds(torch.utils.data.TensorDataset):
    """A classification set whose samples carry ids (COCO image ids, say): rows are joined on them."""

    image_ids = [500 + 7 * i for i in range(N)]


def test_rows_saved_with_their_ids_are_joined_to_the_data_not_trusted_in_order(classified, tmp_path: Path) -> None:
    """A shuffled file of logits with an ``ids`` array gives the in-order rows (by row index, or by the data's image
    ids); without ids the order is trusted and the evidence says so; bad ids are errors naming them."""
    _, data, root, logits = classified
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    np.savez(tmp_path / "shuffled.npz", logits=logits[perm].numpy(), ids=perm.numpy())
    joined = RecordedPredictions.from_file(tmp_path / "shuffled.npz", data)
    assert torch.equal(joined.rows, logits) and joined.to_details()["aligned_by"] == "ids"
    assert RecordedPredictions.from_file(root / "logits.npy", data).to_details()["aligned_by"] == "row order"
    by_image = _WithImageIds(*data.tensors)
    np.savez(tmp_path / "by_image.npz", scores=logits[perm].numpy(),
             image_ids=np.asarray(_WithImageIds.image_ids)[perm.numpy()])
    assert torch.equal(RecordedPredictions.from_file(tmp_path / "by_image.npz", by_image).rows, logits)
    twice = perm.clone()
    twice[0] = twice[1]
    np.savez(tmp_path / "twice.npz", logits=logits.numpy(), ids=twice.numpy())
    with pytest.raises(DataError, match=rf"ids given twice: {int(perm[1])}; samples without a row \(by row index\): "
                                        rf"{int(perm[0])}\. Fix"):
        RecordedPredictions.from_file(tmp_path / "twice.npz", data)
    np.savez(tmp_path / "foreign.npz", logits=logits.numpy(), ids=np.arange(N) + 1)
    with pytest.raises(DataError, match=rf"ids that are no row index of the data: {N}; samples without a row \(by "
                                        r"row index\): 0"):
        RecordedPredictions.from_file(tmp_path / "foreign.npz", data)
    with pytest.raises(DataError, match=r"ids that are no COCO image id of the data: 0, 1, 2, 3, 4, \.\.\."):
        RecordedPredictions.from_file(tmp_path / "shuffled.npz", by_image)
    np.savez(tmp_path / "float_ids.npz", logits=logits.numpy(), ids=np.arange(N, dtype=np.float32))
    with pytest.raises(DataError, match=r"ids is a float32 array of shape \(60,\); the rows' ids are one integer"):
        RecordedPredictions.from_file(tmp_path / "float_ids.npz", data)
    np.savez(tmp_path / "both.npz", logits=logits.numpy(), ids=np.arange(N), image_ids=np.arange(N))
    with pytest.raises(DataError, match="holds both ids and image_ids"):
        RecordedPredictions.from_file(tmp_path / "both.npz", data)


def test_a_wrong_row_count_names_both_counts(classified, tmp_path: Path) -> None:
    _, data, _, logits = classified
    np.save(tmp_path / "short.npy", logits[:-1].numpy())
    with pytest.raises(DataError, match=rf"holds {N - 1} rows but the evaluation data hold {N} samples"):
        RecordedPredictions.from_file(tmp_path / "short.npy", data)


@pytest.mark.parametrize("bad", ["nan", "inf", "1d-float", "3d"])
def test_nan_rows_and_wrong_shapes_are_refused(classified, tmp_path: Path, bad: str) -> None:
    _, data, _, logits = classified
    array = logits.numpy().copy()
    if bad == "nan":
        array[[3, 7], 1] = np.nan
    elif bad == "inf":
        array[5, 0] = np.inf
    elif bad == "1d-float":
        array = array[:, 0]
    else:
        array = array[:, :, None]
    np.save(tmp_path / "bad.npy", array)
    match = {"nan": r"2 of 60 rows hold NaN/inf \(rows 3, 7\)", "inf": r"rows 5\)",
             "1d-float": r"shape \(60,\)", "3d": r"shape \(60, 4, 1\)"}[bad]
    with pytest.raises(DataError, match=match):
        RecordedPredictions.from_file(tmp_path / "bad.npy", data)


def test_the_gates_read_the_recorded_values_and_refuse_what_needs_the_model(classified) -> None:
    net, data, root, _ = classified
    recorded = RecordedPredictions.from_file(root / "logits.npy", data)
    spec = parse_marker("max_weighted_confusion", (1e9,), {"severity": {"1": {"2": 5.0}, "0": {"3": 1.0}},
                                                           "gate_on": "value"}, "t.py::test")
    ran = evaluate(spec, {"model": net, "data": data}, _settings(), "t.py::test", {})
    read = evaluate(spec, {"model": recorded, "data": data}, _settings(), "t.py::test", {})
    assert read.status == ran.status == "passed", read.summary
    assert read.value == pytest.approx(ran.value, abs=1e-12) and read.bound == pytest.approx(ran.bound, abs=1e-12)
    assert read.details["outputs_from"] == f"recorded predictions {root / 'logits.npy'} {recorded.sha256}; the model " \
                                           "was not run"
    assert read.details["recorded_predictions"]["model_run"] is False and "outputs_from" not in ran.details
    # with sample=: the subsample's rows of the recorded predictions
    sampled = parse_marker("max_weighted_confusion", (1e9,), {"severity": {"1": {"2": 5.0}}, "gate_on": "value",
                                                              "sample": 25}, "t.py::test")
    a = evaluate(sampled, {"model": net, "data": data}, _settings(), "t.py::test", {})
    b = evaluate(sampled, {"model": recorded, "data": data}, _settings(), "t.py::test", {})
    assert b.status == "passed" and b.value == pytest.approx(a.value, abs=1e-12)
    assert b.details["sample"] == a.details["sample"]
    # a gate that needs the model: refused by name, naming the file and the fix
    attack = parse_marker("max_adversarial_confidence_loss", (1.0,), {"eps": 0.05, "families": ["fgsm"]}, "t.py::test")
    refused = evaluate(attack, {"model": recorded, "data": data}, _settings(), "t.py::test", {})
    assert refused.status == "error" and refused.details["error_type"] == "ConfigError"
    assert "max_adversarial_confidence_loss" in refused.summary and str(root / "logits.npy") in refused.summary
    assert "dnnsafety_model" in refused.summary
    # given with the model: that gate runs the model and says so
    both = RecordedPredictions.from_file(root / "logits.npy", data, model=net)
    run = evaluate(attack, {"model": both, "data": data}, _settings(), "t.py::test", {})
    assert run.status in ("passed", "failed", "inconclusive"), run.summary
    assert run.details["outputs_from"] == "model run"
    # an output-only gate on other data than the recorded one: refused (no model), the model run (with one)
    other = torch.utils.data.TensorDataset(*data.tensors)
    assert evaluate(spec, {"model": recorded, "data": other}, _settings(), "t.py::test", {}).status == "error"
    assert evaluate(spec, {"model": both, "data": other}, _settings(), "t.py::test",
                    {}).details["outputs_from"] == "model run"


def test_no_signal_reads_the_recorded_outputs(classified, tmp_path: Path) -> None:
    """A collapsed recording (one class for every row) is no signal: the relative gate is inconclusive, with no
    model to run at all — the precondition read the recorded rows."""
    _, data, _, _ = classified
    np.save(tmp_path / "collapsed.npy", np.tile(np.array([[5.0, 0.0, 0.0, 0.0]], dtype=np.float32), (N, 1)))
    recorded = RecordedPredictions.from_file(tmp_path / "collapsed.npy", data)
    spec = parse_marker("max_weighted_confusion", (1e9,), {"severity": {"1": {"2": 5.0}}, "gate_on": "value"},
                        "t.py::test")
    result = evaluate(spec, {"model": recorded, "data": data}, _settings(), "t.py::test", {})
    assert result.status == "inconclusive" and "no_signal" in result.details, result.summary


# ------------------------------------------------------------------------------------- detections


def _blobs(n: int = 16, ids: bool = True) -> DetectionData:
    d = blob_data(n, 0)
    data = DetectionData.from_offsets(d["x"], d["boxes"], d["labels"], d["offsets"])
    if ids:
        data.image_ids = [1000 + 3 * i for i in range(n)]
        data.category_ids = [7]
    return data


def _coco_results(model: Any, data: DetectionData, image_id: Any, category_id: Any) -> list[dict[str, Any]]:
    with torch.no_grad():
        found = model(data.x)
    out = []
    for i, det in enumerate(found):
        for box, score, label in zip(det["boxes"].tolist(), det["scores"].tolist(), det["labels"].tolist()):
            out.append({"image_id": image_id(i), "category_id": category_id(label),
                        "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]], "score": score})
    return out


def test_coco_results_are_the_detectors_outputs(tmp_path: Path) -> None:
    data, model = _blobs(), BlobDetector(score="clean_background")
    results = _coco_results(model, data, lambda i: data.image_ids[i], lambda k: data.category_ids[k])
    results.reverse()  # the file's order is free: joined on image ids
    (tmp_path / "results.json").write_text(json.dumps(results))
    recorded = RecordedPredictions.from_file(tmp_path / "results.json", data)
    cache = ActivationCache()
    got = cache.outputs(recorded, data, batch_size=8, device="cpu")
    assert cache.forward_passes == 0
    ran = cache.outputs(model, data, batch_size=8, device="cpu")
    assert torch.equal(got.detections.image, ran.detections.image)
    torch.testing.assert_close(got.detections.boxes.float(), ran.detections.boxes.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.detections.scores.float(), ran.detections.scores.float(), rtol=0, atol=1e-7)
    assert torch.equal(got.predictions, ran.predictions) and got.num_classes == 1
    torch.testing.assert_close(got.confidence, ran.confidence, rtol=0, atol=1e-7)
    spec = parse_marker("min_detection_map", (0.0,), {"iou": "0.5", "min_images": 10}, "t.py::test")
    a = evaluate(spec, {"model": model, "data": data}, _settings(), "t.py::test", {})
    b = evaluate(spec, {"model": recorded, "data": data}, _settings(), "t.py::test", {})
    assert a.status == b.status == "passed", b.summary
    assert b.value == pytest.approx(a.value, abs=1e-9) and b.bound == pytest.approx(a.bound, abs=1e-9)
    assert "the model was not run" in b.details["outputs_from"]


def test_coco_results_with_an_unknown_image_or_category_id_are_refused(tmp_path: Path) -> None:
    data, model = _blobs(), BlobDetector()
    good = _coco_results(model, data, lambda i: data.image_ids[i], lambda k: data.category_ids[k])
    for name, change, match in [
            ("image", {"image_id": 999_999}, r"\[2\]\.image_id 999999 is not one of the data's image ids"),
            ("category", {"category_id": 8}, r"\[2\]\.category_id 8 is not the data's category ids \[7\]"),
            ("score", {"score": 1.5}, r"\[2\]\.score 1.5 is not a probability"),
            ("bbox", {"bbox": [1, 2, -3, 4]}, r"\[2\]\.bbox")]:
        results = [dict(r) for r in good]
        results[2].update(change)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(results))
        with pytest.raises(DataError, match=match):
            RecordedPredictions.from_file(path, data)


def test_detection_data_without_coco_ids_needs_ids_rows(tmp_path: Path) -> None:
    data, model = _blobs(ids=False), BlobDetector()
    (tmp_path / "rows.json").write_text(json.dumps(_coco_results(model, data, lambda i: i, lambda k: k)))
    with pytest.raises(DataError, match=r"carry no COCO image ids.*ids='rows'"):
        RecordedPredictions.from_file(tmp_path / "rows.json", data)
    recorded = RecordedPredictions.from_file(tmp_path / "rows.json", data, ids="rows")
    got = ActivationCache().outputs(recorded, data, batch_size=8, device="cpu")
    ran = ActivationCache().outputs(model, data, batch_size=8, device="cpu")
    assert torch.equal(got.predictions, ran.predictions)
    (tmp_path / "past.json").write_text(json.dumps([{"image_id": 16, "category_id": 0, "bbox": [0, 0, 1, 1],
                                                     "score": 0.5}]))
    with pytest.raises(DataError, match=r"image_id 16 is not one of the data's rows 0..15"):
        RecordedPredictions.from_file(tmp_path / "past.json", data, ids="rows")


def test_a_results_file_that_is_not_a_list_or_not_json(tmp_path: Path) -> None:
    data = _blobs()
    (tmp_path / "dict.json").write_text(json.dumps({"annotations": []}))
    with pytest.raises(DataError, match="a JSON list of detections"):
        RecordedPredictions.from_file(tmp_path / "dict.json", data)
    (tmp_path / "nan.json").write_text('[{"image_id": 1000, "category_id": 7, "bbox": [0, 0, 1, 1], "score": NaN}]')
    with pytest.raises(DataError, match="NaN is not a JSON number"):
        RecordedPredictions.from_file(tmp_path / "nan.json", data)
    (tmp_path / "deep.json").write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(DataError, match="nested more than"):
        RecordedPredictions.from_file(tmp_path / "deep.json", data)
    with pytest.raises(DataError, match="does not exist"):
        RecordedPredictions.from_file(tmp_path / "missing.json", data)
    with pytest.raises(DataError, match="not a predictions format"):
        RecordedPredictions.from_file(tmp_path / "p.csv", data)


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".json"])
def test_the_fingerprint_is_of_the_bytes_parsed_and_the_read_is_bounded(classified, tmp_path: Path, monkeypatch,
                                                                         suffix: str) -> None:
    """The file is read once: its sha256 is of the bytes the rows came from; a file over the read budget is refused
    from its size, before reading."""
    from pytest_dnnsafety.files import parsing

    net, data, root, logits = classified
    if suffix == ".json":
        data, path = _blobs(), tmp_path / "r.json"
        path.write_text(json.dumps([{"image_id": 1000, "category_id": 7, "bbox": [0, 0, 2, 2], "score": 0.5}]))
    elif suffix == ".npz":
        path = tmp_path / "r.npz"
        np.savez_compressed(path, logits=logits.numpy())
    else:
        path = root / "logits.npy"
    recorded = RecordedPredictions.from_file(path, data)
    assert recorded.sha256 == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setattr(parsing, "data_budget", lambda: 20)
    with pytest.raises(DataError, match=r"more than the read budget of 20 bytes.*refused before reading"):
        RecordedPredictions.from_file(path, data)
