"""Operating conditions of the digit reader, as deterministic, vectorised image transforms.

A *scenario* is one value for each condition, e.g.
``{"lighting": "dim", "blur": "light", "rotation": "15", "noise": "low"}``.
:func:`apply_conditions` renders a batch of clean images ``(N, 1, 8, 8)`` in ``[0, 1]`` under one
scenario per image. The transforms are applied in the order a camera produces them:

1. ``rotation``: the digit is seen tilted (camera roll), bilinear resampling about the image
   centre, zeros (background) outside the original image.
2. ``blur``: defocus/motion blur of the optics, a normalised 5x5 Gaussian kernel.
3. ``lighting``: scene illumination and exposure, ``x * gain + offset``.
4. ``noise``: sensor noise, additive zero-mean Gaussian, drawn from the caller's generator.
5. The result is clamped to ``[0, 1]``.

Conditions and values (see ``README.md`` for the rationale):

=============  ==========  ===============================================================
condition      value       transform
=============  ==========  ===============================================================
``lighting``   ``bright``  gain 1.00, offset +0.20 (washed-out background, lifted blacks)
               ``normal``  gain 1.00, offset 0.00 (identity)
               ``dim``     gain 0.50, offset 0.00
               ``night``   gain 0.25, offset 0.00
``blur``       ``none``    identity
               ``light``   Gaussian, sigma 0.6 px
               ``heavy``   Gaussian, sigma 1.0 px
``rotation``   ``-15``     rotated 15 degrees clockwise
               ``0``       identity
               ``15``      rotated 15 degrees counter-clockwise
``noise``      ``none``    identity
               ``low``     sigma 0.05
               ``high``    sigma 0.12
=============  ==========  ===============================================================

Restriction (a combination that cannot occur): high sensor noise only happens when the sensor
runs at high gain, i.e. in ``dim`` or ``night`` light; so ``lighting in {bright, normal}`` and
``noise = high`` together are impossible.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "object_masks",
    "DOMAINS",
    "RESTRICTIONS",
    "LIGHTING",
    "BLUR_SIGMA",
    "ROTATION_DEG",
    "NOISE_SIGMA",
    "BLUR_KERNEL_SIZE",
    "CLEAN",
    "apply_conditions",
    "is_feasible",
    "feasible_scenarios",
    "conditions_toml",
    "write_conditions_toml",
]

#: Every condition's full value domain, in a fixed order (the columns of ``scenarios.csv``).
DOMAINS: dict[str, tuple[str, ...]] = {
    "lighting": ("bright", "normal", "dim", "night"),
    "blur": ("none", "light", "heavy"),
    "rotation": ("-15", "0", "15"),
    "noise": ("none", "low", "high"),
}

#: Combinations that cannot occur. Each entry is a conjunction; a list value means "any of".
RESTRICTIONS: tuple[dict[str, str | tuple[str, ...]], ...] = (
    {"lighting": ("bright", "normal"), "noise": "high"},
)

#: lighting value -> (gain, offset) applied as ``x * gain + offset``.
LIGHTING: dict[str, tuple[float, float]] = {
    "bright": (1.00, 0.20),
    "normal": (1.00, 0.00),
    "dim": (0.50, 0.00),
    "night": (0.25, 0.00),
}
#: blur value -> Gaussian sigma in pixels (0 = no blur).
BLUR_SIGMA: dict[str, float] = {"none": 0.0, "light": 0.6, "heavy": 1.0}
#: rotation value -> angle in degrees, counter-clockwise positive.
ROTATION_DEG: dict[str, float] = {"-15": -15.0, "0": 0.0, "15": 15.0}
#: noise value -> standard deviation of the additive Gaussian sensor noise.
NOISE_SIGMA: dict[str, float] = {"none": 0.0, "low": 0.05, "high": 0.12}
#: Side of the (odd) Gaussian blur kernel, in pixels.
BLUR_KERNEL_SIZE = 5

#: The nominal scenario: no transform at all.
CLEAN: dict[str, str] = {"lighting": "normal", "blur": "none", "rotation": "0", "noise": "none"}


def _matches(value: str, allowed: str | Sequence[str]) -> bool:
    return value == allowed if isinstance(allowed, str) else value in allowed


def is_feasible(scenario: Mapping[str, str]) -> bool:
    """Whether a (full or partial) scenario violates no restriction.

    A restriction only applies when the scenario assigns every condition it names.
    """
    for restriction in RESTRICTIONS:
        if all(name in scenario and _matches(scenario[name], allowed) for name, allowed in restriction.items()):
            return False
    return True


def feasible_scenarios() -> Iterator[dict[str, str]]:
    """Every full scenario that violates no restriction, in ``DOMAINS`` order."""
    names = list(DOMAINS)
    for values in itertools.product(*DOMAINS.values()):
        scenario = dict(zip(names, values))
        if is_feasible(scenario):
            yield scenario


def _gaussian_kernels(sigmas: Tensor, size: int = BLUR_KERNEL_SIZE) -> Tensor:
    """One normalised ``size x size`` Gaussian kernel per sigma, ``(N, 1, size, size)``.

    A sigma of 0 gives the identity (a centred delta).
    """
    radius = size // 2
    coords = torch.arange(-radius, radius + 1, dtype=torch.float32)
    r2 = (coords[None, :, None] ** 2 + coords[None, None, :] ** 2)  # (1, size, size)
    s = sigmas.to(torch.float32)[:, None, None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    kernels = torch.exp(-r2 / (2.0 * safe**2))
    delta = (r2 == 0).to(torch.float32).expand_as(kernels)
    kernels = torch.where(s > 0, kernels, delta)
    kernels = kernels / kernels.sum(dim=(1, 2), keepdim=True)
    return kernels[:, None]


def _rotate(x: Tensor, degrees: Tensor) -> Tensor:
    """Rotate each image about its centre by its angle (counter-clockwise positive)."""
    theta = degrees.to(x.dtype) * (math.pi / 180.0)
    cos, sin = torch.cos(theta), torch.sin(theta)
    zero = torch.zeros_like(theta)
    # affine_grid maps output (x right, y down) to input coordinates: the output pixel at p samples
    # the input at R(-theta) p in screen terms, which turns the content counter-clockwise on screen.
    mats = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1)
    grid = F.affine_grid(mats, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def object_masks(x: Tensor, scenarios: Sequence[Mapping[str, str]], level: float = 0.25) -> Tensor:
    """The digit's strokes in each rendered image: ``(N, H, W)`` bool segmentation masks.

    The clean image goes through the scenario's geometry only (its rotation), not its lighting,
    blur or noise, and the pixels above ``level`` (4 of 16 grey levels) are the object. These are
    the masks the occlusion gates compare the model's attention with.
    """
    degrees = torch.tensor([ROTATION_DEG[s["rotation"]] for s in scenarios], dtype=torch.float32)
    return (_rotate(x.to(torch.float32), degrees) > level)[:, 0]


def apply_conditions(
    x: Tensor,
    scenarios: Sequence[Mapping[str, str]],
    generator: torch.Generator | None = None,
) -> Tensor:
    """Render a batch of clean images under one scenario per image.

    ``x`` is ``(N, 1, H, W)`` float in ``[0, 1]`` and ``scenarios`` has ``N`` entries, each giving
    a value for every condition in :data:`DOMAINS`. Noise is drawn from ``generator`` (one
    ``randn`` call for the whole batch), so the same generator state gives the same output.
    Raises ``ValueError`` for a wrong length, an unknown value, or an infeasible scenario.
    """
    if x.ndim != 4 or x.shape[1] != 1:
        raise ValueError(f"apply_conditions: expected x of shape (N, 1, H, W), got {tuple(x.shape)}")
    n = x.shape[0]
    if len(scenarios) != n:
        raise ValueError(f"apply_conditions: {len(scenarios)} scenarios for {n} images")
    for i, scenario in enumerate(scenarios):
        for name, domain in DOMAINS.items():
            if scenario.get(name) not in domain:
                raise ValueError(
                    f"apply_conditions: scenario {i} has {name}={scenario.get(name)!r}; expected one of {domain}"
                )
        if not is_feasible(scenario):
            raise ValueError(f"apply_conditions: scenario {i} is infeasible: {dict(scenario)}")
    if n == 0:
        return x.clone()

    def column(table: Mapping[str, object], name: str) -> Tensor:
        return torch.tensor([table[s[name]] for s in scenarios], dtype=torch.float32)

    gain_offset = torch.tensor([LIGHTING[s["lighting"]] for s in scenarios], dtype=torch.float32)
    blur_sigma = column(BLUR_SIGMA, "blur")
    degrees = column(ROTATION_DEG, "rotation")
    noise_sigma = column(NOISE_SIGMA, "noise")

    out = x.to(torch.float32)
    # 1. rotation
    out = _rotate(out, degrees.to(out.device))
    # 2. blur: a grouped convolution with one kernel per image
    kernels = _gaussian_kernels(blur_sigma).to(out.device)
    h, w = out.shape[-2:]
    out = F.conv2d(out.reshape(1, n, h, w), kernels, padding=BLUR_KERNEL_SIZE // 2, groups=n).reshape(n, 1, h, w)
    # 3. lighting
    gain = gain_offset[:, 0].to(out.device).view(n, 1, 1, 1)
    offset = gain_offset[:, 1].to(out.device).view(n, 1, 1, 1)
    out = out * gain + offset
    # 4. sensor noise, drawn on the generator's device for reproducibility
    gen_device = generator.device if generator is not None else torch.device("cpu")
    noise = torch.randn(out.shape, generator=generator, device=gen_device, dtype=torch.float32).to(out.device)
    out = out + noise * noise_sigma.to(out.device).view(n, 1, 1, 1)
    # 5. clamp to the sensor's range
    return out.clamp_(0.0, 1.0)


def _toml_value(value: str | Sequence[str]) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    return "[" + ", ".join(f'"{v}"' for v in value) + "]"


def conditions_toml() -> str:
    """The ``conditions.toml`` text for :data:`DOMAINS` and :data:`RESTRICTIONS`."""
    lines = [
        "# Operating conditions of digits_demo (generated by digits_demo.train; do not edit).",
        "# Each condition's full value domain, and the combinations that cannot occur.",
        "[conditions]",
    ]
    lines += [f"{name} = {_toml_value(domain)}" for name, domain in DOMAINS.items()]
    for restriction in RESTRICTIONS:
        lines += ["", "# High sensor noise only occurs at high sensor gain, i.e. in dim or night light.", "[[restrictions]]"]
        lines += [f"{name} = {_toml_value(value)}" for name, value in restriction.items()]
    return "\n".join(lines) + "\n"


def write_conditions_toml(path: str | Path) -> Path:
    """Write :func:`conditions_toml` to ``path`` (parents created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(conditions_toml(), encoding="utf-8", newline="\n")
    return path
