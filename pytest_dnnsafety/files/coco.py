"""COCO-format detection data: an annotations JSON read safely, its images read lazily from a folder.

:func:`from_coco` (``dnnsafety_data = "annotations.json"`` with ``dnnsafety_images``) gives a
:class:`CocoDetectionData`, a :class:`~pytest_dnnsafety.data.tasks.DetectionData` whose images are read only
when a batch asks for them (streamed, never all held):

* **the JSON** is read whole after its size is checked against the read budget
  (:func:`~pytest_dnnsafety.files.parsing.read_json_file`; its sha256 is of the bytes parsed), refusing ``NaN`` and
  ``Infinity`` (not JSON) and nesting deeper than :data:`~pytest_dnnsafety.files.parsing.MAX_DEPTH`, then checked
  field by field: ``images[]`` ``id``, ``file_name``, ``width``, ``height``; ``categories[]`` ``id``, ``name``;
  ``annotations[]`` ``image_id`` and ``category_id`` (known ones), ``bbox`` ``[x, y, w, h]`` finite with
  ``w, h ≥ 0``, ``area`` (COCO's, which sorts objects into the small/medium/large ranges) and ``iscrowd`` 0/1
  (missing: 0, as pycocotools reads it); duplicate ids are refused. Every error names the field and the fix.
* **categories** are mapped explicitly: label ``i`` is ``category_ids[i]``, the categories sorted by id
  (a detector's ``labels`` must use these indices); boxes become ``x1, y1, x2, y2`` (``x + w``, as pycocotools
  computes them) in float64; image ``i`` of the data is ``images[i]`` of the file (``image_ids``,
  ``file_names``), its objects in the file's order.
* **images** are read from the images folder by ``file_name``, which must stay inside it (no absolute path, no
  ``..``, no symbolic link out): ``.npy`` (read without unpickling, the array as stored, e.g. ``(C, H, W)``)
  with no extra dependency, PNG/JPEG through Pillow (``pip install pillow``; ``(3, H, W)`` float32 in
  ``[0, 1]``, its pixel count bounded by :data:`MAX_IMAGE_PIXELS` before decoding). All images must have one
  shape to be batched.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from pytest_dnnsafety.data.tasks import BoxSet, DetectionData
from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.files.arrays import TooLarge, read_npy
from pytest_dnnsafety.files.parsing import NotRegularFile, data_budget, open_regular, read_json_file

__all__ = ["MAX_IMAGE_PIXELS", "CocoAnnotations", "CocoDetectionData", "from_coco", "read_annotations"]

#: The most pixels one PNG/JPEG image may declare (Pillow's ``Image.MAX_IMAGE_PIXELS`` during the read too).
MAX_IMAGE_PIXELS = 1 << 27
_PIL_SUFFIXES = (".png", ".jpg", ".jpeg")
_SHOWN = 5  # problems named in one error


@dataclass(frozen=True)
class CocoAnnotations:
    """A checked COCO annotations file: images in the file's order, categories sorted by id (label ``i`` is
    ``category_ids[i]``), objects packed per image (:class:`~pytest_dnnsafety.data.tasks.BoxSet` with ``crowd`` and
    ``area``)."""

    path: str
    digest: str
    image_ids: list[int]
    file_names: list[str]
    sizes: list[tuple[int, int]]  # (height, width) per image
    category_ids: list[int]
    category_names: list[str]
    targets: BoxSet


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Problems:
    """The schema problems found, named by field (``annotations[3].bbox``), raised together as one DataError."""

    def __init__(self, what: str, path: Path) -> None:
        self.what, self.path, self.items = what, path, []

    def add(self, field: str, problem: str) -> None:
        self.items.append(f"{field} {problem}")

    def raise_any(self, fix: str) -> None:
        if self.items:
            shown = "; ".join(self.items[:_SHOWN]) + (f"; … ({len(self.items)} problems)"
                                                        if len(self.items) > _SHOWN else "")
            raise DataError(f"{self.what}: the COCO annotations {self.path}: {shown}. Fix: {fix}.")


def _records(doc: dict[str, Any], key: str, p: _Problems, required: bool = True) -> list[dict[str, Any]]:
    items = doc.get(key, None if required else [])
    if not isinstance(items, list):
        p.add(key, f"must be a list of objects, got {type(items).__name__}")
        return []
    good = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            good.append(item)
        else:
            p.add(f"{key}[{i}]", f"must be an object, got {type(item).__name__}")
    return good


def read_annotations(path: str | os.PathLike[str], what: str = "detection data") -> CocoAnnotations:
    """The checked annotations of a COCO JSON file (see the module docstring); DataError naming every problem."""
    path = Path(path)
    doc, digest = read_json_file(path, what, "split the annotations into smaller files or evaluate a subset.")
    p = _Problems(what, path)
    if not isinstance(doc, dict):
        p.add("the document", f"must be an object with images, annotations and categories, got {type(doc).__name__}")
        p.raise_any("give a COCO annotations file (instances_*.json layout)")
    images, cats = _records(doc, "images", p), _records(doc, "categories", p)
    anns = _records(doc, "annotations", p)
    image_row: dict[int, int] = {}
    names: dict[str, int] = {}
    for i, im in enumerate(images):
        if not _is_int(im.get("id")):
            p.add(f"images[{i}].id", f"must be an integer, got {im.get('id')!r}")
        elif im["id"] in image_row:
            p.add(f"images[{i}].id", f"{im['id']} repeats images[{image_row[im['id']]}].id")
        else:
            image_row[im["id"]] = i
        name = im.get("file_name")
        if not isinstance(name, str) or not name:
            p.add(f"images[{i}].file_name", f"must be a non-empty string, got {name!r}")
        elif name in names:
            p.add(f"images[{i}].file_name", f"{name!r} repeats images[{names[name]}].file_name")
        else:
            names[name] = i
        for key in ("width", "height"):
            if not _is_int(im.get(key)) or im[key] <= 0:
                p.add(f"images[{i}].{key}", f"must be a positive integer, got {im.get(key)!r}")
    cat_index: dict[int, int] = {}
    for i, c in enumerate(cats):
        if not _is_int(c.get("id")):
            p.add(f"categories[{i}].id", f"must be an integer, got {c.get('id')!r}")
        elif c["id"] in cat_index:
            p.add(f"categories[{i}].id", f"{c['id']} repeats categories[{cat_index[c['id']]}].id")
        else:
            cat_index[c["id"]] = i
        if not isinstance(c.get("name"), str):
            p.add(f"categories[{i}].name", f"must be a string, got {c.get('name')!r}")
    p.raise_any("give images[] objects with an integer id, a file_name and positive width and height, and "
                "categories[] objects with an integer id and a name, each id once")
    if not images:
        raise DataError(f"{what}: the COCO annotations {path} list no images. Fix: give the evaluation images.")
    order = sorted(cat_index)
    label_of = {cid: k for k, cid in enumerate(order)}
    rows, labels, boxes, areas, crowd = [], [], [], [], []
    ann_ids: dict[Any, int] = {}
    for i, a in enumerate(anns):
        if "id" in a:
            if not _is_int(a["id"]):
                p.add(f"annotations[{i}].id", f"must be an integer, got {a['id']!r}")
            elif a["id"] in ann_ids:
                p.add(f"annotations[{i}].id", f"{a['id']} repeats annotations[{ann_ids[a['id']]}].id")
            else:
                ann_ids[a["id"]] = i
        image_id, cat = a.get("image_id"), a.get("category_id")
        ok = True
        if not _is_int(image_id) or image_id not in image_row:
            p.add(f"annotations[{i}].image_id", f"{image_id!r} is not the id of any images[] entry")
            ok = False
        if not _is_int(cat) or cat not in cat_index:
            p.add(f"annotations[{i}].category_id", f"{cat!r} is not the id of any categories[] entry")
            ok = False
        bbox = a.get("bbox")
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(_is_number(v) for v in bbox)):
            p.add(f"annotations[{i}].bbox", f"must be [x, y, width, height], four finite numbers, got {bbox!r}")
            ok = False
        elif bbox[2] < 0 or bbox[3] < 0:
            p.add(f"annotations[{i}].bbox", f"has a negative width or height: {bbox!r}")
            ok = False
        area = a.get("area")
        if not _is_number(area) or area < 0:
            p.add(f"annotations[{i}].area", f"must be a finite number ≥ 0 (COCO's object area), got {area!r}")
            ok = False
        flag = a.get("iscrowd", 0)
        if flag not in (0, 1) or isinstance(flag, float) and not flag.is_integer():
            p.add(f"annotations[{i}].iscrowd", f"must be 0 or 1, got {flag!r}")
            ok = False
        if ok:
            x, y, w, h = (float(v) for v in bbox)
            rows.append(image_row[image_id])
            labels.append(label_of[cat])
            boxes.append((x, y, x + w, y + h))
            areas.append(float(area))
            crowd.append(bool(flag))
    p.raise_any("give each annotation an image_id and category_id listed in images[] and categories[], a bbox "
                "[x, y, width, height] of finite numbers with width, height ≥ 0, its area and iscrowd 0 or 1")
    n = len(images)
    row = torch.tensor(rows, dtype=torch.int64)
    perm = torch.sort(row, stable=True).indices  # by image, the file's order within one
    box_t = torch.tensor(boxes, dtype=torch.float64).reshape(-1, 4)[perm]
    targets = BoxSet(box_t, torch.tensor(labels, dtype=torch.int64)[perm], row[perm], n,
                     crowd=torch.tensor(crowd, dtype=torch.bool)[perm],
                     area=torch.tensor(areas, dtype=torch.float64)[perm])
    return CocoAnnotations(path=str(path), digest=digest, image_ids=[im["id"] for im in images],
                           file_names=[im["file_name"] for im in images],
                           sizes=[(im["height"], im["width"]) for im in images], category_ids=order,
                           category_names=[cats[cat_index[c]]["name"] for c in order], targets=targets)


def _inside(folder: Path, name: str, field: str, what: str) -> Path:
    """``folder / name`` when it stays inside ``folder`` (symbolic links resolved), else a DataError."""
    pure = Path(name)
    if "\x00" in name or pure.is_absolute() or ".." in pure.parts or name.startswith(("/", "\\")) or "\\" in name:
        raise DataError(f"{what}: {field} {name!r} leaves the images folder (an absolute path, '..' or a "
                        "backslash). Fix: give file names relative to the images folder, inside it.")
    target = (folder / pure).resolve()
    if not target.is_relative_to(folder.resolve()):
        raise DataError(f"{what}: {field} {name!r} resolves to {target}, outside the images folder {folder} (a "
                        "symbolic link out of it). Fix: copy the image into the folder.")
    return target


class CocoDetectionData(DetectionData):
    """COCO detection data (:func:`from_coco`): targets held, images read only when :meth:`batch` or an item asks
    for them (one at a time, shape checked). It works wherever :class:`~pytest_dnnsafety.data.tasks.DetectionData`
    does; ``x`` (for the few gates that take the whole data at once) reads and stacks every image each time.

    ``image_ids``, ``file_names`` (data row ``i`` is ``images[i]`` of the file), ``category_ids`` (label ``i`` is
    category ``category_ids[i]``), ``category_names``, ``annotations`` (the file) and ``digest`` (its sha256).
    """

    lazy = True

    def __init__(self, ann: CocoAnnotations, folder: Path, what: str = "detection data") -> None:
        self.targets, self.folder, self.what = ann.targets, folder, what
        self.image_ids, self.file_names = ann.image_ids, ann.file_names
        self.category_ids, self.category_names = ann.category_ids, ann.category_names
        self.annotations, self.digest, self._sizes = ann.path, ann.digest, ann.sizes
        self._paths = [_inside(folder, name, f"images[{i}].file_name", what) for i, name in enumerate(ann.file_names)]
        self.shape: tuple[int, ...] | None = None
        self.shape = tuple(self.image(0).shape)

    @classmethod
    def from_coco(cls, annotations: str | os.PathLike[str], images: str | os.PathLike[str] | None = None,
                  what: str = "detection data") -> "CocoDetectionData":
        """COCO detection data from an annotations JSON and its images folder (:func:`from_coco`). The reader
        lives here, in ``files/``: :class:`~pytest_dnnsafety.data.tasks.DetectionData`, its base, is in ``data/``,
        the layer under the file readers, so it cannot read a file itself."""
        return from_coco(annotations, images, what)

    @property
    def x(self) -> Tensor:  # type: ignore[override]
        return self.batch(0, len(self))[0]

    def __len__(self) -> int:
        return int(self.targets.n_images)

    def image(self, index: int) -> Tensor:
        """Image ``index``, read from its file now (its shape checked against the first image's)."""
        path, name = self._paths[index], self.file_names[index]
        try:
            img = _read_pil(path, self._sizes[index], name, self.what) if path.suffix.lower() in _PIL_SUFFIXES \
                else _read_array(path, name, self.what)
        except FileNotFoundError:
            raise DataError(f"{self.what}: image {name!r} (images[{index}], id {self.image_ids[index]}) is not in "
                            f"the images folder {self.folder}. Fix: set dnnsafety_images (images=) to the folder "
                            "that holds the files.") from None
        if self.shape is not None and tuple(img.shape) != self.shape:
            raise DataError(f"{self.what}: image {name!r} (id {self.image_ids[index]}) has shape {tuple(img.shape)} "
                            f"but {self.file_names[0]!r} has {self.shape}; images are batched, so all need one "
                            "shape. Fix: resize or pad the images to one size.")
        return img

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"image {index} of {n}")
        index %= n
        return self.image(index), self._target(index)

    def rows(self, indices: Sequence[int]) -> "CocoDetectionData":
        """The data restricted to rows ``indices`` (``sample=``), still lazy: nothing is read."""
        out = object.__new__(CocoDetectionData)
        out.__dict__.update(self.__dict__)
        pick = [int(i) for i in indices]
        out.targets = BoxSet.cat([self.targets.images(i, i + 1) for i in pick])
        out.image_ids, out.file_names = [self.image_ids[i] for i in pick], [self.file_names[i] for i in pick]
        out._paths, out._sizes = [self._paths[i] for i in pick], [self._sizes[i] for i in pick]
        return out

    def batch(self, start: int, stop: int) -> tuple[Tensor, BoxSet]:
        stop = min(stop, len(self))
        images = [self.image(i) for i in range(start, stop)]
        x = torch.stack(images) if images else torch.zeros(0, *(self.shape or ()))
        return x, self.targets.images(start, stop)


def _read_array(path: Path, name: str, what: str) -> Tensor:
    if path.suffix.lower() != ".npy":
        raise DataError(f"{what}: image {name!r}: {path.suffix or 'no suffix'} is not an image format read here. "
                        "Fix: save images as .npy arrays (no extra dependency) or PNG/JPEG (with Pillow).")
    try:
        with open_regular(path) as f:
            array = read_npy(f, name, os.fstat(f.fileno()).st_size, data_budget())
    except NotRegularFile as exc:
        raise DataError(f"{what}: image {name!r}: {exc}") from None
    except TooLarge as exc:
        raise DataError(f"{what}: image {name!r}: {exc}") from None
    except FileNotFoundError:
        raise
    except Exception as exc:  # NotValid, Refused: a damaged or object array
        raise DataError(f"{what}: image {name!r} cannot be read: {exc}. Fix: save it with numpy.save.") from None
    return torch.from_numpy(array.copy() if not array.flags.writeable else array)


def _read_pil(path: Path, size: tuple[int, int], name: str, what: str) -> Tensor:
    if importlib.util.find_spec("PIL") is None:
        raise DataError(f"{what}: image {name!r} is {path.suffix[1:].upper()}, read with Pillow, which is not "
                        "installed. Fix: pip install pillow, or save the images as .npy arrays.")
    import numpy as np
    from PIL import Image

    height, width = size
    try:
        with open_regular(path) as f:
            with Image.open(f) as img:  # reads the header only
                w, h = img.size
                if w * h > MAX_IMAGE_PIXELS:
                    raise DataError(f"{what}: image {name!r} declares {w} × {h} pixels, more than "
                                    f"{MAX_IMAGE_PIXELS:,}; refused before decoding. Fix: downscale it.")
                if (h, w) != (height, width):
                    raise DataError(f"{what}: image {name!r} is {w} × {h} pixels but its images[] entry says "
                                    f"width {width}, height {height}. Fix: correct the annotations.")
                old, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, MAX_IMAGE_PIXELS
                try:
                    array = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
                finally:
                    Image.MAX_IMAGE_PIXELS = old
    except (DataError, FileNotFoundError):
        raise
    except NotRegularFile as exc:
        raise DataError(f"{what}: image {name!r}: {exc}") from None
    except Exception as exc:  # a damaged image, a decompression bomb
        raise DataError(f"{what}: image {name!r} cannot be read ({type(exc).__name__}: {exc}).") from None
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))


def from_coco(annotations: str | os.PathLike[str], images: str | os.PathLike[str] | None = None,
              what: str = "detection data") -> CocoDetectionData:
    """COCO detection data: the annotations JSON checked (:func:`read_annotations`), the images read lazily from
    ``images`` (default: the annotations file's folder). See the module docstring."""
    ann = read_annotations(annotations, what)
    folder = Path(images) if images is not None else Path(annotations).parent
    if not folder.is_dir():
        raise DataError(f"{what}: the images folder {folder} does not exist or is not a folder. Fix: set "
                        "dnnsafety_images (images=) to the folder holding the annotations' file_name entries.")
    return CocoDetectionData(ann, folder, what)


def reorder_rows(keys: Sequence[Any], data: CocoDetectionData, column: str, what: str) -> list[int]:
    """The scenario table's row for each data row, by ``column`` (``image_id`` or ``file_name``); DataError naming
    a missing, extra or repeated key."""
    wanted = data.image_ids if column == "image_id" else data.file_names
    norm = (lambda v: int(v) if _is_int(v) or isinstance(v, str) and v.strip().lstrip("-").isdigit() else v) \
        if column == "image_id" else str
    at: dict[Any, int] = {}
    for r, key in enumerate(keys):
        k = norm(key)
        if k in at:
            raise DataError(f"{what}: the scenario table's {column} {key!r} appears twice (rows {at[k]} and {r}). "
                            "Fix: one row per image.")
        at[k] = r
    missing = [k for k in wanted if k not in at]
    extra = sorted(set(at) - set(wanted), key=str)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"no row for {column} {', '.join(map(repr, missing[:_SHOWN]))}"
                         + (f" (and {len(missing) - _SHOWN} more)" if len(missing) > _SHOWN else ""))
        if extra:
            parts.append(f"rows for {column} {', '.join(map(repr, extra[:_SHOWN]))} not in {data.annotations}"
                         + (f" (and {len(extra) - _SHOWN} more)" if len(extra) > _SHOWN else ""))
        raise DataError(f"{what}: the scenario table does not match the COCO images: {'; '.join(parts)}. Fix: give "
                        f"exactly one row per image of the annotations file, keyed by {column}.")
    return [at[k] for k in wanted]
