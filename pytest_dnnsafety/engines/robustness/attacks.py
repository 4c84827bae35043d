"""Gradient attacks (FGSM, PGD) for the adversarial confidence loss (Cheng et al. 2018, §II-D, eq. 4).

They live in the perturbation library, :mod:`..perturb.adversarial`, which the monitor fault
families share; this module keeps the names importable from here.
"""

from __future__ import annotations

from ..perturb.adversarial import __all__ as _library_names
from ..perturb.adversarial import (
    LOSSES,
    NORMS,
    OUTPUTS,
    _check_args,
    _check_outputs,
    _loss_and_grad,
    _loss_fn,
    _project,
    _random_start,
    check_clip,
    detect_outputs,
    fgsm,
    input_gradient,
    log_probs,
    pgd,
)
from ..perturb.common import draw as _draw
from ..perturb.common import is_real as _is_real

__all__ = list(_library_names)
