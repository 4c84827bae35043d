"""COCO data with crowd regions and objects of every area range: the plugin's mAP@[.5:.95], mAP@.5 and
small/medium/large mAP equal pycocotools' ``COCOeval`` ``stats`` (to 1e-9), several seeds; the same through the
min_detection_map gate's details (a pytester run on a COCO annotations file and a folder of .npy images)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random

import numpy as np
import pytest
import torch

from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.engines.detection.matching import BoxMatchEngine
from pytest_dnnsafety.files.coco import from_coco

pytest.importorskip("pycocotools")

CATEGORIES = [3, 7, 11]  # not contiguous: mapped explicitly to labels 0, 1, 2


def coco_case(seed: int, n_images: int = 40, crowd: float = 0.15) -> tuple[dict, list[dict]]:
    """An annotations dict (integer boxes of every size group, crowd regions, COCO areas a fraction of the box
    area, some on the range boundaries) and a results list (jittered copies, wrong classes, false positives, some
    inside crowd regions)."""
    rnd = random.Random(seed)
    images, anns, results = [], [], []
    for i in range(n_images):
        image_id = 1000 + 7 * i
        images.append({"id": image_id, "file_name": f"im{i:03d}.npy", "width": 640, "height": 480})
        for _ in range(rnd.randint(0, 7)):
            w, h = (max(1, int(math.exp(rnd.uniform(math.log(4), math.log(220))))) for _ in range(2))
            x, y = rnd.randint(0, 400), rnd.randint(0, 250)
            cat = rnd.choice(CATEGORIES)
            is_crowd = int(rnd.random() < crowd)
            area = float(w * h) * rnd.choice([1.0, 0.8, 0.55])
            if rnd.random() < 0.05:
                area = rnd.choice([32.0 ** 2, 96.0 ** 2])  # exactly on a range boundary: in both groups
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": cat, "bbox": [x, y, w, h],
                         "area": area, "iscrowd": is_crowd})
            copies = rnd.randint(2, 4) if is_crowd else (1 if rnd.random() < 0.8 else 0)
            for _ in range(copies):
                if is_crowd:  # detections inside the crowd region
                    dw, dh = max(1, w // rnd.randint(2, 4)), max(1, h // rnd.randint(2, 4))
                    dx, dy = x + rnd.randint(0, max(0, w - dw)), y + rnd.randint(0, max(0, h - dh))
                else:
                    j = max(1, int(0.15 * min(w, h)))
                    dx, dy = x + rnd.randint(-j, j), y + rnd.randint(-j, j)
                    dw, dh = max(1, w + rnd.randint(-j, j)), max(1, h + rnd.randint(-j, j))
                c = cat if rnd.random() < 0.85 else rnd.choice(CATEGORIES)
                results.append({"image_id": image_id, "category_id": c, "bbox": [dx, dy, dw, dh],
                                 "score": round(rnd.random(), 6)})
        for _ in range(rnd.randint(0, 3)):  # false positives of every size
            w, h = (max(1, int(math.exp(rnd.uniform(math.log(4), math.log(200))))) for _ in range(2))
            results.append({"image_id": image_id, "category_id": rnd.choice(CATEGORIES),
                            "bbox": [rnd.randint(0, 400), rnd.randint(0, 250), w, h], "score": round(rnd.random(), 6)})
    doc = {"images": images, "annotations": anns,
           "categories": [{"id": c, "name": f"class{c}"} for c in reversed(CATEGORIES)]}
    return doc, results


def pycocotools_stats(doc: dict, results: list[dict]) -> np.ndarray:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = json.loads(json.dumps(doc))
        gt.createIndex()
        dt = gt.loadRes(json.loads(json.dumps(results)))
        ev = COCOeval(gt, dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats


def write_case(tmp_path, doc: dict) -> None:
    (tmp_path / "images").mkdir()
    for i, im in enumerate(doc["images"]):
        np.save(tmp_path / "images" / im["file_name"], np.full((3, 8, 8), i, dtype=np.uint8))
    (tmp_path / "annotations.json").write_text(json.dumps(doc))


def detections(data, results: list[dict]) -> BoxSet:
    """The results as packed detections in the data's image order and label mapping."""
    row = {image_id: i for i, image_id in enumerate(data.image_ids)}
    label = {c: k for k, c in enumerate(data.category_ids)}
    results = sorted(results, key=lambda r: row[r["image_id"]])  # stable: the file's order within an image
    boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (r["bbox"] for r in results)], dtype=torch.float64)
    return BoxSet(boxes.reshape(-1, 4), torch.tensor([label[r["category_id"]] for r in results], dtype=torch.int64),
                  torch.tensor([row[r["image_id"]] for r in results], dtype=torch.int64), len(data.image_ids),
                  torch.tensor([r["score"] for r in results], dtype=torch.float64))


def plugin_stats(data, dets: BoxSet, batch: int = 7) -> list[float]:
    engine = BoxMatchEngine()
    for start in range(0, len(data), batch):
        stop = min(start + batch, len(data))
        _, targets = data.batch(start, stop)
        engine.update(dets.images(start, stop), targets, start)
    full = engine.evaluate()
    areas = engine.area_maps()
    return [full.map, full.map50, *(areas[k] for k in ("small", "medium", "large"))]


@pytest.mark.parametrize("seed", range(6))
def test_crowd_and_area_ranges_equal_pycocotools(tmp_path, seed: int) -> None:
    doc, results = coco_case(seed)
    write_case(tmp_path, doc)
    data = from_coco(tmp_path / "annotations.json", tmp_path / "images")
    assert data.category_ids == CATEGORIES
    assert bool(data.targets.crowd.any())
    ours = plugin_stats(data, detections(data, results))
    ref = pycocotools_stats(doc, results)
    expected = [ref[0], ref[1], ref[3], ref[4], ref[5]]
    for name, a, b in zip(("map", "map50", "small", "medium", "large"), ours, expected):
        if b == -1:  # COCOeval's "no objects in this range"
            assert math.isnan(a), name
        else:
            assert a == pytest.approx(b, abs=1e-9), (name, ours, expected)


def test_a_range_without_objects_is_nan_not_minus_one(tmp_path) -> None:
    doc, results = coco_case(3)
    doc["annotations"] = [a for a in doc["annotations"] if a["area"] <= 32 ** 2 or a["iscrowd"]]
    write_case(tmp_path, doc)
    data = from_coco(tmp_path / "annotations.json", tmp_path / "images")
    ours = plugin_stats(data, detections(data, results))
    ref = pycocotools_stats(doc, results)
    assert ref[5] == -1 and math.isnan(ours[4])
    assert ours[2] == pytest.approx(ref[3], abs=1e-9)


def test_max_detections_and_many_crowd_matches(tmp_path) -> None:
    """More than 100 detections of one image and class, most inside one crowd region: COCO's cap and crowd reuse."""
    doc = {"images": [{"id": 1, "file_name": "a.npy", "width": 500, "height": 500}],
           "categories": [{"id": 1, "name": "person"}],
           "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 300, 300], "area": 90000.0,
                            "iscrowd": 1},
                           {"id": 2, "image_id": 1, "category_id": 1, "bbox": [10, 10, 40, 40], "area": 1600.0,
                            "iscrowd": 0},
                           {"id": 3, "image_id": 1, "category_id": 1, "bbox": [350, 350, 20, 20], "area": 400.0,
                            "iscrowd": 0}]}
    rnd = random.Random(5)
    results = [{"image_id": 1, "category_id": 1, "bbox": [rnd.randint(0, 280), rnd.randint(0, 280), 20, 20],
                "score": round(rnd.random(), 6)} for _ in range(130)]
    results += [{"image_id": 1, "category_id": 1, "bbox": [11, 11, 40, 40], "score": 0.5},
                {"image_id": 1, "category_id": 1, "bbox": [351, 350, 20, 20], "score": 0.9}]
    write_case(tmp_path, doc)
    data = from_coco(tmp_path / "annotations.json", tmp_path / "images")
    ours = plugin_stats(data, detections(data, results))
    ref = pycocotools_stats(doc, results)
    for a, b in zip(ours, [ref[0], ref[1], ref[3], ref[4], ref[5]]):
        assert (math.isnan(a) and b == -1) or a == pytest.approx(b, abs=1e-9)


def test_ignoring_the_crowd_regions_would_change_the_values(tmp_path) -> None:
    """The crowd regions matter in these cases: without them the values differ from pycocotools' (the test above
    is sensitive to the crowd rules)."""
    doc, results = coco_case(1)
    write_case(tmp_path, doc)
    data = from_coco(tmp_path / "annotations.json", tmp_path / "images")
    t = data.targets
    data.targets = BoxSet(t.boxes, t.labels, t.image, t.n_images, None, None, t.area)  # crowd regions as objects
    ours = plugin_stats(data, detections(data, results))
    ref = pycocotools_stats(doc, results)
    assert abs(ours[0] - ref[0]) > 1e-3


# ------------------------------------------------------------------------------------- through the gate

CONFTEST = '''
import json
import pathlib

import pytest
import torch
from torch import nn


class Recorded(nn.Module):
    """Returns the detections recorded for each image (an image's pixels hold its data row)."""

    def __init__(self):
        super().__init__()
        self.rows = json.loads(pathlib.Path(__file__).with_name("dets.json").read_text())

    def forward(self, x):
        out = []
        for row in x[:, 0, 0, 0].round().long().tolist():
            d = self.rows[row]
            out.append({"boxes": torch.tensor(d["boxes"], dtype=torch.float32).reshape(-1, 4),
                        "labels": torch.tensor(d["labels"], dtype=torch.int64),
                        "scores": torch.tensor(d["scores"], dtype=torch.float32)})
        return out


@pytest.fixture(scope="session")
def model():
    return Recorded()
'''


def test_the_gate_reads_coco_data_and_reports_the_area_ranges(gate_project) -> None:
    from _digits_project import gates_of

    root = gate_project.pytester.path
    doc, results = coco_case(2, n_images=48)
    (root / "coco").mkdir()
    write_case(root / "coco", doc)
    data = from_coco(root / "coco" / "annotations.json", root / "coco" / "images")
    label = {c: k for k, c in enumerate(data.category_ids)}
    rows = [{"boxes": [], "labels": [], "scores": []} for _ in data.image_ids]
    at = {image_id: i for i, image_id in enumerate(data.image_ids)}
    for r in results:
        x, y, w, h = r["bbox"]
        row = rows[at[r["image_id"]]]
        row["boxes"].append([x, y, x + w, y + h])
        row["labels"].append(label[r["category_id"]])
        row["scores"].append(r["score"])
    (root / "dets.json").write_text(json.dumps(rows))
    gate_project.write("conftest.py", CONFTEST)
    lighting = {im["id"]: ("day", "night")[i % 2] for i, im in enumerate(doc["images"])}
    shuffled = list(reversed(doc["images"]))  # the table's rows in another order: joined on image_id
    gate_project.write("data/scenarios.csv", "lighting,image_id\n"
                       + "".join(f"{lighting[im['id']]},{im['id']}\n" for im in shuffled))
    gate_project.write("data/conditions.toml", '[conditions]\nlighting = ["day", "night"]\n')
    gate_project.ini.update({"dnnsafety_data": "coco/annotations.json", "dnnsafety_images": "coco/images",
                             "dnnsafety_batch_size": "8"})
    small = "statistic='estimate', min_images=5, bootstrap=100"
    gate_project.tests("import pytest\n\n"
                       f"@pytest.mark.min_detection_map(0.0, {small})\ndef test_all(model, dataset):\n    pass\n\n"
                       f"@pytest.mark.min_detection_map(0.0, by='lighting', {small})\n"
                       "def test_by(model, dataset):\n    pass\n\n"
                       f"@pytest.mark.min_detection_map(0.0, area='large', {small})\n"
                       "def test_large(model, dataset):\n    pass\n")
    result = gate_project.run("--dnnsafety-json=evidence.json")
    found = gates_of(gate_project)
    assert {k: g["status"] for k, g in found.items()} == {"all": "passed", "by": "passed", "large": "passed"}, \
        result.stdout.str()
    ref = pycocotools_stats(doc, results)
    row = found["all"]["details"]["map_groups"][0]
    assert row["map"] == pytest.approx(ref[0], abs=1e-9) and row["map50"] == pytest.approx(ref[1], abs=1e-9)
    assert row["coco_area_stats"] == pytest.approx(list(ref[3:6]), abs=1e-9)
    assert found["large"]["value"] == pytest.approx(ref[5], abs=1e-9)
    for group in found["by"]["details"]["map_groups"]:  # each group: pycocotools on its images only
        subset = dict(doc, images=[im for im in doc["images"] if f"lighting={lighting[im['id']]}" == group["group"]])
        keep = {im["id"] for im in subset["images"]}
        subset["annotations"] = [a for a in doc["annotations"] if a["image_id"] in keep]
        sub_ref = pycocotools_stats(subset, [r for r in results if r["image_id"] in keep])
        assert group["map"] == pytest.approx(sub_ref[0], abs=1e-9), group["group"]
        assert group["coco_area_stats"] == pytest.approx(list(sub_ref[3:6]), abs=1e-9)


def test_crowded_batches_matched_in_spans_give_the_same_values(tmp_path, monkeypatch) -> None:
    from pytest_dnnsafety.engines.detection import matching

    doc, results = coco_case(4)
    write_case(tmp_path, doc)
    data = from_coco(tmp_path / "annotations.json", tmp_path / "images")
    dets = detections(data, results)
    whole = plugin_stats(data, dets, batch=40)
    monkeypatch.setattr(matching, "MATCH_CHUNK_ELEMENTS", 200)  # every few cells a span of their own
    spans = plugin_stats(data, dets, batch=40)
    assert spans == whole


def test_bootstrap_and_recall_leave_crowd_regions_out(tmp_path) -> None:
    doc, results = coco_case(5)
    write_case(tmp_path, doc)
    data = from_coco(tmp_path / "annotations.json", tmp_path / "images")
    engine = BoxMatchEngine()
    engine.update(detections(data, results), data.targets, 0)
    res = engine.evaluate(bootstrap=200)
    assert res.lower <= res.map <= res.upper
    assert res.objects == int((~data.targets.crowd).sum())
    rec = engine.recall()
    assert rec.objects == int((~data.targets.crowd).sum())
    small = engine.evaluate(area="small", bootstrap=100)
    assert small.map == engine.area_maps()["small"] and small.lower <= small.map
    for name, value in engine.area_maps().items():  # one sorting for the three ranges: the same bits
        assert value == engine.evaluate(area=name).map or math.isnan(value)
    with pytest.raises(Exception, match="area must be one of"):
        engine.evaluate(area="tiny")
