"""COCO annotations read safely (files/coco.py): the schema checks name the field and the fix, hostile files
(NaN, huge, wrong types, file names escaping the images folder) are DataErrors, categories map explicitly to
labels, boxes become x1, y1, x2, y2, images are read lazily (only the rows a batch asks for), and a scenario
table keyed by image_id / file_name is reordered to the data's order."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pytest_dnnsafety.data.tasks import DetectionData
from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.files import coco, parsing
from pytest_dnnsafety.files.coco import from_coco, read_annotations


def doc(n: int = 4) -> dict:
    d = {"images": [{"id": 10 + i, "file_name": f"{i}.npy", "width": 8, "height": 6} for i in range(n)],
            "categories": [{"id": 9, "name": "car"}, {"id": 2, "name": "person"}],
            "annotations": [{"id": 1, "image_id": 12, "category_id": 9, "bbox": [1, 2, 3, 4], "area": 10.0,
                             "iscrowd": 0},
                            {"id": 2, "image_id": 10, "category_id": 2, "bbox": [0.5, 0, 2, 2], "area": 4,
                             "iscrowd": 1},
                            {"id": 3, "image_id": 12, "category_id": 2, "bbox": [0, 0, 1, 1], "area": 1}]}
    d["annotations"] = [a for a in d["annotations"] if a["image_id"] < 10 + n]
    return d


def write(tmp_path, d: dict, images: bool = True, text: str | None = None):
    (tmp_path / "ann.json").write_text(json.dumps(d) if text is None else text)
    if images:
        (tmp_path / "img").mkdir(exist_ok=True)
        for i, im in enumerate(d["images"]):
            np.save(tmp_path / "img" / im["file_name"], np.full((3, 6, 8), i, dtype=np.float32))
    return tmp_path / "ann.json"


def test_categories_map_explicitly_and_boxes_become_corners(tmp_path) -> None:
    data = from_coco(write(tmp_path, doc()), tmp_path / "img")
    assert isinstance(data, DetectionData) and len(data) == 4
    assert data.category_ids == [2, 9] and data.category_names == ["person", "car"]
    assert data.image_ids == [10, 11, 12, 13] and data.file_names == ["0.npy", "1.npy", "2.npy", "3.npy"]
    t = data.targets
    assert t.image.tolist() == [0, 2, 2]  # by image, the file's order within one
    assert t.labels.tolist() == [0, 1, 0]
    assert t.boxes.tolist() == [[0.5, 0, 2.5, 2], [1, 2, 4, 6], [0, 0, 1, 1]]
    assert t.crowd.tolist() == [True, False, False] and t.area.tolist() == [4.0, 10.0, 1.0]
    x, targets = data.batch(1, 3)
    assert x.shape == (2, 3, 6, 8) and x[:, 0, 0, 0].tolist() == [1, 2]
    assert targets.n_images == 2 and targets.image.tolist() == [1, 1] and targets.crowd.tolist() == [False, False]
    image, target = data[0]
    assert target["iscrowd"].tolist() == [True] and target["area"].tolist() == [4.0]
    assert data.digest.startswith("sha256:")


def test_images_are_read_only_when_asked(tmp_path, monkeypatch) -> None:
    data = from_coco(write(tmp_path, doc(6)), tmp_path / "img")
    reads = []
    real = coco._read_array
    monkeypatch.setattr(coco, "_read_array", lambda path, *a: reads.append(path.name) or real(path, *a))
    assert reads == []  # building it read image 0 once (its shape); nothing since
    data.batch(2, 4)
    assert reads == ["2.npy", "3.npy"]
    data[5]
    assert reads[-1] == "5.npy"
    assert not any(isinstance(v, torch.Tensor) and v.ndim == 4 for v in vars(data).values())  # no images held
    sub = data.rows([1, 4])
    assert reads[-1] == "5.npy" and sub.image_ids == [11, 14] and len(sub) == 2  # a subsample stays lazy
    assert sub.batch(0, 2)[0][:, 0, 0, 0].tolist() == [1, 4]


@pytest.mark.parametrize("change, field", [
    (lambda d: d["annotations"][0].update(bbox=[1, 2, "3", 4]), "annotations[0].bbox"),
    (lambda d: d["annotations"][0].update(bbox=[1, 2, -3, 4]), "annotations[0].bbox"),
    (lambda d: d["annotations"][0].update(bbox=[1, 2, 3]), "annotations[0].bbox"),
    (lambda d: d["annotations"][1].update(iscrowd=2), "annotations[1].iscrowd"),
    (lambda d: d["annotations"][1].pop("area"), "annotations[1].area"),
    (lambda d: d["annotations"][0].update(image_id=99), "annotations[0].image_id"),
    (lambda d: d["annotations"][0].update(category_id=5), "annotations[0].category_id"),
    (lambda d: d["annotations"][2].update(id=1), "annotations[2].id"),
    (lambda d: d["images"][1].update(id=10), "images[1].id"),
    (lambda d: d["images"][1].update(id="11"), "images[1].id"),
    (lambda d: d["images"][1].update(width=0), "images[1].width"),
    (lambda d: d["images"][1].update(file_name=""), "images[1].file_name"),
    (lambda d: d["images"][1].update(file_name="0.npy"), "images[1].file_name"),
    (lambda d: d["categories"][1].update(id=9), "categories[1].id"),
    (lambda d: d["categories"][1].pop("name"), "categories[1].name"),
    (lambda d: d.update(images={}), "images must be a list"),
    (lambda d: d.update(annotations=[3]), "annotations[0] must be an object"),
])
def test_schema_errors_name_the_field(tmp_path, change, field: str) -> None:
    d = doc()
    change(d)
    with pytest.raises(DataError, match="Fix:") as err:
        read_annotations(write(tmp_path, d, images=False))
    assert field in str(err.value)


@pytest.mark.parametrize("text, words", [
    ('{"images": [{"id": 1, "file_name": "a.npy", "width": NaN, "height": 2}]}', "NaN"),
    ('{"images": [], "annotations": [{"bbox": [Infinity, 0, 1, 1]}]}', "Infinity"),
    ("[" * 5000 + "]" * 5000, "nested"),
    ("{not json", "not valid JSON"),
    ('["a list"]', "must be an object"),
    ('{"images": [], "annotations": [], "categories": []}', "no images"),
    (b"\xff\xfe".decode("latin-1"), "not valid JSON"),
])
def test_hostile_json_is_a_data_error(tmp_path, text: str, words: str) -> None:
    with pytest.raises(DataError, match=words):
        read_annotations(write(tmp_path, doc(), images=False, text=text))


def test_a_file_above_the_budget_is_refused_before_reading(tmp_path, monkeypatch) -> None:
    path = write(tmp_path, doc(), images=False)
    monkeypatch.setattr(parsing, "data_budget", lambda: 100)
    with pytest.raises(DataError, match="read budget"):
        read_annotations(path)


@pytest.mark.parametrize("name", ["../escape.npy", "/etc/passwd", "sub/../../x.npy", "a\\..\\b.npy", "lnk/x.npy"])
def test_file_names_cannot_leave_the_images_folder(tmp_path, name: str) -> None:
    d = doc(1)
    d["annotations"] = []
    d["images"][0]["file_name"] = name
    path = write(tmp_path, d, images=False)
    (tmp_path / "img").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    np.save(outside / "x.npy", np.zeros((3, 6, 8), dtype=np.float32))
    os.symlink(outside, tmp_path / "img" / "lnk")
    with pytest.raises(DataError, match="images folder"):
        from_coco(path, tmp_path / "img")


def test_images_of_different_shapes_and_missing_files(tmp_path) -> None:
    path = write(tmp_path, doc(3))
    np.save(tmp_path / "img" / "2.npy", np.zeros((3, 7, 8), dtype=np.float32))
    data = from_coco(path, tmp_path / "img")
    with pytest.raises(DataError, match="one shape"):
        data.batch(0, 3)
    (tmp_path / "img" / "1.npy").unlink()
    with pytest.raises(DataError, match="not in the images folder"):
        data.batch(1, 2)
    np.save(tmp_path / "img" / "1.npy", np.array([object()], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="1.npy"):
        data.batch(1, 2)


def test_png_images_through_pillow(tmp_path) -> None:
    image = pytest.importorskip("PIL.Image")
    d = doc(2)
    for i, im in enumerate(d["images"]):
        im["file_name"] = f"{i}.png"
    path = write(tmp_path, d, images=False)
    (tmp_path / "img").mkdir()
    for i in range(2):
        image.fromarray(np.full((6, 8, 3), 51 * i, dtype=np.uint8)).save(tmp_path / "img" / f"{i}.png")
    x, _ = from_coco(path, tmp_path / "img").batch(0, 2)
    assert x.shape == (2, 3, 6, 8) and x.dtype == torch.float32
    assert x[:, 0, 0, 0].tolist() == pytest.approx([0.0, 0.2])
    d["images"][1]["width"] = 9  # the file disagrees with its images[] entry
    with pytest.raises(DataError, match="width 9"):
        from_coco(write(tmp_path, d, images=False), tmp_path / "img").batch(0, 2)


def test_without_pillow_the_error_names_the_install(tmp_path, monkeypatch) -> None:
    d = doc(1)
    d["images"][0]["file_name"] = "a.jpg"
    path = write(tmp_path, d, images=False)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.jpg").write_bytes(b"not read")
    real = coco.importlib.util.find_spec
    monkeypatch.setattr(coco.importlib.util, "find_spec", lambda name: None if name == "PIL" else real(name))
    with pytest.raises(DataError, match="pip install pillow"):
        from_coco(path, tmp_path / "img")


def test_the_scenario_table_is_joined_on_image_ids_or_file_names(tmp_path) -> None:
    from pytest_dnnsafety.scenarios import Conditions, ScenarioTable

    data = from_coco(write(tmp_path, doc()), tmp_path / "img")
    conditions = Conditions({"light": ["day", "night"]})
    (tmp_path / "s.csv").write_text("image_id,light\n13,night\n10,day\n12,night\n11,day\n")
    table = ScenarioTable.from_csv(tmp_path / "s.csv", conditions).aligned_to(data)
    assert [r["light"] for r in table.rows()] == ["day", "day", "night", "night"]
    assert table._lines == (3, 5, 4, 2)
    (tmp_path / "f.csv").write_text("light,file_name\nnight,3.npy\nday,1.npy\nday,0.npy\nnight,2.npy\n")
    table = ScenarioTable.from_csv(tmp_path / "f.csv", conditions).aligned_to(data)
    assert [r["light"] for r in table.rows()] == ["day", "day", "night", "night"]
    (tmp_path / "m.csv").write_text("image_id,light\n13,night\n10,day\n99,night\n11,day\n")
    with pytest.raises(DataError, match=r"no row for image_id 12.*rows for image_id 99"):
        ScenarioTable.from_csv(tmp_path / "m.csv", conditions).aligned_to(data)
    (tmp_path / "d.csv").write_text("image_id,light\n13,night\n13,day\n12,night\n11,day\n")
    with pytest.raises(DataError, match="appears twice"):
        ScenarioTable.from_csv(tmp_path / "d.csv", conditions).aligned_to(data)
    plain = ScenarioTable.from_csv(tmp_path / "s.csv", conditions)
    assert plain.aligned_to(torch.zeros(4, 3)) is plain  # not COCO data: rows by position
