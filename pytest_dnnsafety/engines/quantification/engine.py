"""The state of :func:`~pytest_dnnsafety.engines.quantification.quantify_safety` over a data set: an Engine.

:class:`SafeRadiusEngine` folds each batch's DeepQuant results (Xu, Ruan, Huang et al.,
Definition 6 and Theorem 1) into engine states, so that partial results merge (``merge``), cross
process boundaries (``state_payload``) and all-reduce over torchrun ranks (``sync``):

* the per-input results are ``cat`` states (one row per input, in data order): the gate compares
  a *quantile* of the radii, which needs every input's value — a handful of scalars per input
  (about 100 bytes), never the inputs themselves;
* the ``worst`` inputs (smallest gated radius; inputs the expression does not apply to rank last)
  are a ``topk`` state whose rows also hold the input ``x`` and the search's point ``x̂`` (for the
  details and the plot), ties broken by the input index, so the kept rows do not depend on the
  batch split or the shards;
* ``no_certificate`` / ``no_pgd`` (``or``): the certified radius or the PGD check was given up on
  some batch (the model's bounds or gradients are not available).

Pure torch; no pytest import.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.base import Engine, topk

__all__ = ["SafeRadiusEngine", "PER_INPUT", "WORST_COLUMNS"]

#: The per-input ``cat`` states and their dtypes.
PER_INPUT: dict[str, torch.dtype] = {
    **{name: torch.float64 for name in ("s", "q", "radius", "unsafe", "linf", "certified", "q_ratio", "q_gradient",
                                        "pgd")},
    "iterations": torch.int64, "evaluations": torch.int64, "converged": torch.bool, "applicable": torch.bool,
}
#: The leading columns of a ``worst`` row (float64); the flattened ``x`` and ``x̂`` follow.
WORST_COLUMNS = ("key", "index", "s", "q", "estimate", "s_hat", "iterations", "linf", "dist", "unsafe", "applicable",
                 "certified")


class SafeRadiusEngine(Engine):
    """Per-input DeepQuant results (``cat``) and the ``worst`` inputs (``topk``); see the module docstring.

    ``worst``: how many inputs with the smallest gated radius to keep (0: none); ``input_shape``
    and ``dtype`` (a name, e.g. ``"float32"``): one input's shape and the search's dtype, to give
    the kept ``x`` and ``x̂`` back as they were.
    """

    def __init__(self, worst: int = 0, input_shape: Any = (), dtype: str = "float32",
                 device: torch.device | str | None = None) -> None:
        super().__init__(device)
        if isinstance(worst, bool) or not isinstance(worst, int) or worst < 0:
            raise ValueError(f"SafeRadiusEngine: worst={worst!r} is not an integer >= 0")
        self.worst, self.input_shape, self.dtype = worst, [int(s) for s in input_shape], str(dtype)
        self._x_dtype = getattr(torch, self.dtype)
        for name, dt in PER_INPUT.items():
            self.add_state(name, torch.zeros(0, dtype=dt), "cat")
        self.add_state("no_certificate", torch.tensor(False), "or")
        self.add_state("no_pgd", torch.tensor(False), "or")
        if worst:
            width = len(WORST_COLUMNS) + 2 * math.prod(self.input_shape)
            self.add_state("worst_rows", torch.zeros((0, width), dtype=torch.float64),
                           topk(worst, 0, largest=False, tie_break=1))

    def config(self) -> dict[str, Any]:
        return {"worst": self.worst, "input_shape": list(self.input_shape), "dtype": self.dtype}

    def update(self, start: int, values: dict[str, Tensor | None], gated: Tensor | None = None,
               x: Tensor | None = None, x_hat: Tensor | None = None, s_hat: Tensor | None = None,
               dist: Tensor | None = None) -> None:
        """Fold in the results of inputs ``start…start+N-1`` (no host sync).

        ``values``: the :data:`PER_INPUT` tensors ``(N,)`` by name; ``certified`` None: the
        certificate was given up (NaN rows, ``no_certificate``); ``pgd`` None: the PGD check was
        (inf rows, ``no_pgd``). With ``worst > 0``: ``gated`` (the radii compared), ``x``, ``x_hat``
        (``(N, *input_shape)``), ``s_hat`` and ``dist`` (the search norm's distance of ``x̂``).
        """
        s = values["s"]
        assert s is not None
        n = s.shape[0]
        if n == 0:
            return
        filled = dict(values)
        if filled.get("certified") is None:
            filled["certified"] = torch.full((n,), math.nan, dtype=torch.float64, device=s.device)
            self.no_certificate = self.no_certificate | True
        if filled.get("pgd") is None:
            filled["pgd"] = torch.full((n,), math.inf, dtype=torch.float64, device=s.device)
            self.no_pgd = self.no_pgd | True
        for name in PER_INPUT:
            self.append_state(name, filled[name])  # type: ignore[arg-type]
        if not self.worst:
            return
        if gated is None or x is None or x_hat is None or s_hat is None or dist is None:
            raise ValueError("SafeRadiusEngine(worst>0).update needs gated=, x=, x_hat=, s_hat= and dist=")
        f64 = {"dtype": torch.float64, "device": self.device}
        applicable = filled["applicable"].to(self.device)  # type: ignore[union-attr]
        key = torch.where(applicable, torch.nan_to_num(gated.to(**f64), nan=math.inf),
                          torch.full((n,), math.inf, **f64))
        columns = [key, torch.arange(start, start + n, **f64), s, filled["q"], filled["radius"], s_hat,
                   filled["iterations"], filled["linf"], dist, filled["unsafe"], applicable, filled["certified"]]
        rows = torch.stack([c.to(**f64) for c in columns], dim=1)  # type: ignore[union-attr]
        self.append_state("worst_rows", torch.cat([rows, x.reshape(n, -1).to(**f64), x_hat.reshape(n, -1).to(**f64)],
                                                  dim=1))

    def compute(self) -> dict[str, Any]:
        """The per-input CPU tensors by name, ``n``, the flags and the worst rows (CPU, or None)."""
        out: dict[str, Any] = {name: getattr(self, name).cpu() for name in PER_INPUT}
        out["n"] = int(out["s"].shape[0])
        out["no_certificate"], out["no_pgd"] = bool(self.no_certificate), bool(self.no_pgd)
        out["worst_rows"] = self.worst_rows.cpu() if self.worst else None
        return out

    def worst_points(self, rows: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The ``(x, x̂)`` pairs of worst rows, in the inputs' shape and dtype."""
        d, c = math.prod(self.input_shape), len(WORST_COLUMNS)
        shape = (-1, *self.input_shape)
        xs = rows[:, c:c + d].to(self._x_dtype).reshape(shape)
        hats = rows[:, c + d:c + 2 * d].to(self._x_dtype).reshape(shape)
        return list(zip(xs, hats))
