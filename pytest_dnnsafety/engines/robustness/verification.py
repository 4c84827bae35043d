"""Certified L∞ robustness: how many inputs are *proved* robust at ε (README "Robustness"; Gowal et al. 2018 (IBP), Zhang et al. 2018 (CROWN)).

For every labelled input ``x`` the runner :func:`verify_robustness` gives one of three verdicts:

* **verified** — sound bounds prove ``z_y(x') − z_j(x') > 0`` for every ``j ≠ y`` and every
  ``x'`` in the ball ``{‖x' − x‖∞ ≤ ε} ∩ clip``: no input of the ball is misclassified. The
  bounds come from :class:`~pytest_dnnsafety.engines.robustness.bounds.BoundedModel`: interval
  bound propagation (Gowal et al. 2018) or CROWN (Zhang et al. 2018) on the margins;
* **falsified** — a counterexample exists: ``x`` itself is misclassified, or a PGD attack
  (Madry et al. 2018) on the margin loss found an ``x'`` in the ball whose prediction is not
  ``y`` (checked again by a plain forward pass);
* **unknown** — neither (the bounds are too loose and the attack failed).

Verified and falsified are disjoint by construction; an input that is both would mean unsound
bounds, and raises an internal :class:`~pytest_dnnsafety.errors.MetricError` rather than report
anything. :class:`VerificationEngine` counts the verdicts (sum states: they merge across workers
and ranks) and turns them into a :class:`VerificationResult`; its ``verified_share`` is the value
a gate compares with its threshold.

Pure torch; no pytest import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ... import progress
from ...data import iter_batches, known_length
from ...errors import ConfigError, DataError, MetricError
from ...outputs import ForwardGuard, model_dtype_device
from ..base import Engine
from .attacks import check_clip

__all__ = ["UNKNOWN", "VERIFIED", "FALSIFIED", "METHODS", "VerificationEngine", "VerificationResult",
           "verify_robustness"]

#: Verdict codes passed to :meth:`VerificationEngine.update`.
UNKNOWN, VERIFIED, FALSIFIED = 0, 1, 2
#: The bound methods.
METHODS = ("crown", "ibp")
#: At most this many counterexamples are kept in a result.
MAX_COUNTEREXAMPLES = 5
#: verify_robustness's input checks: raised at their batch (True) or read once after the loop (False); None: at
#: their batch on the CPU only, where reading a value costs no synchronisation.
_EAGER_CHECKS: bool | None = None

# Bins of the certified-margin histogram (for the median of a merged engine): ±10^-6 … ±10^4,
# 40 bins per decade (±3% of the value), with under/overflow bins at both ends.
_MAGNITUDES = torch.logspace(-6, 4, 401, dtype=torch.float64)
_EDGES = torch.cat([-_MAGNITUDES.flip(0), torch.zeros(1, dtype=torch.float64), _MAGNITUDES])


def _check_eps(eps: Any) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ConfigError(f"eps={eps!r} is not a positive finite L∞ radius. Fix: give the perturbation budget in "
                          f"input units, e.g. eps=0.02 for inputs in [0, 1].")
    return float(eps)


def _check_method(method: Any) -> str:
    if method not in METHODS:
        raise ConfigError(f"method={method!r} is not one of {list(METHODS)}. Fix: 'crown' (tighter) or 'ibp' "
                          f"(faster, looser).")
    return str(method)


@dataclass(frozen=True)
class VerificationResult:
    """Verdict counts of certified L∞ robustness at ``eps`` (see the module docstring).

    ``verified_share`` (= ``value``) is ``verified / n``. ``counterexamples``: up to 5 JSON-able
    dicts ``{index, label, predicted, linf_distance, source}`` in data order (``index`` counts
    from the first input of the data; ``source`` is ``"clean"`` for a misclassified input, ``"pgd"``
    for an attack point); ``counterexample_inputs`` holds the points themselves (CPU tensors, one
    per dict; not compared, not in :meth:`to_details`). ``margin_min``/``margin_median``: of the
    certified lower bound of ``min_{j≠y} z_y − z_j`` per input (positive ⇔ verified; from a
    merged engine the median is a binned estimate within ±3%).
    """

    n: int
    verified: int
    falsified: int
    unknown: int
    verified_share: float
    method: str
    eps: float
    counterexamples: tuple[dict[str, Any], ...] = ()
    margin_min: float = math.nan
    margin_median: float = math.nan
    clip: tuple[float, float] | None = None
    attack_steps: int | None = None
    counterexample_inputs: tuple[Tensor, ...] = field(default=(), compare=False, repr=False)

    @property
    def value(self) -> float:
        """The gated value: the verified share."""
        return self.verified_share

    @property
    def falsified_share(self) -> float:
        return self.falsified / self.n if self.n else math.nan

    @property
    def unknown_share(self) -> float:
        return self.unknown / self.n if self.n else math.nan

    def detail(self) -> str:
        """``verified 412/539 (0.764) at ε=0.02 by crown; falsified 20; unknown 107``."""
        return (f"verified {self.verified}/{self.n} ({self.verified_share:.3f}) at ε={self.eps:g} by {self.method}; "
                f"falsified {self.falsified}; unknown {self.unknown}")

    def to_details(self) -> dict[str, object]:
        """JSON-able details (plain str/int/float/bool/list/dict/None only)."""

        def num(value: float) -> float | None:
            return float(value) if math.isfinite(value) else None

        return {
            "metric": "certified_robustness",
            "value": float(self.verified_share),
            "n": int(self.n),
            "verified": int(self.verified),
            "falsified": int(self.falsified),
            "unknown": int(self.unknown),
            "verified_share": float(self.verified_share),
            "falsified_share": float(self.falsified_share),
            "unknown_share": float(self.unknown_share),
            "method": self.method,
            "eps": float(self.eps),
            "norm": "linf",
            "clip": None if self.clip is None else [float(self.clip[0]), float(self.clip[1])],
            "attack_steps": self.attack_steps,
            "margin_min": num(self.margin_min),
            "margin_median": num(self.margin_median),
            "counterexamples": [dict(example) for example in self.counterexamples],
        }


class VerificationEngine(Engine):
    """Counts of verified / falsified / unknown inputs (int64 ``sum`` states) and the certified margins.

    ``update(verdicts, margins=None)``: ``verdicts`` a 1-D integer tensor of :data:`VERIFIED`,
    :data:`FALSIFIED`, :data:`UNKNOWN` codes; ``margins`` the certified margin lower bound per
    input (for ``margin_min``, a ``min`` state, and the median's histogram). No host sync.
    """

    def __init__(self, eps: float, method: str = "crown", device: torch.device | str | None = None) -> None:
        super().__init__(device)
        self.eps = _check_eps(eps)
        self.method = _check_method(method)
        zero = torch.zeros((), dtype=torch.int64)
        for name in ("verified", "falsified", "unknown", "n"):
            self.add_state(name, zero, "sum")
        self.add_state("margin_min", torch.tensor(math.inf, dtype=torch.float64), "min")
        self.add_state("margin_hist", torch.zeros(_EDGES.numel() + 1, dtype=torch.int64), "sum")
        self._edges = _EDGES.to(self.device)

    def _move_buffers(self, device: torch.device) -> None:
        self._edges = self._edges.to(device)

    def config(self) -> dict[str, Any]:
        return {"eps": self.eps, "method": self.method}

    def update(self, verdicts: Tensor, margins: Tensor | None = None) -> None:  # type: ignore[override]
        verdicts = torch.as_tensor(verdicts)
        if verdicts.ndim != 1 or verdicts.is_floating_point() or verdicts.dtype == torch.bool:
            raise MetricError(f"verdicts must be a 1-D integer tensor of codes {UNKNOWN}/{VERIFIED}/{FALSIFIED}, "
                              f"got {verdicts.dtype} of shape {tuple(verdicts.shape)}")
        verdicts = verdicts.to(self.device, non_blocking=self.device.type != "cpu")
        self.verified = self.verified + (verdicts == VERIFIED).sum()
        self.falsified = self.falsified + (verdicts == FALSIFIED).sum()
        self.unknown = self.unknown + (verdicts == UNKNOWN).sum()
        self.n = self.n + verdicts.numel()
        if margins is not None:
            margins = torch.as_tensor(margins).detach().to(self.device, torch.float64,
                                                           non_blocking=self.device.type != "cpu").reshape(-1)
            if margins.numel() != verdicts.numel():
                raise MetricError(f"{margins.numel()} margins for {verdicts.numel()} verdicts")
            if margins.numel():
                self.margin_min = torch.minimum(self.margin_min, margins.min())
                bins = torch.bucketize(margins, self._edges)
                # a fixed-size histogram: torch.bincount would read the largest bin on the host (a sync on CUDA)
                hist = torch.zeros_like(self.margin_hist).index_add_(0, bins, torch.ones_like(bins))
                self.margin_hist = self.margin_hist + hist

    def _median_estimate(self) -> float:
        hist = self.margin_hist.cpu()
        total = int(hist.sum())
        if total == 0:
            return math.nan
        b = int(torch.searchsorted(hist.cumsum(0), (total + 1) // 2))  # bin of the lower median
        edges = _EDGES.tolist()
        if b == 0 or b == len(edges):  # outside ±10^4: the edge
            return edges[0] if b == 0 else edges[-1]
        lo, hi = edges[b - 1], edges[b]
        if lo == 0.0 or hi == 0.0:
            return 0.0
        return math.copysign(math.sqrt(lo * hi), hi)

    def compute(self) -> VerificationResult:
        n = int(self.n)
        verified, falsified, unknown = int(self.verified), int(self.falsified), int(self.unknown)
        if n == 0:
            raise MetricError("certified robustness: no inputs were verified. Fix: give at least one labelled input.")
        if verified + falsified + unknown != n:
            raise MetricError(f"certified robustness: {n - verified - falsified - unknown} of {n} verdict codes are "
                              f"not {UNKNOWN}/{VERIFIED}/{FALSIFIED}")
        margin_min = float(self.margin_min)
        return VerificationResult(
            n=n, verified=verified, falsified=falsified, unknown=unknown, verified_share=verified / n,
            method=self.method, eps=self.eps, margin_min=margin_min if math.isfinite(margin_min) else math.nan,
            margin_median=self._median_estimate(),
        )




def _check_int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name}={value!r} is not an integer ≥ {least}.")
    return value


def verify_robustness(
    model: torch.nn.Module,
    data: Any,
    eps: float,
    *,
    method: str = "crown",
    clip: tuple[float, float] | None = None,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    seed: int | None = 0,
    attack_steps: int = 20,
) -> VerificationResult:
    """Verify L∞ robustness at ``eps`` of every labelled input of ``data`` (see the module docstring).

    Per batch (from :func:`~pytest_dnnsafety.data.iter_batches`; labels required): a clean
    forward pass through a :class:`~pytest_dnnsafety.outputs.ForwardGuard` (a misclassified input
    is falsified, itself the counterexample); certified margin lower bounds over
    ``[x − ε, x + ε] ∩ clip`` by ``method``; the inputs left undecided are attacked with PGD on the
    margin loss (``attack_steps`` steps, random start seeded with ``seed + batch index``), and an
    attack point predicted as another class (checked by a forward pass) falsifies its input.
    ``device`` is used only for a model without parameters (the model's own device wins).

    Host synchronisation: on an accelerator each batch synchronises once to select the undecided
    inputs (their count sizes the PGD batch, which spares the attack on every verified or
    misclassified input), and with ``method="crown"`` CROWN reads its counts of unstable neurons
    a few times (see :data:`~pytest_dnnsafety.engines.robustness.bounds_crown.HOST_SIZING`; with
    it ``False``, or with ``"ibp"``, the selection is the only one). Every check (inputs inside
    ``clip``, finite boxes, labels in range, sound bounds) is kept on the device and read once
    after the loop, the earliest failing batch reported as it would have been had the loop
    stopped there. On the CPU the input checks raise at their batch.

    Raises :class:`ConfigError` for a bad ``eps`` (≤ 0, NaN, inf), ``method``, ``clip``,
    ``batch_size``, ``seed`` or ``attack_steps``; :class:`DataError` for unlabelled or empty data,
    labels out of range, inputs outside ``clip``;
    :class:`~pytest_dnnsafety.engines.robustness.bounds.UnsupportedLayerError` for a model the
    bounds cannot handle; :class:`MetricError` when the model fails or returns NaN/inf.
    """
    from .bounds import BoundedModel, box_problems, input_box, outside_clip, outside_clip_error

    eps = _check_eps(eps)
    method = _check_method(method)
    clip = check_clip(clip)
    batch_size = _check_int("batch_size", batch_size, 1)
    seed = 0 if seed is None else _check_int("seed", seed, 0)
    attack_steps = _check_int("attack_steps", attack_steps, 0)
    bounded = BoundedModel(model)
    dtype, model_device = model_dtype_device(model)
    target = model_device or torch.device(device)
    engine = VerificationEngine(eps, method, device=target)
    guard = ForwardGuard("certified robustness: model on the inputs")
    attack_guard = ForwardGuard("certified robustness: model on PGD attack points")
    margins_seen: list[Tensor] = []
    # Checks and counterexamples stay on the device inside the loop (read once after it):
    # the first batch with a label out of range / with certified margins above the model's own.
    bad_labels = torch.full((), -1, dtype=torch.int64, device=target)
    unsound = torch.full((), -1, dtype=torch.int64, device=target)
    overlap = torch.zeros((), dtype=torch.bool, device=target)
    # On an accelerator the input checks are deferred too (a host read per batch would be a sync): the first
    # batch with values outside clip (and how many), the first with a NaN/inf box. On the CPU they raise at once.
    eager = target.type == "cpu" if _EAGER_CHECKS is None else _EAGER_CHECKS
    bad_clip = torch.full((), -1, dtype=torch.int64, device=target)
    bad_clip_count = torch.zeros((), dtype=torch.int64, device=target)
    bad_box = torch.full((), -1, dtype=torch.int64, device=target)
    examples: dict[str, Tensor] | None = None  # the first MAX_COUNTEREXAMPLES falsified inputs
    n_classes = 0
    y_lo = y_hi = None
    total, done = known_length(data) or 0, 0
    for index, (x, y) in enumerate(iter_batches(data, batch_size)):
        if y is None:
            raise DataError("certified robustness needs labelled data (x, y): the data has no labels. Fix: give "
                            "(inputs, labels) pairs, a TensorDataset with labels, or {'x': ..., 'y': ...}.")
        if y.shape != (x.shape[0],) or y.is_floating_point() or y.is_complex():
            raise DataError(f"certified robustness needs one integer class label per input; got labels of shape "
                            f"{tuple(y.shape)} ({y.dtype}) for inputs of shape {tuple(x.shape)}.")
        x = x.to(target, dtype or (x.dtype if x.is_floating_point() else torch.float32), non_blocking=not eager)
        y = y.to(target, torch.int64, non_blocking=not eager)
        with torch.no_grad():
            logits = guard(model, x)
        n_classes = logits.shape[1]
        bad_labels = _first(bad_labels, ((y < 0) | (y >= n_classes)).any(), index)
        y_lo = y.amin() if y_lo is None else torch.minimum(y_lo, y.amin())  # named in the error, read after the loop
        y_hi = y.amax() if y_hi is None else torch.maximum(y_hi, y.amax())
        y = y.clamp(0, n_classes - 1)  # an out-of-range label is reported after the loop
        pred = logits.argmax(dim=1)
        wrong = pred != y
        if not eager:
            count = outside_clip(x, clip)
            bad_clip_count = torch.where(bad_clip < 0, count, bad_clip_count)
            bad_clip = _first(bad_clip, count > 0, index)
        lo, hi = input_box(x, eps, clip, check=eager)
        if not eager:
            bad_box = _first(bad_box, box_problems(lo, hi), index)
        margins = bounded.margin_lower_bounds(lo, hi, y, method, check=eager)
        clean = logits.detach().gather(1, y[:, None]) - logits.detach()  # the margins at x itself
        unsound = _first(unsound, (torch.isfinite(margins) & (margins > clean + 1e-4 * (1 + clean.abs()))).any(),
                         index)
        worst = margins.min(dim=1).values
        verified = worst > 0
        falsified = wrong.clone()
        found = x.clone()
        found_pred = pred.clone()
        # Only the undecided inputs are attacked: selecting them reads their count (the one sync per batch),
        # which spares PGD on every verified or already misclassified input.
        todo = torch.nonzero(~verified & ~wrong).squeeze(1)  # the one host sync of the batch
        if attack_steps > 0 and todo.numel():
            from .attacks import pgd

            gen = torch.Generator().manual_seed(seed + index)
            xa = pgd(model, x[todo], y[todo], eps, gen, norm="linf", steps=attack_steps, clip=clip, loss="margin",
                     guard=attack_guard)
            xa = torch.minimum(torch.maximum(xa.detach(), lo[todo].to(xa.dtype)), hi[todo].to(xa.dtype))
            with torch.no_grad():
                pa = attack_guard(model, xa).argmax(dim=1)
            hit = pa != y[todo]
            # scattered by the (long) indices todo, not a boolean mask (which would read its count on the host)
            falsified[todo] = falsified[todo] | hit
            found[todo] = torch.where(hit.reshape((-1,) + (1,) * (xa.ndim - 1)), xa.to(found.dtype), found[todo])
            found_pred[todo] = torch.where(hit, pa, found_pred[todo])
        overlap = overlap | (verified & falsified).any()
        codes = torch.full_like(y, UNKNOWN).masked_fill_(verified, VERIFIED).masked_fill_(falsified, FALSIFIED)
        engine.update(codes, worst)
        margins_seen.append(worst.detach())
        examples = _first_falsified(examples, falsified, done, x, found, y, found_pred, wrong)
        done += int(x.shape[0])
        progress.tick(done, total, "inputs")
    if not eager and done:  # the deferred input checks: the earliest failing batch, as the CPU would raise it
        first_clip, clip_count, first_box = torch.stack([bad_clip, bad_clip_count, bad_box]).tolist()
        if first_clip >= 0 and (first_box < 0 or first_clip <= first_box):
            raise outside_clip_error(int(clip_count), clip)
        if first_box >= 0:
            raise DataError("the input box holds NaN/inf. Fix: give finite inputs and a finite eps.")
    guard.check()
    attack_guard.check()
    if done == 0:
        raise DataError("certified robustness: the data set is empty. Fix: give at least one labelled input.")
    first_bad, first_unsound, both = (int(bad_labels), int(unsound), bool(overlap))  # one read after the loop
    if first_bad >= 0:
        raise DataError(f"labels range over {int(y_lo)}..{int(y_hi)}, outside [0, {n_classes}) from batch "
                        f"{first_bad} on (the model has {n_classes} classes). Fix: give class indices "
                        f"0..{n_classes - 1} matching the model's outputs.")
    if first_unsound >= 0:
        raise MetricError(
            f"certified robustness: on batch {first_unsound} the certified margin bounds do not contain the model's "
            f"own margins at the inputs, so the traced graph does not compute what the model computes (forward "
            f"hooks, state changed by forward(), or code torch.fx does not see). Fix: verify a plain eval-mode "
            f"model without hooks; if it is one, please report this with the model.")
    if both:
        raise MetricError("certified robustness: internal error: PGD found a misclassified point in the ball of an "
                          "input the bounds verify (unsound bounds). Please report this with the model.")
    result = engine.compute()
    median = float(torch.cat(margins_seen).to(torch.float64).median())  # the lower median
    listed, points = _examples_list(examples)
    return dataclasses.replace(result, counterexamples=listed, margin_median=median, clip=clip,
                               attack_steps=attack_steps, counterexample_inputs=points)


def _first(running: Tensor, flag: Tensor, index: int) -> Tensor:
    """``index`` if ``flag`` holds and nothing was recorded yet (``running < 0``), else ``running`` (no sync)."""
    return torch.where((running < 0) & flag, torch.full_like(running, index), running)


def _first_falsified(kept: dict[str, Tensor] | None, falsified: Tensor, offset: int, x: Tensor, found: Tensor,
                     y: Tensor, found_pred: Tensor, wrong: Tensor) -> dict[str, Tensor]:
    """The running first :data:`MAX_COUNTEREXAMPLES` falsified inputs (by index), merged on the device."""
    n = falsified.shape[0]
    index = torch.arange(offset, offset + n, device=falsified.device)
    batch = {"key": torch.where(falsified, index, torch.full_like(index, torch.iinfo(torch.int64).max)),
             "label": y, "predicted": found_pred, "clean": wrong,
             "distance": (found - x).flatten(1).abs().amax(dim=1).to(torch.float64), "point": found.detach()}
    if kept is not None:
        batch = {k: torch.cat([kept[k], v]) for k, v in batch.items()}
    keep = batch["key"].topk(min(MAX_COUNTEREXAMPLES, batch["key"].shape[0]), largest=False).indices
    return {k: v[keep] for k, v in batch.items()}


def _examples_list(kept: dict[str, Tensor] | None) -> tuple[tuple[dict[str, Any], ...], tuple[Tensor, ...]]:
    """The kept counterexamples as JSON-able dicts and their input points (host copies, after the loop)."""
    if kept is None:
        return (), ()
    real = kept["key"] < torch.iinfo(torch.int64).max
    rows = {k: v[real] for k, v in kept.items()}
    listed = tuple({"index": int(i), "label": int(label), "predicted": int(p), "linf_distance": float(d),
                    "source": "clean" if c else "pgd"}
                   for i, label, p, d, c in zip(rows["key"].tolist(), rows["label"].tolist(),
                                                rows["predicted"].tolist(), rows["distance"].tolist(),
                                                rows["clean"].tolist()))
    return listed, tuple(point.cpu() for point in rows["point"])
