"""Certified L∞ robustness: how many inputs are *proved* robust at ε (docs: gates/robustness.md; Gowal et al. 2018 (IBP), Zhang et al. 2018 (CROWN)).

For every labelled input ``x`` the runner :func:`verify_robustness` gives one of three verdicts:

* **verified** — sound bounds prove ``z_y(x') − z_j(x') > 0`` for every ``j ≠ y`` and every
  ``x'`` in the ball ``{‖x' − x‖∞ ≤ ε} ∩ clip``: no input of the ball is misclassified. The
  bounds come from :class:`~pytest_dnnsafety.engines.bounds.model.BoundedModel`: interval
  bound propagation (Gowal et al. 2018), CROWN (Zhang et al. 2018) or CROWN-IBP (Zhang et al.
  2020: IBP intervals inside, one CROWN pass from the margins) on the margins; ``method="auto"``
  picks full CROWN or CROWN-IBP per input by an estimate of its cost
  (:mod:`~pytest_dnnsafety.engines.bounds.crown_ibp`);
* **falsified** — a counterexample exists: ``x`` itself is misclassified, or a PGD attack
  (Madry et al. 2018) on the margin loss found an ``x'`` in the ball whose prediction is not
  ``y`` (checked again by a plain forward pass);
* **unknown** — neither (the bounds are too loose and the attack failed).

Verified and falsified are disjoint by construction; an input that is both would mean unsound
bounds, and raises an internal :class:`~pytest_dnnsafety.errors.MetricError` rather than report
anything. :class:`VerificationEngine` counts the verdicts (sum states: they merge across workers
and ranks), keeps the margins and the first counterexamples, and turns them into a
:class:`VerificationResult`; its ``verified_share`` is the value
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

from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.engines.core.guard import model_dtype_device
from pytest_dnnsafety.engines.core.base import Engine, topk
from pytest_dnnsafety.data.checks import check_count, check_positive
from pytest_dnnsafety.engines.core.runner import Runner
from pytest_dnnsafety.engines.perturb.adversarial import check_clip
from pytest_dnnsafety.engines.bounds.crown_ibp import METHODS as BOUND_METHODS, check_method

__all__ = ["UNKNOWN", "VERIFIED", "FALSIFIED", "METHODS", "VerificationEngine", "VerificationResult",
           "verify_robustness", "bound_cost", "BOUND_PASS_FORWARDS"]

#: Verdict codes passed to :meth:`VerificationEngine.update`.
UNKNOWN, VERIFIED, FALSIFIED = 0, 1, 2
#: The bound methods (:data:`pytest_dnnsafety.engines.bounds.crown_ibp.METHODS`).
METHODS = BOUND_METHODS
#: At most this many counterexamples are kept in a result.
MAX_COUNTEREXAMPLES = 5
#: The bounds each input may end with, by the code :meth:`BoundedModel.margin_lower_bounds` reports.
BOUND_NAMES = ("ibp", "crown-ibp", "crown")
UNSOUND = ("certified robustness: on batch {first} the certified margin bounds do not contain the model's own margins "
           "at the inputs or at the attack's points, so the traced graph does not compute what the model computes "
           "(forward hooks, state changed by forward(), or code torch.fx does not see). Fix: verify a plain eval-mode "
           "model without hooks; if it is one, please report this with the model.")


def _check_eps(eps: Any) -> float:
    return check_positive(eps, "eps", fix="give the L∞ radius (the perturbation budget) in input units, e.g. "
                          "eps=0.02 for inputs in [0, 1].")


def _check_method(method: Any) -> str:
    return check_method(method)


@dataclass(frozen=True)
class VerificationResult:
    """Verdict counts of certified L∞ robustness at ``eps`` (see the module docstring).

    ``verified_share`` (= ``value``) is ``verified / n``. ``counterexamples``: up to 5 JSON-able
    dicts ``{index, label, predicted, linf_distance, source}`` in data order (``index`` counts
    from the first input of the data; ``source`` is ``"clean"`` for a misclassified input, ``"pgd"``
    for an attack point); ``counterexample_inputs`` holds the points themselves (CPU tensors, one
    per dict; not compared, not in :meth:`to_details`). ``margin_min``/``margin_median``: of the
    certified lower bound of ``min_{j≠y} z_y − z_j`` per input (positive ⇔ verified; the median is
    the lower median).
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
    bounded_by: dict[str, int] = field(default_factory=dict)
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
        """``verified 412/539 (0.764) at ε=0.02 by crown; falsified 20; unknown 107`` (``by auto (crown 500,
        crown-ibp 39)`` for ``method="auto"``: the inputs each bound was computed for beyond IBP)."""
        method = self.method
        if method == "auto":
            method += " (" + ", ".join(f"{name} {self.bounded_by.get(name, 0)}" for name in ("crown", "crown-ibp")) + ")"
        return (f"verified {self.verified}/{self.n} ({self.verified_share:.3f}) at ε={self.eps:g} by {method}; "
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
            "bounded_by": {name: int(count) for name, count in self.bounded_by.items()},
            "margin_min": num(self.margin_min),
            "margin_median": num(self.margin_median),
            "counterexamples": [dict(example) for example in self.counterexamples],
        }


class VerificationEngine(Engine):
    """Counts of verified / falsified / unknown inputs (int64 ``sum`` states), margins and counterexamples.

    ``update(verdicts, margins=None)``: ``verdicts`` a 1-D integer tensor of :data:`VERIFIED`,
    :data:`FALSIFIED`, :data:`UNKNOWN` codes; ``margins`` the certified margin lower bound per
    input, kept per input (a ``cat`` state of float64, 8 bytes an input: their minimum and exact
    lower median). :meth:`observe` folds in a batch's data checks (``label_min``/``label_max``,
    ``outside_clip``, read after the pass), :meth:`add_counterexamples` its falsified inputs: the
    first :data:`MAX_COUNTEREXAMPLES` by index are kept (a ``topk`` state keyed by the index, so the
    rows kept do not depend on the batch split or the ranks), with their points when the engine
    knows the ``input_shape``. No host sync in any of them.
    """

    def __init__(self, eps: float, method: str = "auto", device: torch.device | str | None = None,
                 input_shape: tuple[int, ...] | list[int] | None = None) -> None:
        super().__init__(device)
        self.eps = _check_eps(eps)
        self.method = _check_method(method)
        self.input_shape = None if input_shape is None else tuple(int(s) for s in input_shape)
        width = 5 + (math.prod(self.input_shape) if self.input_shape is not None else 0)
        zero = torch.zeros((), dtype=torch.int64)
        for name in ("verified", "falsified", "unknown", "n", "outside_clip"):
            self.add_state(name, zero, "sum")
        self.add_state("bounded_by", torch.zeros(len(BOUND_NAMES), dtype=torch.int64), "sum")
        self.add_state("margins", torch.zeros(0, dtype=torch.float64), "cat")
        self.add_state("label_min", torch.tensor(torch.iinfo(torch.int64).max), "min")
        self.add_state("label_max", torch.tensor(torch.iinfo(torch.int64).min), "max")
        # rows: index (inf for an input not falsified), label, predicted, clean (0/1), L∞ distance, the point
        self.add_state("examples", torch.zeros(0, width, dtype=torch.float64),
                       topk(MAX_COUNTEREXAMPLES, key=0, largest=False))

    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"eps": self.eps, "method": self.method}
        if self.input_shape is not None:
            config["input_shape"] = list(self.input_shape)
        return config

    def update(self, verdicts: Tensor, margins: Tensor | None = None,  # type: ignore[override]
               bounds: Tensor | None = None) -> None:
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
            margins = torch.as_tensor(margins).detach().reshape(-1)
            if margins.numel() != verdicts.numel():
                raise MetricError(f"{margins.numel()} margins for {verdicts.numel()} verdicts")
            self.append_state("margins", margins.to(torch.float64))
        if bounds is not None:  # per input, the tightest bound it got (an index of BOUND_NAMES)
            bounds = torch.as_tensor(bounds).to(self.device, torch.int64).reshape(-1)
            self.bounded_by = self.bounded_by + torch.bincount(bounds, minlength=len(BOUND_NAMES))[:len(BOUND_NAMES)]

    def observe(self, labels: Tensor, outside_clip: Tensor) -> None:
        """A batch's data checks: its labels (their range) and how many input values lie outside ``clip``."""
        labels = labels.detach().to(self.device, torch.int64)
        if labels.numel():
            self.label_min = torch.minimum(self.label_min, labels.amin())
            self.label_max = torch.maximum(self.label_max, labels.amax())
        self.outside_clip = self.outside_clip + outside_clip.to(self.device, torch.int64)

    def add_counterexamples(self, index: Tensor, falsified: Tensor, labels: Tensor, predicted: Tensor,
                            clean: Tensor, distance: Tensor, points: Tensor) -> None:
        """Offer a batch's inputs: those ``falsified`` compete, by ``index``, for the kept counterexamples.

        ``index``: each input's index in the data; ``clean``: misclassified as it is (else the
        point was found by the attack); ``distance``: L∞ from the input to ``points``.
        """
        key = torch.where(falsified, index.to(torch.float64), torch.full_like(index, math.inf, dtype=torch.float64))
        pick = key.topk(min(MAX_COUNTEREXAMPLES, key.shape[0]), largest=False).indices  # the batch's first ones
        columns = [key, labels.to(torch.float64), predicted.to(torch.float64), clean.to(torch.float64),
                   distance.to(torch.float64)]
        rows = torch.stack([c[pick] for c in columns], dim=1)
        if self.input_shape is not None:
            rows = torch.cat([rows, points[pick].detach().flatten(1).to(torch.float64)], dim=1)
        self.append_state("examples", rows)

    def compute(self) -> VerificationResult:
        n = int(self.n)
        verified, falsified, unknown = int(self.verified), int(self.falsified), int(self.unknown)
        if n == 0:
            raise MetricError("certified robustness: no inputs were verified. Fix: give at least one labelled input.")
        if verified + falsified + unknown != n:
            raise MetricError(f"certified robustness: {n - verified - falsified - unknown} of {n} verdict codes are "
                              f"not {UNKNOWN}/{VERIFIED}/{FALSIFIED}")
        margins = self.margins.cpu()
        margin_min = float(margins.min()) if margins.numel() else math.nan
        rows = self.examples.cpu()
        rows = rows[torch.isfinite(rows[:, 0])]
        listed = tuple({"index": int(i), "label": int(label), "predicted": int(p), "linf_distance": float(d),
                        "source": "clean" if c else "pgd"} for i, label, p, c, d in rows[:, :5].tolist())
        points = () if self.input_shape is None else tuple(row[5:].reshape(self.input_shape) for row in rows)
        return VerificationResult(
            n=n, verified=verified, falsified=falsified, unknown=unknown, verified_share=verified / n,
            method=self.method, eps=self.eps, margin_min=margin_min if math.isfinite(margin_min) else math.nan,
            margin_median=float(margins.median()) if margins.numel() else math.nan,  # the lower median
            counterexamples=listed, counterexample_inputs=points,
            bounded_by=dict(zip(BOUND_NAMES, (int(v) for v in self.bounded_by.tolist()))),
        )


#: Forward-equivalents of one estimated bound pass (:meth:`~pytest_dnnsafety.engines.bounds.model.BoundedModel.
#: estimate_passes` counts multiply-accumulates; a backward row through a convolution is a transposed convolution of
#: its size, plus the relaxations' element-wise work and the coefficients' memory traffic). Measured on the 2-core
#: CPU: full CROWN on the width-8 ResNet-18 at 16×16, 1.8 forward times per pass (11,067 passes, 20.5 s); CROWN-IBP
#: on the width-64 one at 224×224, about 5 (11 passes, bounds alone 17 s, both under load).
BOUND_PASS_FORWARDS = 3.0


def bound_cost(model: Any, x: Tensor, eps: float, method: str = "auto",
               clip: tuple[float, float] | None = None) -> tuple[float, str]:
    """``(forwards per input, what)``: the estimated cost of bounding the inputs ``x`` (a few, e.g. the cost
    probe's) by ``method`` in single-input forwards, averaged over ``x`` — the interval pass and the bound's
    estimated passes × :data:`BOUND_PASS_FORWARDS`. One interval pass over ``x``; no bound is computed."""
    from pytest_dnnsafety.engines.bounds.model import BoundedModel
    from pytest_dnnsafety.engines.bounds.box import input_box

    dtype, device = model_dtype_device(model)
    x = x.to(device=device or x.device, dtype=dtype or (x.dtype if x.is_floating_point() else torch.float32))
    lo, hi = input_box(x, float(eps), check_clip(clip), check=False)
    passes = BoundedModel(model).estimate_passes(lo, hi, check_method(method))
    mean = float(passes.mean())
    return 2.0 + BOUND_PASS_FORWARDS * mean, f"{mean:,.0f} bound passes × {BOUND_PASS_FORWARDS:g} (method={method!r})"


def verify_robustness(
    model: torch.nn.Module,
    data: Any,
    eps: float,
    *,
    method: str = "auto",
    clip: tuple[float, float] | None = None,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    seed: int | None = 0,
    attack_steps: int = 20,
    shard: Any = None,
    max_memory: int | str | None = None,
) -> VerificationResult:
    """Verify L∞ robustness at ``eps`` of every labelled input of ``data`` (see the module docstring).

    Measured through a :class:`~pytest_dnnsafety.engines.core.runner.Runner` (labels required). Per
    batch: a clean forward pass through a :class:`~pytest_dnnsafety.engines.core.guard.ForwardGuard` (a
    misclassified input is falsified, itself the counterexample); IBP margin lower bounds over
    ``[x − ε, x + ε] ∩ clip`` for every input (a few model passes); the inputs left undecided are
    attacked with PGD on the margin loss (``attack_steps`` steps, random start seeded with ``seed +
    global batch index``), and an attack point predicted as another class (checked by a forward
    pass) falsifies its input; the inputs still undecided get the tighter bounds of ``method``
    (unless ``"ibp"``) — attacks first, so a falsified input costs no CROWN work (its recorded
    margin is its IBP bound). The tighter bounds must hold at the attack's points as at the
    inputs (a soundness check). ``bounded_by`` in the result counts the tightest bound each input
    got. A long bound ticks the progress line (in estimated model passes, with an ETA).
    ``device`` is used only for a model without parameters (the model's own device wins). ``shard``: this torchrun rank's :class:`~pytest_dnnsafety.runtime.torchrun.Shard` of the
    batches (None: all of them); the ranks' states are all-reduced, so every rank gets the
    single-process result. ``max_memory``: the bounds' working-memory budget in bytes (int or text
    such as ``"2GiB"``; None: 1 GiB), see :class:`~pytest_dnnsafety.engines.bounds.model.BoundedModel` (chunks never change a bound).

    Host synchronisation: on an accelerator each batch synchronises once to select the undecided
    inputs (their count sizes the PGD batch, which spares the attack on every verified or
    misclassified input) and once more to select the inputs left to bound; ``"auto"`` reads its
    cost estimate, and CROWN reads its counts of unstable neurons a few times (see :data:`~pytest_dnnsafety.engines.bounds.crown.HOST_SIZING`; with
    it ``False``, or with ``"ibp"``, the selection is the only one). Every check (finite inputs,
    inputs inside ``clip``, labels in range, sound bounds) is kept on the device and read once
    after the loop, on every device alike (so the CPU and an accelerator raise the same error).

    Raises :class:`ConfigError` for a bad ``eps`` (≤ 0, NaN, inf), ``method``, ``clip``,
    ``batch_size``, ``seed`` or ``attack_steps``; :class:`DataError` for unlabelled or empty data,
    NaN/inf inputs, labels out of range, inputs outside ``clip``;
    :class:`~pytest_dnnsafety.engines.bounds.model.UnsupportedLayerError` for a model the
    bounds cannot handle; :class:`MetricError` when the model fails or returns NaN/inf.
    """
    from pytest_dnnsafety.engines.bounds.model import BoundedModel
    from pytest_dnnsafety.engines.bounds.box import input_box, outside_clip, outside_clip_error
    from pytest_dnnsafety.engines.bounds.export import export_mismatch
    from pytest_dnnsafety.files.onnx_model import is_onnx_model

    eps = _check_eps(eps)
    method = _check_method(method)
    clip = check_clip(clip)
    batch_size = check_count(batch_size, "batch_size", fix="give a positive batch size, e.g. batch_size=256.")
    seed = 0 if seed is None else check_count(seed, "seed", 0, fix="give a non-negative integer seed, e.g. seed=0.")
    attack_steps = check_count(attack_steps, "attack_steps", 0, fix="give the PGD steps, e.g. attack_steps=20 (0: "
                               "no attack).")
    bounded = BoundedModel(model, max_memory=max_memory)
    dtype, model_device = model_dtype_device(model)
    target = model_device or torch.device(device)
    runner = Runner("certified robustness", device=target, batch_size=batch_size, shard=shard, task="single-label")
    guard = runner.guard("certified robustness: model on the inputs")
    attack_guard = runner.guard("certified robustness: model on PGD attack points")
    # the engine keeps the counterexamples' points, so it is built on the first batch (when their shape is known)
    state: dict[str, Any] = {"engine": None, "dtype": None}

    def step(batch: Any) -> None:
        x, y = batch.x, batch.y
        if y is None:
            raise DataError("certified robustness needs labelled data (x, y): the data has no labels. Fix: give "
                            "(inputs, labels) pairs, a TensorDataset with labels, or {'x': ..., 'y': ...}.")
        if dtype is not None:
            x = x.to(dtype)
        if state["engine"] is None:
            state["engine"] = VerificationEngine(eps, method, device=target, input_shape=tuple(x.shape[1:]))
            state["dtype"] = x.dtype
        engine: VerificationEngine = state["engine"]
        with torch.no_grad():
            logits = guard(model, x)
        n_classes = logits.shape[1]
        engine.observe(y, outside_clip(x, clip))
        y = y.clamp(0, n_classes - 1)  # an out-of-range label is reported after the loop
        pred = logits.argmax(dim=1)
        wrong = pred != y
        # the rows whose box is a proper ball (finite, inside clip); a bad one is reported after the loop, and its
        # bounds, meaningless, must not trip the soundness checks first
        valid = torch.isfinite(x).flatten(1).all(dim=1)
        if clip is not None:
            valid &= ((x >= clip[0]) & (x <= clip[1])).flatten(1).all(dim=1)
        lo, hi = input_box(x, eps, clip, check=False)
        mismatch = export_mismatch(bounded.model, x, logits)  # a .pt2/.onnx: its translated graph must give its logits
        if mismatch is not None:
            onnx = is_onnx_model(model)
            what, own = ("ONNX graph", "onnxruntime") if onnx else ("torch.export program", "the program")
            runner.flag("export", valid & mismatch, batch, f"certified robustness: on batch {{first}} the translated "
                        f"graph of the {what} computes other logits than {own}, so its bounds would not be about the "
                        f"artifact. Fix: please report this with the model file; meanwhile use the attack-based "
                        f"robustness gates.")
        # IBP for every input first (a few model passes), then, unless method="ibp", the attack on the inputs left
        # undecided, and the tighter bounds only on those it does not falsify ("attacks first")
        margins = bounded.margin_lower_bounds(lo, hi, y, "ibp", check=False)
        verified = margins.min(dim=1).values > 0
        falsified = wrong.clone()
        found = x.clone()
        found_pred = pred.clone()
        used = torch.zeros_like(y, dtype=torch.int8)  # the tightest bound each input got: 0 ibp, 1 crown-ibp, 2 crown
        # Only the undecided inputs are attacked: selecting them reads their count (a host sync per batch),
        # which spares PGD on every verified or already misclassified input.
        todo = torch.nonzero(~verified & ~wrong).squeeze(1)
        rest, at_attack = todo, None
        if attack_steps > 0 and todo.numel():
            from pytest_dnnsafety.engines.perturb.adversarial import pgd

            gen = torch.Generator().manual_seed(seed + batch.index)
            xa = pgd(model, x[todo], y[todo], eps, gen, norm="linf", steps=attack_steps, clip=clip, loss="margin",
                     guard=attack_guard)
            xa = torch.minimum(torch.maximum(xa.detach(), lo[todo].to(xa.dtype)), hi[todo].to(xa.dtype))
            with torch.no_grad():
                la = attack_guard(model, xa)
            pa = la.argmax(dim=1)
            hit = pa != y[todo]
            # scattered by the (long) indices todo, not a boolean mask (which would read its count on the host)
            falsified[todo] = falsified[todo] | hit
            found[todo] = torch.where(hit.reshape((-1,) + (1,) * (xa.ndim - 1)), xa.to(found.dtype), found[todo])
            found_pred[todo] = torch.where(hit, pa, found_pred[todo])
            if method != "ibp":
                kept = torch.nonzero(~hit).squeeze(1)  # a second host sync: the inputs left to bound
                rest = todo[kept]
                at_attack = (la.gather(1, y[todo][:, None]) - la)[kept].detach()  # margins at their attack points
        if method != "ibp" and rest.numel():
            codes: list[Tensor] = []
            tight = bounded.margin_lower_bounds(lo[rest], hi[rest], y[rest], method, check=False, used=codes)
            margins[rest] = torch.maximum(margins[rest], tight)
            used[rest] = torch.cat(codes).to(used.device)
            if at_attack is not None:  # a sound lower bound holds at every point of the ball, the attack's too
                runner.flag("unsound", valid[rest, None] & torch.isfinite(tight)
                            & (tight > at_attack + 1e-4 * (1 + at_attack.abs())), batch, UNSOUND)
        clean = logits.detach().gather(1, y[:, None]) - logits.detach()  # the margins at x itself
        runner.flag("unsound", valid[:, None] & torch.isfinite(margins) & (margins > clean + 1e-4 * (1 + clean.abs())),
                    batch, UNSOUND)
        worst = margins.min(dim=1).values
        verified = worst > 0
        runner.flag("overlap", valid & verified & falsified, batch,
                    "certified robustness: internal error: PGD found a misclassified point in the ball of an input "
                    "the bounds verify (unsound bounds; first in batch {first}). Please report this with the model.")
        verdicts = torch.full_like(y, UNKNOWN).masked_fill_(verified, VERIFIED).masked_fill_(falsified, FALSIFIED)
        engine.update(verdicts, worst, used)
        engine.add_counterexamples(batch.rows, falsified, y, found_pred, wrong,
                                   (found - x).flatten(1).abs().amax(dim=1), found)

    runner.run(data, step, lambda: state["engine"])  # built on the first batch
    engine: VerificationEngine = state["engine"]  # built: an empty pass raised in run
    outside, label_lo, label_hi = torch.stack([engine.outside_clip, engine.label_min, engine.label_max]).tolist()
    if outside:
        raise outside_clip_error(int(outside), clip)
    n_classes = guard.num_classes or 0
    if label_lo < 0 or label_hi >= n_classes:
        raise DataError(f"labels range over {label_lo}..{label_hi}, outside [0, {n_classes}) (the model has "
                        f"{n_classes} classes). Fix: give class indices 0..{n_classes - 1} matching the model's "
                        f"outputs.")
    result = engine.compute()
    points = tuple(point.to(state["dtype"]) for point in result.counterexample_inputs)
    return dataclasses.replace(result, clip=clip, attack_steps=attack_steps, counterexample_inputs=points)
