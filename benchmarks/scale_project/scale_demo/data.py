"""Structured 3x224x224 images under operating conditions, in uint8 shards on disk, read one image at a time.

``python -m scale_demo.data --n 10000 --out data/`` writes two splits, deterministic from ``--seed``:

* ``data/eval/``: the evaluation data (``--n`` images) with its scenario table
  (``data/scenarios.csv``, one row per evaluation image) and ``data/conditions.toml`` (each
  condition's full value domain and the one combination that cannot occur), in the formats
  ``dnnsafety_scenarios`` and ``dnnsafety_conditions`` read;
* ``data/train/``: ``--train`` images (default 2,000) the models are trained on and the runtime
  monitors fitted on.

Each split holds ``x_00000.npy, x_00001.npy, ...`` (``uint8 (500, 3, 224, 224)``: 73.5 MiB a
shard), ``m_00000.npy, ...`` (the object's segmentation mask, ``bool (500, 224, 224)``, for the
occlusion gates), ``y.npy`` (``int64`` labels) and ``meta.json``.

**Classes** (a shape with a texture, its hue tied to the class with a little jitter, at a random
position and scale on a smooth random background): 0 disk, 1 square, 2 triangle, 3 plus, 4 ring,
5 diamond, 6 square with horizontal stripes, 7 disk with vertical stripes, 8 checkered square,
9 diagonal cross.

**Operating conditions**, applied in the order a camera sees them (scene, optics, illumination,
weather), each drawn uniformly over the feasible combinations:

==============  ==========  ================================================================
condition       value       transform
==============  ==========  ================================================================
``blur``        ``none``    identity
                ``light``   averaged down 2x and bilinearly up again (defocus)
                ``heavy``   averaged down 8x and bilinearly up again
``lighting``    ``day``     gain 1.0
                ``dusk``    gain 0.6, warm tint (R x1.1, B x0.8)
                ``night``   gain 0.3, blue tint (R x0.8, B x1.2)
``weather``     ``clear``   identity
                ``rain``    Gaussian sensor noise sigma 0.08 and thin bright vertical streaks
                ``fog``     blended 55 % towards a flat grey of 0.7 (contrast loss)
                ``snow``    2 % of the pixels set to white flakes of 2x2 px
==============  ==========  ================================================================

Restriction: no ``fog`` at ``night`` (the fleet does not drive then in fog), so that pair is
infeasible; 3 x 3 x 4 = 36 combinations, 33 feasible.

:class:`ShardImages` is the map-style data set the project's ``DataLoader`` reads: it opens a
shard with ``np.load(mmap_mode="r")`` on first use (per worker) and converts one image at a time,
so a loader over 10,000 images never holds more than its batches. :class:`ShardBoxes` reads the same
shards as detection data: each image's one object, its box the tight bounding box of its mask.
"""

from __future__ import annotations

import argparse
import colorsys
import csv
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["CLASSES", "DOMAINS", "RESTRICTIONS", "SHARD", "SIZE", "feasible", "render", "generate", "ShardImages",
           "ShardBoxes", "loader", "boxes_loader", "conditions_toml"]

SIZE = 224
SHARD = 500
CLASSES = ("disk", "square", "triangle", "plus", "ring", "diamond", "h_stripes", "v_stripes", "checker", "x_cross")
#: Every condition's full value domain, in the order of the scenario table's columns.
DOMAINS: dict[str, tuple[str, ...]] = {
    "lighting": ("day", "dusk", "night"),
    "weather": ("clear", "rain", "fog", "snow"),
    "blur": ("none", "light", "heavy"),
}
#: Combinations that cannot occur (each a conjunction).
RESTRICTIONS: tuple[dict[str, str], ...] = ({"lighting": "night", "weather": "fog"},)
BLUR_FACTOR = {"none": 0, "light": 2, "heavy": 8}
LIGHT = {"day": (1.0, (1.0, 1.0, 1.0)), "dusk": (0.6, (1.1, 1.0, 0.8)), "night": (0.3, (0.8, 1.0, 1.2))}


def feasible() -> list[tuple[str, ...]]:
    """Every feasible scenario (lighting, weather, blur), in a fixed order."""
    out = []
    for combo in itertools.product(*DOMAINS.values()):
        row = dict(zip(DOMAINS, combo))
        if not any(all(row[k] == v for k, v in r.items()) for r in RESTRICTIONS):
            out.append(combo)
    return out


def conditions_toml() -> str:
    lines = ["# Operating conditions of scale_demo (written by python -m scale_demo.data; do not edit).",
             "[conditions]"]
    lines += [f"{name} = [{', '.join(repr(v).replace(chr(39), chr(34)) for v in values)}]"
              for name, values in DOMAINS.items()]
    lines += ["", "# No fog at night: the fleet does not drive then in fog."]
    for restriction in RESTRICTIONS:
        lines.append("[[restrictions]]")
        lines += [f'{k} = "{v}"' for k, v in restriction.items()]
    return "\n".join(lines) + "\n"


def _shape(c: int, dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The mask of class ``c`` from coordinates relative to the centre, in units of the radius."""
    ax, ay = dx.abs(), dy.abs()
    disk, square = (dx * dx + dy * dy <= 1.0), (ax <= 0.85) & (ay <= 0.85)
    if c == 0:
        return disk
    if c == 1:
        return square
    if c == 2:
        return (dy <= 0.8) & (dy >= -0.9 + 2.0 * ax)  # apex up
    if c == 3:
        return ((ax <= 0.3) & (ay <= 1.0)) | ((ay <= 0.3) & (ax <= 1.0))
    if c == 4:
        return disk & (dx * dx + dy * dy >= 0.45)
    if c == 5:
        return ax + ay <= 1.0
    if c == 6:
        return square & (torch.remainder(dy * 4.0, 1.0) < 0.5)
    if c == 7:
        return disk & (torch.remainder(dx * 4.0, 1.0) < 0.5)
    if c == 8:
        return square & ((torch.floor(dx * 2.5) + torch.floor(dy * 2.5)).remainder(2) == 0)
    return (((dx - dy).abs() <= 0.35) | ((dx + dy).abs() <= 0.35)) & (ax <= 0.9) & (ay <= 0.9)


def _shapes(label: torch.Tensor, yy: torch.Tensor, xx: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor,
            r: torch.Tensor) -> torch.Tensor:
    """(n, H, W) bool object masks of class ``label`` centred at (cx, cy) with radius r."""
    out = torch.zeros(len(label), yy.shape[1], xx.shape[2], dtype=torch.bool)
    for c in label.unique().tolist():
        rows = label == c
        out[rows] = _shape(c, (xx - cx[rows]) / r[rows], (yy - cy[rows]) / r[rows])
    return out


def _blur(x: torch.Tensor, factor: int) -> torch.Tensor:
    """Defocus: averaged down by ``factor`` and bilinearly up again."""
    return F.interpolate(F.avg_pool2d(x, factor), scale_factor=float(factor), mode="bilinear", align_corners=False)


def render(label: torch.Tensor, scenario: torch.Tensor, gen: torch.Generator, size: int = SIZE
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(n, 3, size, size)`` uint8 and masks ``(n, size, size)`` bool of classes ``label`` under
    ``scenario`` (``(n, 3)`` codes into :data:`DOMAINS`), drawn from ``gen``."""
    n = len(label)
    coords = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    yy, xx = coords.view(1, -1, 1), coords.view(1, 1, -1)
    cx, cy = (0.3 + 0.4 * torch.rand(n, 1, 1, generator=gen) for _ in range(2))
    r = 0.14 + 0.12 * torch.rand(n, 1, 1, generator=gen)
    mask = _shapes(label, yy, xx, cx, cy, r)
    hue = (label.float() / len(CLASSES) + 0.04 * (2 * torch.rand(n, generator=gen) - 1)).remainder(1.0)
    sat = 0.6 + 0.3 * torch.rand(n, generator=gen)
    colour = torch.tensor([colorsys.hsv_to_rgb(float(h), float(s), 0.95) for h, s in zip(hue, sat)])
    # background: a smooth gradient between two dull random colours, plus low-frequency texture
    c0, c1 = 0.15 + 0.35 * torch.rand(n, 3, 1, 1, generator=gen), 0.15 + 0.35 * torch.rand(n, 3, 1, 1, generator=gen)
    angle = 2 * math.pi * torch.rand(n, 1, 1, generator=gen)
    t = (torch.cos(angle) * xx + torch.sin(angle) * yy + 1.0) / 2.0  # (n, H, W) in [0, 1]
    background = c0 + (c1 - c0) * t.unsqueeze(1)
    texture = F.interpolate(torch.rand(n, 1, 8, 8, generator=gen), size=(size, size), mode="bilinear",
                            align_corners=False)
    x = background + 0.12 * (texture - 0.5)
    x = torch.where(mask.unsqueeze(1), colour.view(n, 3, 1, 1).expand(n, 3, size, size), x)
    for level, factor in enumerate(BLUR_FACTOR.values()):  # optics
        rows = scenario[:, 2] == level
        if rows.any() and factor > 0:
            x[rows] = _blur(x[rows], factor)
    for level, (gain, tint) in enumerate(LIGHT.values()):  # illumination
        rows = scenario[:, 0] == level
        x[rows] = x[rows] * gain * torch.tensor(tint).view(1, 3, 1, 1)
    weather = scenario[:, 1]
    rain, fog, snow = weather == 1, weather == 2, weather == 3
    if rain.any():
        k = int(rain.sum())
        streaks = (torch.rand(k, 1, 1, size, generator=gen) < 0.03).float() * 0.25
        x[rain] = x[rain] + 0.08 * torch.randn((k, 3, size, size), generator=gen) + streaks
    if fog.any():
        x[fog] = 0.45 * x[fog] + 0.55 * 0.7
    if snow.any():
        k = int(snow.sum())
        flakes = F.interpolate((torch.rand(k, 1, size // 2, size // 2, generator=gen) < 0.02).float(),
                               scale_factor=2.0) > 0
        x[snow] = torch.where(flakes, torch.ones_like(x[snow]), x[snow])
    return (x.clamp(0, 1) * 255).round().to(torch.uint8), mask


def _write_split(folder: Path, n: int, seed: int, chunk: int = 100) -> torch.Tensor:
    """Render ``n`` images into shards under ``folder``; returns the scenario codes ``(n, 3)``."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in list(folder.glob("x_*.npy")) + list(folder.glob("m_*.npy")):
        old.unlink()
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(len(CLASSES), (n,), generator=gen)
    combos = feasible()
    codes = torch.tensor([[DOMAINS[k].index(v) for k, v in zip(DOMAINS, c)] for c in combos])
    scenario = codes[torch.randint(len(combos), (n,), generator=gen)]
    for shard, start in enumerate(range(0, n, SHARD)):
        stop = min(start + SHARD, n)
        xs, ms = [], []
        for lo in range(start, stop, chunk):
            hi = min(lo + chunk, stop)
            part = torch.Generator().manual_seed(seed * 1_000_003 + lo)  # any chunk renders alone
            x, m = render(labels[lo:hi], scenario[lo:hi], part)
            xs.append(x.numpy())
            ms.append(m.numpy())
        np.save(folder / f"x_{shard:05d}.npy", np.concatenate(xs))
        np.save(folder / f"m_{shard:05d}.npy", np.concatenate(ms))
    np.save(folder / "y.npy", labels.numpy().astype(np.int64))
    (folder / "meta.json").write_text(json.dumps({"n": n, "shard": SHARD, "size": SIZE, "seed": seed,
                                                  "classes": list(CLASSES)}))
    return scenario


def generate(out: Path | str, n: int = 10_000, train: int = 2_000, seed: int = 0) -> None:
    """Write the evaluation split (``n``), the training split (``train``), the scenario table and conditions."""
    out = Path(out)
    scenario = _write_split(out / "eval", n, seed)
    with open(out / "scenarios.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(DOMAINS)
        for row in scenario.tolist():
            writer.writerow([DOMAINS[k][code] for k, code in zip(DOMAINS, row)])
    (out / "conditions.toml").write_text(conditions_toml())
    _write_split(out / "train", train, seed + 1)


class ShardImages(torch.utils.data.Dataset):
    """Images ``(3, 224, 224)`` float in [0, 1] and labels of a split folder, one image per index.

    ``start``/``stop``: a contiguous range of the split (a subset fixture); ``size``: the side the
    image is average-pooled to (e.g. 32 for the certified gates' model). Shards are memory-mapped on
    first use in each process (a ``DataLoader`` worker opens its own); an index is an int only.
    """

    def __init__(self, folder: Path | str, start: int = 0, stop: int | None = None, size: int = SIZE) -> None:
        self.folder = Path(folder)
        meta = json.loads((self.folder / "meta.json").read_text())
        self.total, self.shard = int(meta["n"]), int(meta["shard"])
        self.start, self.stop = int(start), self.total if stop is None else min(int(stop), self.total)
        if not 0 <= self.start < self.stop:
            raise ValueError(f"ShardImages({self.folder}): empty range {self.start}:{self.stop} of {self.total}")
        if SIZE % size:
            raise ValueError(f"size={size} must divide {SIZE}")
        self.size = int(size)
        self._maps: dict[str, Any] = {}

    def __len__(self) -> int:
        return self.stop - self.start

    def _map(self, name: str) -> Any:
        """The memory map of file ``name``; one image shard at a time (a shard read once is unmapped when the
        next one opens: every page of a mapped file counts in the reader's RSS until it is unmapped, so a
        worker that kept every shard mapped grew to the data's size, 1 GB per worker at N = 10,000)."""
        if name not in self._maps:
            kind = name.split("_")[0]
            for old in [key for key in self._maps if key.split("_")[0] == kind and key != "y.npy"]:
                del self._maps[old]
            self._maps[name] = np.load(self.folder / name, mmap_mode="r")
        return self._maps[name]

    def __getstate__(self) -> dict[str, Any]:  # workers re-open the memory maps
        return {**self.__dict__, "_maps": {}}

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, int]:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"ShardImages is read one image at a time; got {type(index).__name__}")
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} images")
        j = self.start + int(index)
        shard, row = divmod(j, self.shard)
        # numpy converts (one thread): a torch op on one image would start a parallel region per image
        x = torch.from_numpy(np.multiply(self._map(f"x_{shard:05d}.npy")[row], np.float32(1 / 255), dtype=np.float32))
        if self.size != SIZE:
            x = F.avg_pool2d(x.unsqueeze(0), SIZE // self.size).squeeze(0)
        return x, int(self._map("y.npy")[j])

    def masks(self) -> torch.Tensor:
        """The range's object masks ``(n, size, size)`` bool (a pixel of a pooled image is object when most of it is)."""
        out = []
        for shard in range(self.start // self.shard, (self.stop - 1) // self.shard + 1):
            lo, hi = max(self.start - shard * self.shard, 0), min(self.stop - shard * self.shard, self.shard)
            m = torch.from_numpy(np.array(self._map(f"m_{shard:05d}.npy")[lo:hi]))
            if self.size != SIZE:
                m = F.avg_pool2d(m.float().unsqueeze(1), SIZE // self.size).squeeze(1) > 0.5
            out.append(m)
        return torch.cat(out)


class ShardBoxes(ShardImages):
    """Detection data from the same shards: ``(image, {"boxes": (1, 4) float, "labels": (1,) int64})`` per index.

    Each image holds one object; its box is the tight bounding box of its segmentation mask (``m_*.npy``)
    in pixels, ``x1, y1, x2, y2`` with ``x2``/``y2`` one past the last object pixel (pixel edges). Read one
    image at a time, one image shard and one mask shard mapped at a time (:meth:`ShardImages._map`).
    ``size`` stays 224 (boxes are in the full image's pixels).
    """

    task = "detection"

    def __init__(self, folder: Path | str, start: int = 0, stop: int | None = None) -> None:
        super().__init__(folder, start, stop)

    def box(self, index: int) -> torch.Tensor:
        """The tight box ``(1, 4)`` float32 of image ``index``'s mask."""
        shard, row = divmod(self.start + int(index), self.shard)
        mask = self._map(f"m_{shard:05d}.npy")[row]
        cols, rows = np.flatnonzero(mask.any(axis=0)), np.flatnonzero(mask.any(axis=1))
        if not len(cols):
            raise ValueError(f"ShardBoxes({self.folder}): image {self.start + int(index)} has an empty mask")
        return torch.tensor([[cols[0], rows[0], cols[-1] + 1, rows[-1] + 1]], dtype=torch.float32)

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # type: ignore[override]
        x, y = super().__getitem__(index)
        return x, {"boxes": self.box(index), "labels": torch.tensor([y], dtype=torch.int64)}


def boxes_loader(folder: Path | str, start: int = 0, stop: int | None = None, batch_size: int = 64,
                 num_workers: int = 2) -> torch.utils.data.DataLoader:
    """An in-order ``DataLoader`` over :class:`ShardBoxes`, collated by ``pytest_dnnsafety.detection_collate``."""
    from pytest_dnnsafety import detection_collate

    data = ShardBoxes(folder, start, stop)
    workers = num_workers if len(data) > batch_size else 0
    return torch.utils.data.DataLoader(data, batch_size=batch_size, num_workers=workers, persistent_workers=False,
                                       collate_fn=detection_collate)


def loader(folder: Path | str, start: int = 0, stop: int | None = None, size: int = SIZE, batch_size: int = 64,
           num_workers: int = 2) -> torch.utils.data.DataLoader:
    """An in-order ``DataLoader`` over :class:`ShardImages` (the gates refuse shuffled data)."""
    data = ShardImages(folder, start, stop, size)
    workers = num_workers if len(data) > batch_size else 0  # a single batch gains nothing from workers
    return torch.utils.data.DataLoader(data, batch_size=batch_size, num_workers=workers,
                                       persistent_workers=False)


def _data_dir() -> Path:
    import os

    return Path(os.environ.get("SCALE_DATA", Path(__file__).resolve().parent.parent / "data")).resolve()


def operational_rows(folder: Path | str | None = None) -> tuple[Path, int, int]:
    """The training split and the row range ``start:stop`` of the operational images: its last ``SCALE_N_PMI``
    (default 60) images."""
    import os

    split = Path(folder) if folder is not None else _data_dir() / "train"
    total = int(json.loads((split / "meta.json").read_text())["n"])
    return split, max(0, total - int(os.environ.get("SCALE_N_PMI", 60))), total


def operational_loader() -> torch.utils.data.DataLoader:
    """The operational images (and labels) as an in-order ``DataLoader``: ``dnnsafety_operational_data =
    "scale_demo.data:operational_loader"`` is a factory the plugin streams batch by batch (it reads the images, not
    the labels); the ``pmi_data`` fixture is the same loader, labelled points for the r-separation."""
    split, start, stop = operational_rows()
    return loader(split, start, stop, batch_size=64)


def operational_npy(folder: Path | str | None = None) -> Path:
    """The operational images as one float32 ``.npy`` file ``(n, 3, 224, 224)`` in [0, 1] beside the splits
    (``operational_<n>.npy``; written once, a row at a time through a memory map): the ``.npy`` route of
    ``dnnsafety_operational_data``."""
    split, start, stop = operational_rows(None if folder is None else Path(folder) / "train")
    path = split.parent / f"operational_{stop - start}.npy"
    if not path.exists():
        images = ShardImages(split, start, stop)
        tmp = path.with_suffix(".tmp.npy")
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(len(images), 3, SIZE, SIZE))
        for i in range(len(images)):
            out[i] = images[i][0].numpy()
        out.flush()
        del out
        tmp.rename(path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="evaluation images (default 10,000)")
    parser.add_argument("--train", type=int, default=2_000, help="training images (default 2,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("data"))
    args = parser.parse_args(argv)
    began = time.perf_counter()
    generate(args.out, args.n, args.train, args.seed)
    print(f"wrote {args.n} evaluation and {args.train} training images to {args.out}/ "
          f"in {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
