"""Canvases of handwritten digits under operating conditions (lighting, clutter, overlap).

Each canvas is a float32 ``(1, 48, 48)`` image in [0, 1] (ink bright, background dark) holding 1-4
digits from scikit-learn's bundled ``load_digits`` (8x8, 16 grey levels), each upscaled x2 to
16x16 (nearest neighbour) and pasted at a known position. Ground truth per digit: its tight box
(``x1, y1, x2, y2`` in pixel edges, the bounding box of the digit's non-zero pixels), its class and
its mask; per canvas the 0/1 vector of the digits present (multi-label).

Operating conditions, one scenario per canvas:

============  ========  ==================================================================
condition     value     effect
============  ========  ==================================================================
``lighting``  ``day``   gain 1.00, sensor noise sigma 0.02
              ``dusk``  gain 0.60, sensor noise sigma 0.05
              ``night`` gain 0.35, sensor noise sigma 0.09
``clutter``   ``none``  nothing but the digits
              ``low``   2 random strokes (line segments, 2 px wide) that are not digits
              ``high``  5 strokes and 2 soft blobs
``overlap``   ``none``  digits in separate quadrants (jittered): boxes never overlap
              ``partial`` 2-4 digits at free positions whose 16x16 patches overlap (IoU 0.05-0.35)
============  ========  ==================================================================

Rendering is vectorised in torch: digits and strokes are scattered onto the canvases with
``scatter_reduce(amax)`` (ink over ink keeps the brighter), blobs are Gaussians; then
``clamp(gain * scene + sigma * noise, 0, 1)``. Only the placement (a few numbers per canvas) is
drawn in a numpy loop. Everything is seeded: the same seed gives the same canvases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import Tensor

__all__ = ["CANVAS", "SCALE", "DOMAINS", "LIGHTING", "Canvases", "load_glyphs", "render", "all_scenarios",
           "draw_scenarios"]

CANVAS = 48           # canvas side, pixels
SCALE = 2             # digit upscaling: 8x8 -> 16x16
GLYPH = 8 * SCALE
DOMAINS: dict[str, tuple[str, ...]] = {
    "lighting": ("day", "dusk", "night"),
    "clutter": ("none", "low", "high"),
    "overlap": ("none", "partial"),
}
#: lighting -> (gain, sensor noise sigma)
LIGHTING = {"day": (1.00, 0.02), "dusk": (0.60, 0.05), "night": (0.35, 0.09)}
#: clutter -> (strokes, blobs)
CLUTTER = {"none": (0, 0), "low": (2, 0), "high": (5, 2)}


def load_glyphs() -> tuple[Tensor, Tensor]:
    """sklearn's 1797 digits as ``(1797, 16, 16)`` float32 glyphs in [0, 1] and ``(1797,)`` int64 labels."""
    digits = load_digits()
    small = torch.from_numpy(digits.images.astype(np.float32) / 16.0)
    glyphs = small.repeat_interleave(SCALE, dim=1).repeat_interleave(SCALE, dim=2)
    return glyphs, torch.from_numpy(digits.target.astype(np.int64))


def all_scenarios() -> list[dict[str, str]]:
    return [{"lighting": a, "clutter": b, "overlap": c}
            for a in DOMAINS["lighting"] for b in DOMAINS["clutter"] for c in DOMAINS["overlap"]]


def draw_scenarios(rng: np.random.Generator, n: int, cover_all: bool = True) -> list[dict[str, str]]:
    """``n`` scenarios: every full scenario once (when ``cover_all``), the rest uniform, shuffled."""
    full = all_scenarios()
    head = list(full) if cover_all else []
    rest = [full[i] for i in rng.integers(len(full), size=n - len(head))]
    chosen = head + rest
    return [chosen[i] for i in rng.permutation(n)]


@dataclass
class Canvases:
    """Rendered canvases and their ground truth (objects packed, canvas ``i`` owns rows ``offsets[i]:offsets[i+1]``)."""

    x: Tensor            # (N, 1, 48, 48) float32 in [0, 1]
    boxes: Tensor        # (M, 4) float32 x1, y1, x2, y2 (pixel edges)
    labels: Tensor       # (M,) int64
    offsets: Tensor      # (N + 1,) int64
    multilabel: Tensor   # (N, 10) int64 0/1
    masks: Tensor        # (M, 48, 48) bool: each digit's ink (pixels of its glyph above 1/16)
    scenarios: list[dict[str, str]]

    @property
    def image_of_object(self) -> Tensor:
        counts = self.offsets[1:] - self.offsets[:-1]
        return torch.repeat_interleave(torch.arange(len(counts)), counts)

    def image_masks(self) -> Tensor:
        """``(N, 48, 48)`` bool: the union of each canvas's digit masks."""
        out = torch.zeros(self.x.shape[0], CANVAS, CANVAS, dtype=torch.bool)
        out.index_put_((self.image_of_object,), self.masks, accumulate=True)
        return out


def _place(rng: np.random.Generator, overlap: str, k_weights: Sequence[float]) -> list[tuple[int, int]]:
    """Top-left corners of the digits of one canvas."""
    span = CANVAS - GLYPH
    if overlap == "none":
        k = int(rng.choice(4, p=k_weights)) + 1
        quads = rng.permutation(4)[:k]
        half = CANVAS // 2
        jitter = half - GLYPH  # 8 px of play inside each 24x24 quadrant
        return [(int(q % 2) * half + int(rng.integers(jitter + 1)), int(q // 2) * half + int(rng.integers(jitter + 1)))
                for q in quads]
    p = np.asarray(k_weights[1:], dtype=np.float64)
    k = int(rng.choice(3, p=p / p.sum())) + 2
    for _ in range(200):
        pos = rng.integers(span + 1, size=(k, 2))
        lo = np.maximum(pos[:, None, :], pos[None, :, :])
        hi = np.minimum(pos[:, None, :], pos[None, :, :]) + GLYPH
        inter = np.clip(hi - lo, 0, None).prod(-1)
        iou = inter / (2 * GLYPH * GLYPH - inter)
        iou = iou[np.triu_indices(k, 1)]
        if iou.max() <= 0.35 and iou.max() >= 0.05:
            return [(int(a), int(b)) for a, b in pos]
    raise RuntimeError("could not place overlapping digits")  # pragma: no cover - 200 tries always suffice


def _strokes(rng: np.random.Generator, n_canvas: int, count: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Flat canvas indices and intensities of ``count`` random 2-px line segments per canvas."""
    if count == 0 or n_canvas == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    s = n_canvas * count
    start = torch.rand(s, 2, generator=gen) * (CANVAS - 2)
    angle = torch.rand(s, generator=gen) * torch.pi
    length = 6 + torch.rand(s, generator=gen) * 18
    end = (start + length[:, None] * torch.stack([angle.cos(), angle.sin()], 1)).clamp(0, CANVAS - 2)
    t = torch.linspace(0, 1, 40)
    pts = start[:, None, :] + t[None, :, None] * (end - start)[:, None, :]          # (s, 40, 2)
    pts = pts.round().long()
    offs = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
    pts = (pts[:, :, None, :] + offs[None, None]).reshape(s, -1, 2)                # (s, 160, 2)
    canvas = torch.arange(n_canvas).repeat_interleave(count)
    flat = canvas[:, None] * CANVAS * CANVAS + pts[..., 1] * CANVAS + pts[..., 0]
    value = (0.5 + 0.5 * torch.rand(s, generator=gen))[:, None].expand_as(flat)
    return flat.reshape(-1), value.reshape(-1)


def render(glyphs: Tensor, labels: Tensor, scenarios: Sequence[Mapping[str, str]], seed: int,
           k_weights: Sequence[float] = (0.25, 0.3, 0.25, 0.2)) -> Canvases:
    """Render one canvas per scenario from ``glyphs`` (the digits it may use; each drawn at random)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    n = len(scenarios)
    corners, counts = [], []
    for sc in scenarios:
        c = _place(rng, sc["overlap"], k_weights)
        corners.extend(c)
        counts.append(len(c))
    m = len(corners)
    pick = torch.from_numpy(rng.integers(len(glyphs), size=m))
    g, lab = glyphs[pick], labels[pick]
    xy = torch.tensor(corners, dtype=torch.int64).reshape(m, 2)
    counts_t = torch.tensor(counts, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts_t.cumsum(0)])
    owner = torch.repeat_interleave(torch.arange(n), counts_t)

    # digits: scatter each 16x16 glyph onto its canvas (max over ink)
    rr, cc = torch.meshgrid(torch.arange(GLYPH), torch.arange(GLYPH), indexing="ij")
    rows = xy[:, 1, None, None] + rr                                                 # (m, 16, 16)
    cols = xy[:, 0, None, None] + cc
    flat = owner[:, None, None] * CANVAS * CANVAS + rows * CANVAS + cols
    scene = torch.zeros(n * CANVAS * CANVAS)
    scene.scatter_reduce_(0, flat.reshape(-1), g.reshape(-1), reduce="amax")
    masks = torch.zeros(m, CANVAS * CANVAS, dtype=torch.bool)
    masks.scatter_(1, (rows * CANVAS + cols).reshape(m, -1), (g > 1.5 / 16).reshape(m, -1))
    masks = masks.reshape(m, CANVAS, CANVAS)

    # tight boxes of the non-zero pixels (pixel edges)
    ink = g > 0
    any_col, any_row = ink.any(1), ink.any(2)                                        # (m, 16)
    idx = torch.arange(GLYPH)
    big = GLYPH + 1
    x1 = torch.where(any_col, idx, big).min(1).values
    x2 = torch.where(any_col, idx, -1).max(1).values + 1
    y1 = torch.where(any_row, idx, big).min(1).values
    y2 = torch.where(any_row, idx, -1).max(1).values + 1
    boxes = torch.stack([x1, y1, x2, y2], 1).float() + xy.repeat(1, 2).float()

    # clutter: strokes and blobs, per clutter level
    clutter = [sc["clutter"] for sc in scenarios]
    for level, (n_strokes, n_blobs) in CLUTTER.items():
        which = torch.tensor([i for i, c in enumerate(clutter) if c == level], dtype=torch.int64)
        if len(which) == 0 or (n_strokes == 0 and n_blobs == 0):
            continue
        f, v = _strokes(rng, len(which), n_strokes, gen)
        canvas_of = f // (CANVAS * CANVAS)
        f = which[canvas_of] * CANVAS * CANVAS + f % (CANVAS * CANVAS)
        scene.scatter_reduce_(0, f, v, reduce="amax")
        if n_blobs:
            centre = torch.rand(len(which), n_blobs, 2, generator=gen) * CANVAS
            sigma = 2.0 + 2.0 * torch.rand(len(which), n_blobs, 1, 1, generator=gen)
            amp = 0.4 + 0.4 * torch.rand(len(which), n_blobs, 1, 1, generator=gen)
            grid = torch.arange(CANVAS, dtype=torch.float32)
            d2 = ((grid[None, None, None, :] - centre[..., 0, None, None]) ** 2
                  + (grid[None, None, :, None] - centre[..., 1, None, None]) ** 2)
            blob = (amp * torch.exp(-d2 / (2 * sigma ** 2))).amax(1)                 # (w, 48, 48)
            view = scene.view(n, CANVAS, CANVAS)
            view[which] = torch.maximum(view[which], blob)

    gain = torch.tensor([LIGHTING[sc["lighting"]][0] for sc in scenarios])[:, None, None]
    sigma = torch.tensor([LIGHTING[sc["lighting"]][1] for sc in scenarios])[:, None, None]
    noise = torch.randn(n, CANVAS, CANVAS, generator=gen)
    x = (gain * scene.view(n, CANVAS, CANVAS) + sigma * noise).clamp(0, 1).unsqueeze(1).contiguous()

    multi = torch.zeros(n, 10, dtype=torch.int64)
    multi[owner, lab] = 1
    return Canvases(x=x, boxes=boxes, labels=lab, offsets=offsets, multilabel=multi, masks=masks,
                    scenarios=[dict(s) for s in scenarios])
