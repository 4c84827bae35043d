"""The perturbation library: batched, seeded, device-agnostic torch transforms of input batches.

One implementation of every input transform the robustness families (the transformers
``T_i(in, ε)`` of Cheng et al. 2018, eq. 4; :mod:`..robustness.perturbations`) and the monitor
fault families (Ferreira et al. 2021 with the corruptions of Hendrycks & Dietterich 2019;
:mod:`..monitors.faults`) apply. Those front-ends choose the parameters (a budget ε, a severity
1–5) and check the arguments; the transforms here compute, on the input's device, without host
synchronisation:

* :mod:`.noise` — :func:`gaussian_noise`, :func:`shot_noise`, :func:`impulse_noise`, :func:`speckle_noise`;
* :mod:`.photometric` — :func:`brightness`, :func:`contrast`, :func:`haze`;
* :mod:`.geometric` — :func:`blur`, :func:`rotate`, :func:`random_rotation`, :func:`translate`;
* :mod:`.occlusion` — :func:`occlude` (a square patch), :func:`black_frame`, :func:`zeroed_rows`,
  :func:`copied_rows`, :func:`shifted_rows`;
* :mod:`.adversarial` — :func:`fgsm`, :func:`pgd` (``f(model, x, y, eps, generator, …)``) and the
  model-output helpers they use (:func:`log_probs`, :func:`detect_outputs`).

Every transform in :data:`TRANSFORMS` is ``f(x, parameter, generator=None, clip=None, **options)``:
``x`` a floating-point batch ``(N, ...)`` (images ``(N, C, H, W)`` or ``(N, H, W)`` for the
spatial ones), ``parameter`` its strength in the units its docstring gives, ``generator`` the
``torch.Generator`` its random draws come from (in the documented order; ignored by the
deterministic ones), ``clip`` the valid input range ``(low, high)`` or None (:mod:`.common`).
The result is a new tensor of ``x``'s shape, dtype and device, clamped to ``clip``; the same
inputs and a generator seeded alike give the same numbers. The arguments are not validated here
(the front-ends do it once per data set, not per batch).
"""

from __future__ import annotations

from collections.abc import Callable

from pytest_dnnsafety.engines.perturb.adversarial import detect_outputs, fgsm, input_gradient, log_probs, pgd
from pytest_dnnsafety.engines.perturb.common import as_images, check_clip, clamp, draw, fill_value, images, value_range
from pytest_dnnsafety.engines.perturb.geometric import blur, blur_radius, gaussian_kernel, random_rotation, rotate, rotation_map, translate, warp
from pytest_dnnsafety.engines.perturb.noise import gaussian_noise, impulse_noise, shot_noise, speckle_noise
from pytest_dnnsafety.engines.perturb.occlusion import black_frame, copied_rows, copy_source, occlude, row_mask, shifted_rows, zeroed_rows
from pytest_dnnsafety.engines.perturb.photometric import brightness, contrast, haze, haze_field

__all__ = [
    "TRANSFORMS",
    "as_images", "check_clip", "clamp", "draw", "fill_value", "images", "value_range",
    "gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise",
    "brightness", "contrast", "haze", "haze_field",
    "blur", "blur_radius", "gaussian_kernel", "rotate", "random_rotation", "rotation_map", "translate", "warp",
    "occlude", "black_frame", "row_mask", "copy_source", "zeroed_rows", "copied_rows", "shifted_rows",
    "fgsm", "pgd", "input_gradient", "log_probs", "detect_outputs",
]

#: The input transforms ``f(x, parameter, generator=None, clip=None, **options)`` by name.
TRANSFORMS: dict[str, Callable[..., object]] = {
    f.__name__: f
    for f in (gaussian_noise, shot_noise, impulse_noise, speckle_noise, brightness, contrast, haze, blur, rotate,
              random_rotation, translate, occlude, black_frame, zeroed_rows, copied_rows, shifted_rows)
}
