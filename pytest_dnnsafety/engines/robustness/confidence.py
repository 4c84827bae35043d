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

from pytest_dnnsafety.errors import ConfigError, DataError, DnnSafetyError, MetricError
from pytest_dnnsafety.engines.core.guard import ForwardGuard, eval_mode, model_dtype_device
from pytest_dnnsafety.engines.core.base import Engine, topk
from pytest_dnnsafety.engines.core.budget import chunk_size, spans
from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.engines.core.runner import Runner
from pytest_dnnsafety.engines.perturb.adversarial import OUTPUTS, check_clip, detect_outputs, log_probs
from pytest_dnnsafety.engines.robustness.perturbations import family_name

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

    States: ``sum`` of ``n``, ``clean_correct``, ``all_correct`` (int64), and per family
    ``robust_correct`` and ``argworst`` (int64); ``drops``, a ``cat`` state of one float64 row per
    input (its index, its worst drop, its drop under each family: ``8 (F + 2)`` bytes an input),
    summed in index order by :meth:`compute`, so the means are the same bit for bit whatever the
    batch split, the merge order or the ranks;
    ``label_counts`` (``sum``, one per class of ``n_classes``: the chance accuracy); the data's
    range, for the checks after the pass: ``input_min``/``input_max`` (float64) and
    ``label_min``/``label_max`` (int64); and ``worst``, the :data:`WORST_INPUTS` inputs with the
    largest worst-family drop (a ``topk`` state of rows ``drop, index, family, p_clean,
    p_perturbed``, ties broken by the input's index, so the rows kept do not depend on the batch
    split or the ranks).
    """

    def __init__(self, n_families: int, n_classes: int = 0, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        if isinstance(n_families, bool) or not isinstance(n_families, int) or n_families < 1:
            raise ValueError(f"n_families={n_families!r}: M_adv needs at least one perturbation family")
        if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < 0:
            raise ValueError(f"n_classes={n_classes!r} is not a count of classes (0: no label counts)")
        self.n_families = n_families
        self.n_classes = n_classes
        i64, f64 = torch.int64, torch.float64
        self.add_state("n", torch.zeros((), dtype=i64), "sum")
        self.add_state("clean_correct", torch.zeros((), dtype=i64), "sum")
        self.add_state("drops", torch.zeros(0, n_families + 2, dtype=f64), "cat")
        self.add_state("robust_correct", torch.zeros(n_families, dtype=i64), "sum")
        self.add_state("all_correct", torch.zeros((), dtype=i64), "sum")
        self.add_state("argworst", torch.zeros(n_families, dtype=i64), "sum")
        self.add_state("label_counts", torch.zeros(n_classes, dtype=i64), "sum")
        self.add_state("input_min", torch.tensor(math.inf, dtype=f64), "min")
        self.add_state("input_max", torch.tensor(-math.inf, dtype=f64), "max")
        self.add_state("label_min", torch.tensor(torch.iinfo(i64).max, dtype=i64), "min")
        self.add_state("label_max", torch.tensor(torch.iinfo(i64).min, dtype=i64), "max")
        self.add_state("worst", torch.zeros(0, 5, dtype=f64), topk(WORST_INPUTS, key=0, tie_break=1))

    def config(self) -> dict[str, Any]:
        return {"n_families": self.n_families, "n_classes": self.n_classes}

    def update(self, p_clean: Tensor, p_pert: Tensor, correct_clean: Tensor, correct_pert: Tensor, *,
               rows: Tensor | None = None, labels: Tensor | None = None, inputs: Tensor | None = None) -> None:
        """Fold a batch in: true-class probabilities clean ``(N,)`` and per family ``(F, N)``, and correctness.

        ``rows``: each input's index in the data (default: the order of arrival); ``labels``: the
        batch's class labels (their range, and their counts with ``n_classes``); ``inputs``: the
        batch (its range). No host synchronisation.
        """
        f = self.n_families
        if p_pert.ndim != 2 or p_pert.shape[0] != f or p_clean.shape != (p_pert.shape[1],):
            raise ValueError(f"update needs p_clean (N,) and p_pert ({f}, N); got {tuple(p_clean.shape)} and "
                             f"{tuple(p_pert.shape)}")
        if correct_clean.shape != p_clean.shape or correct_pert.shape != p_pert.shape:
            raise ValueError(f"update needs correct_clean {tuple(p_clean.shape)} and correct_pert "
                             f"{tuple(p_pert.shape)}; got {tuple(correct_clean.shape)} and {tuple(correct_pert.shape)}")
        dev = self.device
        n = p_clean.shape[0]
        if rows is None:
            rows = self.n + torch.arange(n, device=dev)
        p_clean = p_clean.detach().to(dev, torch.float64)
        p_pert = p_pert.detach().to(dev, torch.float64)
        drops = p_clean.unsqueeze(0) - p_pert  # (F, N)
        correct_clean = correct_clean.to(dev, torch.bool)
        correct_pert = correct_pert.to(dev, torch.bool)
        worst, which = drops.max(dim=0)
        self.n = self.n + n
        self.clean_correct = self.clean_correct + correct_clean.sum()
        self.robust_correct = self.robust_correct + correct_pert.sum(dim=1)
        self.all_correct = self.all_correct + (correct_clean & correct_pert.all(dim=0)).sum()
        self.argworst = self.argworst.scatter_add(0, which, torch.ones_like(which))
        p_worst = p_pert.gather(0, which[None]).squeeze(0)
        index = rows.to(dev, torch.float64)
        self.append_state("drops", torch.cat([index[:, None], worst[:, None], drops.T], dim=1))
        self.append_state("worst", torch.stack([worst, index, which.to(torch.float64), p_clean, p_worst], dim=1))
        if labels is not None and labels.numel():
            labels = labels.detach().to(dev, torch.int64)
            self.label_min = torch.minimum(self.label_min, labels.amin())
            self.label_max = torch.maximum(self.label_max, labels.amax())
            if self.n_classes:
                clamped = labels.clamp(0, self.n_classes - 1)  # an out-of-range label is the caller's error
                self.label_counts = self.label_counts.index_add(0, clamped, torch.ones_like(clamped))
        if inputs is not None and inputs.numel():
            inputs = inputs.detach()
            self.input_min = torch.minimum(self.input_min, inputs.amin().to(dev, torch.float64))
            self.input_max = torch.maximum(self.input_max, inputs.amax().to(dev, torch.float64))

    def compute(self, family_names: tuple[str, ...] | None = None) -> AdversarialConfidenceResult:
        """M_adv = −(worst-drop sum)/n and the rest (one host sync). Raises MetricError without inputs.

        ``family_names`` name the families in ``worst_inputs`` (default ``family 0``, ...);
        ``chance_accuracy`` is filled when the engine counts labels (``n_classes``).
        """
        n = int(self.n)
        if n == 0:
            raise MetricError("adversarial confidence loss: no inputs were folded in; M_adv (eq. 4) is a mean over "
                              "inputs. Fix: give the gate labelled evaluation data with at least one sample.")
        rows = self.drops.cpu()  # summed on the host in index order: the same sums on every device and split
        sums = rows[torch.sort(rows[:, 0], stable=True).indices, 1:].sum(dim=0).tolist()
        loss = sums[0] / n
        names = tuple(family_names) if family_names else tuple(f"family {i}" for i in range(self.n_families))
        drop, idx, which, pc, pp = self.worst.cpu().T.tolist() if len(self.worst) else ([],) * 5
        worst = tuple({"index": int(i), "family": names[int(w)], "p_clean": float(c), "p_perturbed": float(p),
                       "drop": float(d)} for d, i, w, c, p in zip(drop, idx, which, pc, pp))
        chance = int(self.label_counts.max()) / n if self.n_classes else None
        return AdversarialConfidenceResult(
            n=n,
            m_adv=-loss,
            loss=loss,
            per_family_loss=tuple(v / n for v in sums[1:]),
            robust_accuracy=tuple(float(v) / n for v in self.robust_correct.tolist()),
            robust_accuracy_all=int(self.all_correct) / n,
            clean_accuracy=int(self.clean_correct) / n,
            argworst_counts=tuple(int(v) for v in self.argworst.tolist()),
            family_names=tuple(family_names) if family_names else (),
            worst_inputs=worst,
            chance_accuracy=chance,
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


def checked_families(families: Any, what: str = "adversarial confidence") -> tuple[list[str], list[Any]]:
    """The family names and callables of a ``{name: family}`` mapping; a ConfigError when empty or not callable."""
    if not isinstance(families, Mapping) or not families:
        raise ConfigError(f"{what}: no perturbation families given. Fix: name at least one, e.g. "
                          "families={'fgsm': make_family('fgsm')}.")
    names = [str(name) for name in families]
    fams = list(families.values())
    for name, fam in zip(names, fams):
        if not callable(fam):
            raise ConfigError(f"{what}: family {name!r} is {type(fam).__name__}, not a callable "
                              f"f(model, x, y, eps, generator) -> x'.")
    return names, fams


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
    shard: Any = None,
) -> AdversarialConfidenceResult:
    """M_adv (eq. (4)) of ``model`` on labelled ``data`` under ``families`` (name → ``f(model, x, y, eps, gen)``).

    Measured through a :class:`~pytest_dnnsafety.engines.core.runner.Runner`: batches go to the model's
    device (``device`` for a model without parameters); the model runs in eval mode (its mode is
    restored afterwards). Per batch: one clean forward, then per family a generator seeded from
    ``(seed, family index, global batch index)``, the family's output (same shape as ``x``, finite,
    clamped to ``clip``) and one forward on it. Every model query goes through a
    :class:`ForwardGuard`. ``outputs="auto"`` detects logits vs probabilities on the first batch.
    No host synchronisation per batch: the families' finiteness, the guards, the data's range and
    the labels' range are checked once after the loop. A batch larger than the working-memory budget
    allows (:func:`~pytest_dnnsafety.engines.core.budget.chunk_size`, with a backward pass when a family
    takes gradients; ``dnnsafety_max_memory``, 1 GiB by default) is measured in chunks: the same numbers
    (each family's generator is drawn on from chunk to chunk, so a random family's draws depend on the
    chunks only when the budget splits a batch). ``shard``: this torchrun rank's
    :class:`~pytest_dnnsafety.runtime.torchrun.Shard` of the batches (None: all of them); the ranks' states
    are all-reduced, so every rank gets the single-process result.
    """
    names, fams = checked_families(families)
    budgets = _eps_per_family(eps, names)
    clip = check_clip(clip)
    if outputs not in ("auto", *OUTPUTS):
        raise ConfigError(f"adversarial confidence: outputs={outputs!r} is not one of {['auto', *OUTPUTS]}.")
    check_count(batch_size, "batch_size", fix="give a positive batch size, e.g. batch_size=256.")
    _, model_device = model_dtype_device(model)
    target = model_device if model_device is not None else torch.device(device)
    # the sums are float64, which MPS lacks: there they live on the CPU (one copy per batch)
    acc = torch.device("cpu") if target.type == "mps" else target
    runner = Runner("adversarial confidence", device=target, batch_size=batch_size, shard=shard, task="single-label")
    clean_guard = runner.guard("adversarial confidence: model on clean inputs")
    guards = [runner.guard(f"adversarial confidence: model on {name!r} perturbations (eps={e:g})")
              for name, e in zip(names, budgets)]
    # the engine counts labels per class, so it is built on the first batch (when the model's classes are known)
    state: dict[str, Any] = {"outputs": None if outputs == "auto" else outputs, "engine": None, "chunk": None}
    # a family that takes gradients (or a user's callable, which may) needs a backward pass's memory per input
    grad = any(getattr(fam, "gradient", not getattr(fam, "accepts_guard", False)) for fam in fams)

    def step(batch: Any) -> None:
        if batch.y is None:
            raise DataError("adversarial confidence: the data have no labels; M_adv (eq. 4) measures the drop in "
                            "the true class's probability. Fix: give labelled data (x, y).")
        if state["chunk"] is None:  # measured on the first batch: 3 copies of an input held beside the model's pass
            held = 3 * batch.x[0].numel() * batch.x.element_size()
            state["chunk"] = chunk_size(model, batch.x, grad=grad, extra=held)
        gens = [torch.Generator().manual_seed(_family_seed(seed, i, batch.index)) for i in range(len(fams))]
        parts = [chunk(batch, batch.x[a:b], batch.y[a:b], gens) for a, b in spans(batch.n, state["chunk"])]
        p_clean, correct_clean = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        p_pert, correct_pert = torch.cat([p[2] for p in parts], 1), torch.cat([p[3] for p in parts], 1)
        state["engine"].update(p_clean, p_pert, correct_clean, correct_pert, rows=batch.rows, labels=batch.y,
                               inputs=batch.x)

    def chunk(batch: Any, x: Tensor, y: Tensor, gens: list[torch.Generator]) -> tuple[Tensor, ...]:
        with torch.no_grad():
            out = clean_guard(model, x)
        if state["outputs"] is None:
            state["outputs"] = detect_outputs(out)
        resolved = state["outputs"]
        classes = out.shape[1]
        if state["engine"] is None:
            state["engine"] = AdversarialConfidenceEngine(len(fams), n_classes=classes, device=acc)
        ys = y.clamp(0, classes - 1)  # an out-of-range label is reported after the loop
        with torch.no_grad():
            p_clean = log_probs(out, resolved).gather(1, ys[:, None]).squeeze(1).exp()
            correct_clean = out.argmax(dim=1) == y
        p_pert, correct_pert = [], []
        for i, (name, fam) in enumerate(zip(names, fams)):
            xp = _run_family(fam, name, model, x, ys, budgets[i], gens[i], guards[i], resolved)
            runner.flag(f"family {i}", ~torch.isfinite(xp), batch,
                        f"adversarial confidence: perturbation family {name!r} returned NaN/inf values in {{count}} "
                        "batch(es), the first being batch {first}. Fix: the family must return finite inputs (check "
                        "a user-written transformer for divisions by zero or log of 0).")
            if clip is not None:
                xp = xp.clamp(clip[0], clip[1])
            with torch.no_grad():
                po = guards[i](model, xp)
                p_pert.append(log_probs(po, resolved).gather(1, ys[:, None]).squeeze(1).exp())
                correct_pert.append(po.argmax(dim=1) == y)
        return p_clean, correct_clean, torch.stack(p_pert), torch.stack(correct_pert)

    with eval_mode(model):
        runner.run(data, step, lambda: state["engine"])  # built on the first batch
    engine: AdversarialConfidenceEngine = state["engine"]  # built: an empty pass raised in run
    # one host sync for the checks of the data's range (all ranks' data under a shard)
    x_lo, x_hi, lab_lo, lab_hi = torch.stack([engine.input_min, engine.input_max, engine.label_min.double(),
                                              engine.label_max.double()]).tolist()
    if clip is not None and not (x_lo >= clip[0] and x_hi <= clip[1]):
        raise DataError(f"adversarial confidence: the data lie in [{x_lo:g}, {x_hi:g}], outside the valid input range "
                        f"clip=({clip[0]:g}, {clip[1]:g}); the perturbations are clamped to that range, so they would "
                        f"move inputs beyond ε. Fix: scale the data into the range or set the clip range to the "
                        f"data's.")
    classes = engine.n_classes
    if lab_lo < 0 or lab_hi >= classes:
        raise DataError(f"adversarial confidence: labels range over [{int(lab_lo)}, {int(lab_hi)}] but the model has "
                        f"{classes} classes. Fix: give class indices 0..{classes - 1}.")
    return replace(engine.compute(tuple(names)), eps=tuple(budgets))


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
