"""Adversarial confidence loss M_adv (Cheng et al. 2018, §II-D, eq. (4)).

Eq. (4)::

    M_adv := Σ_{in ∈ In} min_{i ∈ {1..N}} [NN(T_i(in, ε)) − NN(in)] / |In|

with ``NN(in)`` the model's probability of the true class and ``T_1..T_N`` the perturbation
families (:mod:`.perturbations`). Per input the worst family is the one with the largest drop
``NN(in) − NN(T_i(in, ε))``; M_adv is minus the mean worst drop (≤ 0 for any sensible set of
families), and the *loss* reported is ``−M_adv``. Paper example (Fig. 3a): FGSM moves the
probability of "car" from 0.91 to 0.69, so that image contributes ``−0.22``.

:class:`AdversarialConfidenceEngine` holds the sums (pure torch, no host sync in ``update``);
:func:`assess_adversarial_confidence` runs a model, data and families through it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ... import progress
from ...data import iter_batches, known_length
from ...errors import ConfigError, DataError, DnnSafetyError, MetricError
from ...outputs import ForwardGuard, eval_mode, model_dtype_device
from ..base import Engine
from .attacks import OUTPUTS, check_clip, detect_outputs, log_probs
from .perturbations import family_name

__all__ = ["AdversarialConfidenceEngine", "AdversarialConfidenceResult", "assess_adversarial_confidence"]

#: How many of the largest drops the runner reports.
WORST_INPUTS = 5


@dataclass(frozen=True)
class AdversarialConfidenceResult:
    """M_adv over ``n`` inputs (eq. (4)), per-family losses and robust accuracies.

    ``m_adv`` = mean over inputs of ``min_i [p_i − p_clean]`` (true-class probabilities);
    ``loss = −m_adv``. ``per_family_loss[i]`` = mean drop under family i alone;
    ``robust_accuracy[i]`` = accuracy on family i's outputs; ``robust_accuracy_all`` = share of
    inputs correct clean *and* under every family; ``argworst_counts[i]`` = inputs on which family
    i gave the largest drop (ties: the first family). ``family_names``, ``eps`` and
    ``worst_inputs`` (up to 5 dicts ``index, family, p_clean, p_perturbed, drop``, largest drop
    first) are filled by :func:`assess_adversarial_confidence`, and so is ``chance_accuracy``: the share
    of the most frequent label, the clean accuracy a model that ignores its input can reach (a clean
    accuracy not above it means the true-class probabilities ``NN(in)`` of eq. (4) carry no signal, so
    their drop is meaningless; the gate makes that inconclusive).
    """

    n: int
    m_adv: float
    loss: float
    per_family_loss: tuple[float, ...]
    robust_accuracy: tuple[float, ...]
    robust_accuracy_all: float
    clean_accuracy: float
    argworst_counts: tuple[int, ...]
    family_names: tuple[str, ...] = ()
    eps: tuple[float, ...] = ()
    worst_inputs: tuple[dict[str, Any], ...] = ()
    chance_accuracy: float | None = None

    def _names(self) -> tuple[str, ...]:
        if len(self.family_names) == len(self.per_family_loss):
            return self.family_names
        return tuple(f"family {i}" for i in range(len(self.per_family_loss)))

    @property
    def worst_family(self) -> str:
        """The family that was the worst on most inputs."""
        counts = self.argworst_counts
        return self._names()[max(range(len(counts)), key=lambda i: (counts[i], -i))] if counts else ""

    def detail(self) -> str:
        """``loss 0.123 (worst pgd on 61% of inputs); robust accuracy all 0.71; clean 0.98, n=539``."""
        share = max(self.argworst_counts) / self.n if self.n and self.argworst_counts else 0.0
        return (f"loss {self.loss:.3f} (worst {self.worst_family} on {share:.0%} of inputs); robust accuracy all "
                f"{self.robust_accuracy_all:.2f}; clean {self.clean_accuracy:.2f}, n={self.n}")

    def summary(self) -> str:
        """One line: ``M_adv -0.123 (loss 0.123 …)``."""
        return f"M_adv {self.m_adv:.3f} ({self.detail()})"

    def to_details(self) -> dict[str, object]:
        """JSON-able details (plain str/int/float/list/dict only; NaN/inf as the strings 'nan', 'inf').

        Per-family values twice: as ``{family: value}`` dicts (``per_family_loss``,
        ``robust_accuracy``, ``argworst_counts``, ``eps``) and as the rows of ``families``.
        """
        names = self._names()
        eps = self.eps if len(self.eps) == len(names) else (None,) * len(names)
        return {
            "metric": "adversarial_confidence_loss",
            "n": int(self.n),
            "m_adv": _json_float(self.m_adv),
            "loss": _json_float(self.loss),
            "clean_accuracy": _json_float(self.clean_accuracy),
            "chance_accuracy": None if self.chance_accuracy is None else _json_float(self.chance_accuracy),
            "robust_accuracy_all": _json_float(self.robust_accuracy_all),
            "worst_family": self.worst_family,
            "per_family_loss": {name: _json_float(v) for name, v in zip(names, self.per_family_loss)},
            "robust_accuracy": {name: _json_float(v) for name, v in zip(names, self.robust_accuracy)},
            "argworst_counts": {name: int(v) for name, v in zip(names, self.argworst_counts)},
            "eps": {name: (None if e is None else _json_float(e)) for name, e in zip(names, eps)},
            "families": [
                {
                    "name": name,
                    "eps": None if e is None else _json_float(e),
                    "loss": _json_float(loss),
                    "robust_accuracy": _json_float(acc),
                    "argworst_count": int(count),
                }
                for name, e, loss, acc, count in zip(
                    names, eps, self.per_family_loss, self.robust_accuracy, self.argworst_counts)
            ],
            "worst_inputs": [
                {key: (_json_float(v) if isinstance(v, float) else v) for key, v in item.items()}
                for item in self.worst_inputs
            ],
        }


def _json_float(value: float) -> float | str:
    value = float(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


class AdversarialConfidenceEngine(Engine):
    """Sums for M_adv (eq. (4)) over ``n_families`` perturbation families; see the module docstring.

    States (all ``sum``): ``n``, ``clean_correct``, ``all_correct`` (int64), ``worst_drop_sum``
    (float64), and per family ``drop_sum`` (float64), ``robust_correct`` and ``argworst`` (int64).
    """

    def __init__(self, n_families: int, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        if isinstance(n_families, bool) or not isinstance(n_families, int) or n_families < 1:
            raise ValueError(f"n_families={n_families!r}: M_adv needs at least one perturbation family")
        self.n_families = n_families
        i64, f64 = torch.int64, torch.float64
        self.add_state("n", torch.zeros((), dtype=i64), "sum")
        self.add_state("clean_correct", torch.zeros((), dtype=i64), "sum")
        self.add_state("worst_drop_sum", torch.zeros((), dtype=f64), "sum")
        self.add_state("drop_sum", torch.zeros(n_families, dtype=f64), "sum")
        self.add_state("robust_correct", torch.zeros(n_families, dtype=i64), "sum")
        self.add_state("all_correct", torch.zeros((), dtype=i64), "sum")
        self.add_state("argworst", torch.zeros(n_families, dtype=i64), "sum")

    def config(self) -> dict[str, Any]:
        return {"n_families": self.n_families}

    def update(self, p_clean: Tensor, p_pert: Tensor, correct_clean: Tensor, correct_pert: Tensor) -> None:
        """Fold a batch in: true-class probabilities clean ``(N,)`` and per family ``(F, N)``, and correctness.

        No host synchronisation.
        """
        f = self.n_families
        if p_pert.ndim != 2 or p_pert.shape[0] != f or p_clean.shape != (p_pert.shape[1],):
            raise ValueError(f"update needs p_clean (N,) and p_pert ({f}, N); got {tuple(p_clean.shape)} and "
                             f"{tuple(p_pert.shape)}")
        if correct_clean.shape != p_clean.shape or correct_pert.shape != p_pert.shape:
            raise ValueError(f"update needs correct_clean {tuple(p_clean.shape)} and correct_pert "
                             f"{tuple(p_pert.shape)}; got {tuple(correct_clean.shape)} and {tuple(correct_pert.shape)}")
        dev = self.device
        p_clean = p_clean.detach().to(dev, torch.float64)
        drops = p_clean.unsqueeze(0) - p_pert.detach().to(dev, torch.float64)  # (F, N)
        correct_clean = correct_clean.to(dev, torch.bool)
        correct_pert = correct_pert.to(dev, torch.bool)
        worst, which = drops.max(dim=0)
        self.n = self.n + p_clean.shape[0]
        self.clean_correct = self.clean_correct + correct_clean.sum()
        self.worst_drop_sum = self.worst_drop_sum + worst.sum()
        self.drop_sum = self.drop_sum + drops.sum(dim=1)
        self.robust_correct = self.robust_correct + correct_pert.sum(dim=1)
        self.all_correct = self.all_correct + (correct_clean & correct_pert.all(dim=0)).sum()
        self.argworst = self.argworst.scatter_add(0, which, torch.ones_like(which))

    def compute(self) -> AdversarialConfidenceResult:
        """M_adv = −(worst-drop sum)/n and the rest (one host sync). Raises MetricError without inputs."""
        n = int(self.n)
        if n == 0:
            raise MetricError("adversarial confidence loss: no inputs were folded in; M_adv (eq. 4) is a mean over "
                              "inputs. Fix: give the gate labelled evaluation data with at least one sample.")
        loss = float(self.worst_drop_sum) / n
        return AdversarialConfidenceResult(
            n=n,
            m_adv=-loss,
            loss=loss,
            per_family_loss=tuple(float(v) / n for v in self.drop_sum.tolist()),
            robust_accuracy=tuple(float(v) / n for v in self.robust_correct.tolist()),
            robust_accuracy_all=int(self.all_correct) / n,
            clean_accuracy=int(self.clean_correct) / n,
            argworst_counts=tuple(int(v) for v in self.argworst.tolist()),
        )


# ----------------------------------------------------------------------------- runner


def _family_seed(seed: int, family: int, batch: int) -> int:
    """A 63-bit seed mixed from (seed, family index, batch index) by numpy's SeedSequence."""
    state = np.random.SeedSequence([int(seed) & (2**63 - 1), family, batch]).generate_state(1, np.uint64)[0]
    return int(state) & (2**63 - 1)


def _eps_per_family(eps: float | Mapping[str, float], names: list[str]) -> list[float]:
    if isinstance(eps, Mapping):
        missing = [name for name in names if name not in eps]
        extra = sorted(str(k) for k in eps if k not in names)
        if missing or extra:
            raise ConfigError(
                f"adversarial confidence: eps per family must name exactly the families {names}; "
                + (f"missing {missing}" if missing else "") + ("; " if missing and extra else "")
                + (f"unknown {extra}" if extra else "") + ". Fix: give one eps per family (or a single number).")
        values = [(name, eps[name]) for name in names]
    else:
        values = [(name, eps) for name in names]
    out = []
    for name, value in values:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
            raise ConfigError(f"adversarial confidence: eps={value!r} for family {name!r} is not a finite positive "
                              f"number. Fix: give the perturbation budget ε of eq. (4), e.g. eps=0.1 (or a mapping "
                              f"family -> eps).")
        out.append(number)
    return out


def assess_adversarial_confidence(
    model: Any,
    data: Any,
    families: Mapping[str, Callable[..., Tensor]],
    eps: float | Mapping[str, float],
    *,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    seed: int = 0,
    clip: tuple[float, float] | None = None,
    outputs: str = "auto",
) -> AdversarialConfidenceResult:
    """M_adv (eq. (4)) of ``model`` on labelled ``data`` under ``families`` (name → ``f(model, x, y, eps, gen)``).

    Batches go to the model's device (``device`` for a model without parameters); the model runs
    in eval mode (its mode is restored afterwards). Per batch: one clean forward, then per family a
    generator seeded from ``(seed, family index, batch index)``, the family's output (same shape as
    ``x``, finite, clamped to ``clip``) and one forward on it. Every model query goes through a
    :class:`ForwardGuard`. ``outputs="auto"`` detects logits vs probabilities on the first batch.
    No host synchronisation per batch: the data range, label range, family outputs' finiteness
    and the guards are checked once after the loop.
    """
    if not isinstance(families, Mapping) or not families:
        raise ConfigError("adversarial confidence: no perturbation families given. Fix: name at least one, e.g. "
                          "families={'fgsm': make_family('fgsm')}.")
    names = [str(name) for name in families]
    fams = list(families.values())
    for name, fam in zip(names, fams):
        if not callable(fam):
            raise ConfigError(f"adversarial confidence: family {name!r} is {type(fam).__name__}, not a callable "
                              f"f(model, x, y, eps, generator) -> x'.")
    budgets = _eps_per_family(eps, names)
    clip = check_clip(clip)
    if outputs not in ("auto", *OUTPUTS):
        raise ConfigError(f"adversarial confidence: outputs={outputs!r} is not one of {['auto', *OUTPUTS]}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"adversarial confidence: batch_size={batch_size!r} is not a positive integer.")
    _, model_device = model_dtype_device(model)
    target = model_device if model_device is not None else torch.device(device)
    nf = len(fams)
    # the sums are float64, which MPS lacks: there they live on the CPU (one copy per batch)
    acc = torch.device("cpu") if target.type == "mps" else target
    engine = AdversarialConfidenceEngine(nf, device=acc)
    clean_guard = ForwardGuard("adversarial confidence: model on clean inputs")
    guards = [ForwardGuard(f"adversarial confidence: model on {name!r} perturbations (eps={e:g})")
              for name, e in zip(names, budgets)]
    resolved = None if outputs == "auto" else outputs
    lo = hi = y_lo = y_hi = label_counts = None
    nonfinite = torch.zeros(nf, dtype=torch.int64, device=target)
    first_bad = torch.full((nf,), -1, dtype=torch.int64, device=target)
    top = None  # (drop, index, family, p_clean, p_pert), up to WORST_INPUTS, on the device
    total, done, batches = known_length(data) or 0, 0, 0
    with eval_mode(model):
        for b, (x, y) in enumerate(iter_batches(data, batch_size)):
            if y is None:
                raise DataError("adversarial confidence: the data have no labels; M_adv (eq. 4) measures the drop in "
                                "the true class's probability. Fix: give labelled data (x, y).")
            if y.shape != (x.shape[0],):
                raise DataError(f"adversarial confidence: labels of shape {tuple(y.shape)} for inputs of shape "
                                f"{tuple(x.shape)}; expected one class index per input.")
            # asynchronous copies towards an accelerator (a device-to-host copy must stay blocking)
            x = x.to(target, non_blocking=target.type != "cpu")
            if not x.is_floating_point():
                x = x.to(torch.float32)
            y = y.to(target, torch.int64, non_blocking=target.type != "cpu")
            n = x.shape[0]
            # running ranges, checked after the loop (one host sync)
            xmin, xmax, ymin, ymax = x.amin(), x.amax(), y.amin(), y.amax()
            lo = xmin if lo is None else torch.minimum(lo, xmin)
            hi = xmax if hi is None else torch.maximum(hi, xmax)
            y_lo = ymin if y_lo is None else torch.minimum(y_lo, ymin)
            y_hi = ymax if y_hi is None else torch.maximum(y_hi, ymax)
            with torch.no_grad():
                out = clean_guard(model, x)
            if resolved is None:
                resolved = detect_outputs(out)
            classes = out.shape[1]
            ys = y.clamp(0, classes - 1)  # an out-of-range label is reported after the loop
            if label_counts is None:  # per-class label counts: the chance accuracy, read after the loop
                label_counts = torch.zeros(classes, dtype=torch.int64, device=target)
            label_counts.index_add_(0, ys, torch.ones_like(ys))
            with torch.no_grad():
                p_clean = log_probs(out, resolved).gather(1, ys[:, None]).squeeze(1).exp()
                correct_clean = out.argmax(dim=1) == y
            p_pert, correct_pert = [], []
            for i, (name, fam) in enumerate(zip(names, fams)):
                gen = torch.Generator().manual_seed(_family_seed(seed, i, b))
                xp = _run_family(fam, name, model, x, ys, budgets[i], gen, guards[i], resolved)
                bad = (~torch.isfinite(xp)).any()
                nonfinite[i] += bad.to(torch.int64)
                first_bad[i] = torch.where(bad & (first_bad[i] < 0), torch.full_like(first_bad[i], b), first_bad[i])
                if clip is not None:
                    xp = xp.clamp(clip[0], clip[1])
                with torch.no_grad():
                    po = guards[i](model, xp)
                    p_pert.append(log_probs(po, resolved).gather(1, ys[:, None]).squeeze(1).exp())
                    correct_pert.append(po.argmax(dim=1) == y)
            pp = torch.stack(p_pert)
            engine.update(p_clean, pp, correct_clean, torch.stack(correct_pert))
            top = _merge_top(top, p_clean.detach().to(acc), pp.detach().to(acc), done)
            done += n
            batches += 1
            progress.tick(done, total, "inputs")
    if batches == 0 or done == 0:
        raise DataError("adversarial confidence: no inputs: the data set is empty. Fix: provide labelled evaluation "
                        "data with at least one sample.")
    # one host sync for all the after-the-loop checks
    checks = torch.stack([lo.to(torch.float64), hi.to(torch.float64), y_lo.to(torch.float64),
                          y_hi.to(torch.float64)]).tolist()
    x_lo, x_hi, lab_lo, lab_hi = checks
    if clip is not None and not (x_lo >= clip[0] and x_hi <= clip[1]):
        raise DataError(f"adversarial confidence: the data lie in [{x_lo:g}, {x_hi:g}], outside the valid input range "
                        f"clip=({clip[0]:g}, {clip[1]:g}); the perturbations are clamped to that range, so they would "
                        f"move inputs beyond ε. Fix: scale the data into the range or set the clip range to the "
                        f"data's.")
    classes = clean_guard.num_classes or 0
    if lab_lo < 0 or lab_hi >= classes:
        raise DataError(f"adversarial confidence: labels range over [{int(lab_lo)}, {int(lab_hi)}] but the model has "
                        f"{classes} classes. Fix: give class indices 0..{classes - 1}.")
    bad_counts, first = nonfinite.tolist(), first_bad.tolist()
    for name, count, at in zip(names, bad_counts, first):
        if count:
            raise MetricError(f"adversarial confidence: perturbation family {name!r} returned NaN/inf values in "
                              f"{count} batch(es), the first being batch {at}. Fix: the family must return finite "
                              f"inputs (check a user-written transformer for divisions by zero or log of 0).")
    clean_guard.check()
    for guard in guards:
        guard.check()
    result = engine.compute()
    chance = int(label_counts.max()) / result.n if label_counts is not None else None
    return replace(result, family_names=tuple(names), eps=tuple(budgets), worst_inputs=_worst_list(top, names),
                   chance_accuracy=chance)


def _run_family(fam: Any, name: str, model: Any, x: Tensor, y: Tensor, eps: float, gen: torch.Generator,
                guard: ForwardGuard, outputs: str) -> Tensor:
    """Call one family and check its output's type and shape (finiteness is checked after the loop)."""
    kwargs = {"guard": guard, "outputs": outputs} if getattr(fam, "accepts_guard", False) else {}
    try:
        xp = fam(model, x, y, eps, gen, **kwargs)
    except DnnSafetyError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise MetricError(f"adversarial confidence: perturbation family {name!r} ({family_name(fam)}) raised "
                          f"{type(exc).__name__}: {text[0] if text else ''}. Fix: a family is called as "
                          f"f(model, x, y, eps, generator) and returns a tensor of x's shape.") from exc
    if not isinstance(xp, Tensor):
        raise MetricError(f"adversarial confidence: perturbation family {name!r} returned {type(xp).__name__}, not a "
                          f"tensor. Fix: return the perturbed batch as a tensor of x's shape {tuple(x.shape)}.")
    if xp.shape != x.shape:
        raise MetricError(f"adversarial confidence: perturbation family {name!r} returned shape {tuple(xp.shape)} for "
                          f"inputs of shape {tuple(x.shape)}. Fix: return one perturbed input per input, in x's "
                          f"shape.")
    return xp.detach().to(device=x.device, dtype=x.dtype)


def _merge_top(top: tuple[Tensor, ...] | None, p_clean: Tensor, p_pert: Tensor, offset: int) -> tuple[Tensor, ...]:
    """Merge this batch's per-input worst drops into the running top-k (on the device, no host sync)."""
    drops = p_clean.unsqueeze(0).to(torch.float64) - p_pert.to(torch.float64)
    worst, which = drops.max(dim=0)
    n = worst.shape[0]
    idx = torch.arange(offset, offset + n, device=worst.device)
    pp = p_pert.to(torch.float64).gather(0, which[None]).squeeze(0)
    batch = (worst, idx, which, p_clean.to(torch.float64), pp)
    if top is not None:
        batch = tuple(torch.cat([a, b]) for a, b in zip(top, batch))
    values = torch.nan_to_num(batch[0], nan=float("-inf"))
    k = min(WORST_INPUTS, values.shape[0])
    keep = values.topk(k).indices
    return tuple(t[keep] for t in batch)


def _worst_list(top: tuple[Tensor, ...] | None, names: list[str]) -> tuple[dict[str, Any], ...]:
    if top is None:
        return ()
    drop, idx, which, pc, pp = (t.tolist() for t in top)
    return tuple({"index": int(i), "family": names[int(w)], "p_clean": float(c), "p_perturbed": float(p),
                  "drop": float(d)} for d, i, w, c, p in zip(drop, idx, which, pc, pp))
