"""Margin bounds by method, CROWN-IBP, and the cost model behind ``method="auto"`` (docs: gates/robustness.md).

Full CROWN (:mod:`.crown`) bounds every unstable intermediate neuron by a backward pass of its
own to the input: its cost grows with the number of unstable neurons times the network's size,
minutes per input for a ResNet-18 at 32×32 on a CPU, hours at 224×224. **CROWN-IBP** (Zhang et
al. 2020, "Towards stable and efficient training of verifiably robust neural networks") keeps
the interval (IBP) bounds of every intermediate node for the relaxations and runs *one* CROWN
backward pass, from the margin specification ``C = e_y − e_j`` only (K rows per input, K the
classes): its cost is about ``2 + K`` model passes per input whatever the number of unstable
neurons. Its bounds are sound (every relaxation is sound on the IBP interval, which contains
the node's values), intersected with IBP's margins (never looser than IBP), and in general
looser than full CROWN's (the relaxations are built on wider intervals).

Work is counted in **model passes**: multiply-accumulates over those of one input's forward
pass (a backward row through an op costs about its forward per input: a convolution's transpose
is a transposed convolution of the same size). :func:`estimate` gives, per input, the passes
of full CROWN (from the IBP-unstable neurons of every node feeding a nonlinearity — an upper
estimate, since CROWN's own intermediate bounds leave fewer unstable neurons) and of CROWN-IBP.
``method="auto"`` bounds an input by full CROWN when its estimate is at most
:data:`AUTO_MAX_PASSES` passes, else by CROWN-IBP: a choice per input, from that input's box
alone, so it does not depend on the batch it is in.

:class:`Meter` turns the backward passes' progress (``BoundState.meter``) into
:func:`~pytest_dnnsafety.runtime.progress.tick` calls in estimated passes, so a long bound shows a
progress line with an ETA. Pure torch; no pytest import.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.runtime import progress
from pytest_dnnsafety.engines.bounds.crown import BoundState
from pytest_dnnsafety.engines.bounds.ops import ConvOp, ConvTransposeOp, LinearOp, ReluOp

__all__ = ["METHODS", "AUTO_MAX_PASSES", "Meter", "op_costs", "estimate", "margins", "check_method"]

#: The bound methods of :meth:`~pytest_dnnsafety.engines.bounds.model.BoundedModel.margin_lower_bounds`.
METHODS = ("auto", "crown", "crown-ibp", "ibp")
#: ``method="auto"``: full CROWN for an input whose estimated cost (model passes) is at most this, else CROWN-IBP.
#: Estimates at ε = 1/255 (0.01 for the digits): the example digits CNN ~4,000 passes per input (full CROWN ~0.07 s an
#: input on a loaded 2-core CPU); a width-8 ResNet-18 at 16×16 ~10⁴ (~25 s); width 16 at 32×32 ~8·10⁴ (206–346 s);
#: width 64 at 224×224 ~1.3·10⁶. So: full CROWN up to about the small ResNet, CROWN-IBP above.
AUTO_MAX_PASSES = 20_000
#: The unit of :class:`Meter`'s progress ticks.
UNIT = "bound passes"


def check_method(method: object) -> str:
    if method not in METHODS:
        raise ConfigError(f"method={method!r} is not one of {list(METHODS)}. Fix: 'auto' (full CROWN where it is "
                          f"cheap, CROWN-IBP elsewhere), 'crown' (tightest, cost grows with the unstable neurons), "
                          f"'crown-ibp' (one backward pass from the margins) or 'ibp' (fastest, loosest).")
    return str(method)


def op_costs(state: BoundState) -> list[float]:
    """Multiply-accumulates of one backward row through each op (≈ its forward for one input)."""
    costs = []
    for op in state.ops:
        if isinstance(op, (ConvOp, ConvTransposeOp)):
            fan = op.weight[0].numel() if isinstance(op, ConvOp) else op.weight.shape[0] * math.prod(op.weight.shape[2:])
            costs.append(float(op.numel * fan))
        elif isinstance(op, LinearOp):
            costs.append(float(op.numel * op.weight.shape[1]))
        else:
            costs.append(float(op.numel))
    return costs


def _row_passes(state: BoundState) -> tuple[list[float], float]:
    """Per node, one backward row to the input in model passes; and one pass's multiply-accumulates."""
    costs = op_costs(state)
    forward = sum(costs) or 1.0
    return [sum(costs[i] for i in state.ancestors[p]) / forward for p in range(len(state.ops))], forward


def _intermediate(state: BoundState) -> list[int]:
    """The nodes full CROWN bounds: the inputs of the nonlinear ancestors of the output (topological order)."""
    return sorted({state.ops[i].inputs[0] for i in state.ancestors[state.out] if not state.ops[i].linear})


def estimate(state: BoundState, k: int) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
    """Model passes per input ``(full CROWN (B,), CROWN-IBP (B,), {node: full CROWN's passes there (B,)})``.

    ``k``: rows of the specification (each one lower-bound pass). Full CROWN: two rows (lower and
    upper) per IBP-unstable neuron of a node feeding a ReLU (every neuron for another
    nonlinearity), each a backward pass from that node, plus the specification's rows;
    CROWN-IBP: the specification's rows. Both add the interval pass (2: centres and radii).
    """
    per_row, _ = _row_passes(state)
    spec = k * per_row[state.out]
    nodes: dict[int, Tensor] = {}
    full = torch.full((state.batch,), 2.0 + spec, dtype=torch.float64)
    for p in _intermediate(state):
        lo, hi = (t.flatten(1) for t in state.ivs[p])
        relu_only = all(state.ops[c].linear or isinstance(state.ops[c], ReluOp) for c in state.consumers[p])
        rows = ((lo < 0) & (hi > 0)).sum(dim=1) if relu_only else torch.full((state.batch,), lo.shape[1])
        nodes[p] = 2.0 * rows.to(torch.float64).cpu() * per_row[p]
        full += nodes[p]
    return full, torch.full((state.batch,), 2.0 + spec, dtype=torch.float64), nodes


class Meter:
    """``BoundState.meter``: (node, fraction of its rows done) → progress ticks in estimated model passes.

    ``weights``: the estimated passes of each node's backward pass; a node not listed counts nothing.
    """

    def __init__(self, weights: dict[int, float], done: float = 0.0, total: float | None = None) -> None:
        self.weights = weights
        self.finished: set[int] = set()
        self.base = done
        self.raw = max(1e-9, sum(weights.values()) + done if total is None else total)
        self.total = max(1, math.ceil(self.raw))

    def __call__(self, node: int, fraction: float) -> None:
        weight = self.weights.get(node)
        if weight is None or node in self.finished:
            return
        done = self.base + weight * min(1.0, fraction)
        if fraction >= 1.0:
            self.finished.add(node)
            self.base += weight
        progress.tick(min(self.total, int(done / self.raw * self.total + 1e-9)), self.total, UNIT)


def _crown_ibp(state: BoundState, spec: Tensor) -> Tensor:
    """Lower bounds ``(B, K)`` of ``spec·output``: IBP intervals for every relaxation, one CROWN pass from ``spec``."""
    for p in _intermediate(state):
        state.bounds.setdefault(p, state.ivs[p])  # the relaxations are built on the IBP interval: no CROWN rows
    return state.lower(state.out, spec, False)


def _nonzero_rows(spec: Tensor) -> tuple[Tensor, Tensor]:
    """The spec without its all-zero rows (the margin ``e_y − e_y``: no backward work for it), and their indices."""
    keep = spec.flatten(2).ne(0).any(dim=2)
    top = max(1, int(keep.sum(dim=1).max()))
    rows = torch.sort(keep.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :top]
    return spec.gather(1, rows.reshape(*rows.shape, *(1,) * (spec.ndim - 2)).expand(-1, -1, *spec.shape[2:])), rows


def _subset(state: BoundState, index: Tensor) -> BoundState:
    return BoundState(state.ops, state.out, state.x_lo[index], state.x_hi[index], state.max_elements)


def margins(state: BoundState, spec: Tensor, method: str, ibp: Tensor) -> tuple[Tensor, Tensor]:
    """Lower bounds ``(B, K)`` of ``spec·output`` (spec ``(B, K, classes)``) by ``method``, and per input the
    method used (0: ibp, 1: crown-ibp, 2: crown; int8 ``(B,)``), intersected with ``ibp`` (IBP's bounds).

    ``"auto"`` picks per input by :func:`estimate` (full CROWN at most :data:`AUTO_MAX_PASSES` passes).
    A long pass ticks :func:`~pytest_dnnsafety.runtime.progress.tick` in model passes (with an ETA).
    All-zero rows of ``spec`` (the margin ``e_y − e_y``) get ``+inf`` without any backward work.
    """
    used = torch.zeros(state.batch, dtype=torch.int8, device=ibp.device)
    if method == "ibp":
        return ibp, used
    k = spec.shape[1]
    spec, rows = _nonzero_rows(spec)
    full, _, nodes = estimate(state, spec.shape[1])
    if method == "auto":
        pick_full = full <= AUTO_MAX_PASSES
    else:
        pick_full = torch.full((state.batch,), method == "crown", dtype=torch.bool)
    per_row, _ = _row_passes(state)
    groups = []
    for mask, code in ((pick_full, 2), (~pick_full, 1)):
        index = torch.nonzero(mask).squeeze(1)
        if index.numel():
            weights = {state.out: spec.shape[1] * per_row[state.out] * index.numel()}
            if code == 2:
                weights.update({p: float(v[index].sum()) for p, v in nodes.items()})
            groups.append((index, code, weights))
    total, done = sum(sum(w.values()) for _, _, w in groups), 0.0
    result = ibp.clone()
    for index, code, weights in groups:
        sub = state if index.numel() == state.batch else _subset(state, index.to(state.x_lo.device))
        sub.meter = Meter(weights, done, total)
        at = index.to(spec.device)
        low = _crown_ibp(sub, spec[at]) if code == 1 else sub.lower(sub.out, spec[at], False)
        sub.meter = None
        low = torch.full((index.numel(), k), math.inf, dtype=low.dtype, device=low.device).scatter(1, rows[at], low)
        done += sum(weights.values())
        result[at] = torch.maximum(result[at], low)
        used[at] = code
    return result, used
