"""Severity-weighted confusion M_confusion (Cheng et al. 2018, §II-H, Table I).

Not every error is equally bad: confusing a pedestrian with background is worse than the reverse.
A severity matrix ``W`` (K×K, row = true class, column = predicted class, 0 on the diagonal,
non-negative and finite) weighs the confusion matrix ``C`` (counts, N inputs)::

    M_confusion = Σ_ij W_ij C_ij / N          (the expected severity per input)

with the per-pair breakdown ``W_ij C_ij / N`` sorted by contribution (the pairs sum to the value).
With the 0/1 matrix (every error weight 1) it is the error rate.

**Upper confidence bound (sound, method "kl").** For i.i.d. inputs the per-input severity
``S = W[y, ŷ]`` lies in ``[0, M]``, ``M = max W``, with mean ``μ``; ``X = S/M ∈ [0, 1]`` has mean
``p = μ/M``. By convexity of ``t ↦ e^{λt}``, ``e^{λX} ≤ 1 − X + X e^{λ}`` on ``[0, 1]``, so
``E e^{λX} ≤ 1 − p + p e^{λ}`` for every real λ: X's moment generating function is dominated by a
Bernoulli(p)'s. Chernoff's argument (λ < 0) then gives, for ``x ≤ p``, Hoeffding's (1963, Thm 1)
``P(X̄ ≤ x) ≤ exp(−n kl(x, p))`` with the Bernoulli divergence ``kl(x, q) = x ln(x/q) +
(1−x) ln((1−x)/(1−q))``. Put ``U(x̄) = max{q ∈ [x̄, 1] : n kl(x̄, q) ≤ ln(1/α)}``. If ``p > U(X̄)``
then ``X̄ < p`` and ``n kl(X̄, p) > ln(1/α)``; as ``kl(·, p)`` decreases on ``[0, p]`` that is
``X̄ < x*`` with ``n kl(x*, p) = ln(1/α)`` (or impossible), an event of probability at most
``exp(−n kl(x*, p)) = α``. So ``P(μ ≤ M·U(X̄)) ≥ 1 − α`` for *every* distribution of the errors:
no normal approximation, no assumption on the weights. Properties: scale-equivariant (scaling W
scales value and bound alike); with no error it is ``M (1 − α^{1/n})``, exactly the
Clopper–Pearson zero-failure bound when W is 0/1; by Pinsker (``kl ≥ 2 (x − q)²``) never above
Hoeffding's additive bound ``x̄ + M √(ln(1/α) / 2n)`` (method ``"hoeffding"``, kept for comparison).
It is conservative when most error weight is far below ``M`` (the price of a distribution-free proof).
The inverse is found by bisection, returning the upper end of the bracket (never below the root).

State: ``confusion`` (K×K int64, reduce ``sum``) and ``out_of_range`` (int64, inputs whose label or
prediction is not a class index; ``compute`` refuses them). ``update`` is one scatter-add per batch
with no host sync. :class:`SeverityMatrix` loads W from a TOML or CSV file, a nested dict with class
names, or a tensor; a pair that the file or dict does not list gets ``default`` (1.0: an error that
nobody rated still counts as one plain error, so forgetting a pair never hides it; give 0 to ignore it).
Pure torch, no pytest import.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.files.parsing import loads_toml

__all__ = ["SeverityMatrix", "WeightedConfusionEngine", "WeightedConfusionResult", "kl_upper",
           "severity_upper_bound", "BOUND_METHODS", "DEFAULT_WEIGHT"]

#: Upper-bound methods: "kl" (Hoeffding's Chernoff–KL bound, the default) and "hoeffding" (additive).
BOUND_METHODS = ("kl", "hoeffding")
#: Weight of an off-diagonal pair a file or dict does not list.
DEFAULT_WEIGHT = 1.0
_ARROW = "->"
_TOML_KEYS = ("classes", "default", "severity", "matrix")


# ----------------------------------------------------------------------------- the bound
def kl_upper(mean: Tensor | float, n: Tensor | int, confidence: float, *, iterations: int = 80) -> Tensor:
    """``max{q ∈ [x, 1] : n·kl(x, q) ≤ ln(1/(1−confidence))}`` for means ``x`` in [0, 1] (vectorised)."""
    x = torch.as_tensor(mean, dtype=torch.float64).clamp(0.0, 1.0)
    n = torch.as_tensor(n, dtype=torch.float64)
    budget = math.log(1.0 / (1.0 - confidence)) / n
    lo, hi = x.clone(), torch.ones_like(x)
    xlogx = torch.special.xlogy(x, x) + torch.special.xlogy(1 - x, 1 - x)
    for _ in range(iterations):  # bisection: a fixed number of halvings of every bracket at once
        mid = (lo + hi) / 2
        kl = xlogx - torch.special.xlogy(x, mid) - torch.special.xlogy(1 - x, 1 - mid)
        inside = kl <= budget
        lo, hi = torch.where(inside, mid, lo), torch.where(inside, hi, mid)
    return torch.where(x >= 1, torch.ones_like(x), hi)


def severity_upper_bound(value: Tensor | float, n: Tensor | int, max_weight: float, confidence: float,
                         method: str = "kl") -> Tensor:
    """Upper confidence bound on the expected severity per input from the observed mean ``value``."""
    if method not in BOUND_METHODS:
        raise ConfigError(f"bound method {method!r} is not one of {BOUND_METHODS}. Fix: use 'kl' (sound, tighter).")
    value = torch.as_tensor(value, dtype=torch.float64)
    if max_weight <= 0:
        return torch.zeros_like(value)
    if method == "hoeffding":
        n = torch.as_tensor(n, dtype=torch.float64)
        return (value + max_weight * torch.sqrt(math.log(1 / (1 - confidence)) / (2 * n))).clamp(max=max_weight)
    return max_weight * kl_upper(value / max_weight, n, confidence)


# ----------------------------------------------------------------------------- the severity matrix
def _fix_names(names: Sequence[Any], what: str) -> tuple[str, ...]:
    out = tuple(str(c) for c in names)
    if len(set(out)) != len(out):
        dup = sorted({c for c in out if out.count(c) > 1})
        raise ConfigError(f"{what}: class names {dup} appear twice. Fix: give each class once.")
    return out


@dataclass(frozen=True, eq=False)
class SeverityMatrix:
    """A validated severity matrix: ``weights`` (K×K float64, true × predicted) and the class names."""

    weights: Tensor
    classes: tuple[str, ...]
    source: str = "tensor"

    def __post_init__(self) -> None:
        w, src = self.weights, self.source
        if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 2:
            raise ConfigError(f"severity matrix from {src} has shape {tuple(w.shape)}; it must be K×K with K ≥ 2 "
                              "(rows: true class, columns: predicted class). Fix: give one row and column per class.")
        if len(self.classes) != w.shape[0]:
            raise ConfigError(f"severity matrix from {src} is {w.shape[0]}×{w.shape[0]} but names "
                              f"{len(self.classes)} classes. Fix: give one class name per row.")
        problems = [(~torch.isfinite(w), "is not finite", "give a finite number"),
                    (w < 0, "is negative", "severities are costs: use a number ≥ 0"),
                    (torch.eye(w.shape[0], dtype=torch.bool) & (w != 0),
                     "is on the diagonal (a correct prediction) and not 0", "set it to 0 or leave it out")]
        for bad, why, fix in problems:
            hits = torch.nonzero(bad)
            if hits.numel():
                i, j = hits[0].tolist()
                more = f" (and {hits.shape[0] - 1} more)" if hits.shape[0] > 1 else ""
                raise ConfigError(f"severity matrix from {src}: entry {self.classes[i]} -> {self.classes[j]} = "
                                  f"{w[i, j].item()!r} {why}{more}. Fix: {fix}.")

    @property
    def num_classes(self) -> int:
        return int(self.weights.shape[0])

    @property
    def max_weight(self) -> float:
        return float(self.weights.max())

    def digest(self) -> str:
        """sha256 of the class names and the weights (for the evidence)."""
        h = hashlib.sha256("\x1f".join(self.classes).encode())
        h.update(self.weights.contiguous().numpy().astype("<f8").tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_tensor(cls, weights: Any, classes: Sequence[Any] | None = None, *,
                    source: str = "tensor") -> SeverityMatrix:
        """From a K×K tensor, array or nested list; ``classes`` default to ``"0" … "K-1"``."""
        try:
            w = torch.as_tensor(np.asarray(weights.detach().cpu() if isinstance(weights, Tensor) else weights,
                                           dtype=np.float64))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"severity matrix from {source} is not a K×K table of numbers ({exc}). Fix: give "
                              "rows of equal length holding numbers.") from None
        names = _fix_names(classes if classes is not None else range(w.shape[0] if w.ndim else 0), source)
        return cls(w.clone(), names, source)

    @classmethod
    def from_mapping(cls, mapping: Mapping[Any, Any], classes: Sequence[Any] | None = None, *,
                     num_classes: int | None = None, default: float = DEFAULT_WEIGHT,
                     source: str = "dict") -> SeverityMatrix:
        """From ``{true: {predicted: w}}`` or ``{"true -> predicted": w}`` (names or int indices).

        Classes are ``classes`` if given, else ``"0" … "K-1"`` with ``K = num_classes``. Pairs not listed
        get ``default``; the diagonal is 0.
        """
        if classes is None and num_classes is None:
            raise ConfigError(f"severity from {source}: the classes are unknown. Fix: give classes=[...] "
                              "(the names in the model's output order).")
        names = _fix_names(classes if classes is not None else range(int(num_classes or 0)), source)
        index = {name: i for i, name in enumerate(names)}

        def find(key: Any, entry: str) -> int:
            if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(names):
                return key
            if isinstance(key, str) and key.strip() in index:
                return index[key.strip()]
            key = key.strip() if isinstance(key, str) else key
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"severity from {source}: entry {entry!r} names unknown class {key!r}{hint}; the "
                              f"classes are {list(names)}. Fix: use one of them, or give classes=[...] in the "
                              "model's output order.")

        pairs: dict[tuple[int, int], float] = {}
        for key, value in mapping.items():
            if isinstance(value, Mapping):
                items = [(key, pred, w, f"{key} -> {pred}") for pred, w in value.items()]
            elif isinstance(key, str) and _ARROW in key:
                true, pred = key.split(_ARROW, 1)
                items = [(true, pred, value, key)]
            else:
                raise ConfigError(f"severity from {source}: entry {key!r} = {value!r} is neither a table "
                                  f"{{predicted: weight}} nor 'true -> predicted' = weight. Fix: write "
                                  f"{{'{key}': {{'other': 2.0}}}} or '{key} -> other' = 2.0.")
            for true, pred, w, entry in items:
                pair = (find(true, entry), find(pred, entry))
                if isinstance(w, bool) or not isinstance(w, (int, float)):
                    raise ConfigError(f"severity from {source}: entry {entry!r} = {w!r} is not a number. "
                                      "Fix: give a number ≥ 0.")
                if pair in pairs:
                    raise ConfigError(f"severity from {source}: the pair {names[pair[0]]} -> {names[pair[1]]} is "
                                      f"given twice (last as {entry!r}). Fix: give it once.")
                pairs[pair] = float(w)
        w = torch.full((len(names), len(names)), float(default), dtype=torch.float64)
        w.fill_diagonal_(0.0)
        if pairs:
            rows, cols = torch.tensor(list(pairs), dtype=torch.int64).T
            w[rows, cols] = torch.tensor(list(pairs.values()), dtype=torch.float64)
        return cls(w, names, source).reordered(classes, num_classes)

    @classmethod
    def from_toml(cls, path: str | Path, classes: Sequence[Any] | None = None, *,
                  num_classes: int | None = None, default: float = DEFAULT_WEIGHT) -> SeverityMatrix:
        """From a TOML file: optional ``classes = [...]`` and ``default = w``, and either a
        ``[severity]`` table (``"true -> predicted" = w`` keys and/or ``[severity.<true>]`` sub-tables)
        or a full ``matrix = [[...], ...]``. The file's ``default`` wins over the argument."""
        path = Path(path)
        try:
            doc = loads_toml(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:  # ValueError: TOMLDecodeError, TooDeep
            raise ConfigError(f"severity file {path} cannot be read as TOML: {exc}. Fix: check the path "
                              "(relative paths start at the rootdir) and the syntax.") from None
        unknown = sorted(set(doc) - set(_TOML_KEYS))
        if unknown or ("severity" in doc) == ("matrix" in doc):
            why = f"has unknown keys {unknown}" if unknown else "must have exactly one of [severity] or matrix"
            raise ConfigError(f"severity file {path} {why}. Fix: use classes = [...], default = 1.0 and either a "
                              "[severity] table (\"true -> predicted\" = w) or matrix = [[...], ...].")
        file_classes = doc.get("classes")
        if file_classes is not None and not (isinstance(file_classes, list) and file_classes):
            raise ConfigError(f"severity file {path}: classes must be a non-empty list of names. Fix: "
                              "classes = [\"cat\", \"dog\", ...].")
        default = doc.get("default", default)
        if isinstance(default, bool) or not isinstance(default, (int, float)):
            raise ConfigError(f"severity file {path}: default = {default!r} is not a number. Fix: default = 1.0.")
        src = str(path)
        if "matrix" in doc:
            names = file_classes if file_classes is not None else classes
            return cls.from_tensor(doc["matrix"], names, source=src).reordered(classes, num_classes)
        if not isinstance(doc["severity"], Mapping):
            raise ConfigError(f"severity file {path}: severity must be a table. Fix: write [severity].")
        if file_classes is None:
            return cls.from_mapping(doc["severity"], classes, num_classes=num_classes, default=default, source=src)
        return cls.from_mapping(doc["severity"], file_classes, default=default, source=src).reordered(
            classes, num_classes)

    @classmethod
    def from_csv(cls, path: str | Path, classes: Sequence[Any] | None = None, *,
                 num_classes: int | None = None, default: float = DEFAULT_WEIGHT) -> SeverityMatrix:
        """From a CSV file: a header row (first cell free, e.g. ``true\\predicted``, then the class names),
        then one row per true class (its name, then the weights). Empty cells and missing rows get
        ``default``; lines starting with ``#`` are comments."""
        path = Path(path)
        try:
            with path.open(newline="", encoding="utf-8") as fh:
                rows = [r for r in csv.reader(fh) if r and any(c.strip() for c in r)
                        and not r[0].lstrip().startswith("#")]
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise ConfigError(f"severity file {path} cannot be read as CSV: {exc}. Fix: check the path "
                              "(relative paths start at the rootdir).") from None
        if not rows or len(rows[0]) < 3:
            raise ConfigError(f"severity file {path} has no header row naming at least two classes. Fix: start "
                              "with a row like 'true\\predicted,cat,dog'.")
        header = [c.strip() for c in rows[0][1:]]
        table: dict[str, dict[str, float]] = {}
        for line, row in enumerate(rows[1:], start=2):
            if len(row) != len(header) + 1:
                raise ConfigError(f"severity file {path}: data row {line - 1} ({row[0]!r}) has {len(row) - 1} "
                                  f"weights for {len(header)} classes. Fix: one cell per header class.")
            cells = {}
            for pred, cell in zip(header, row[1:]):
                if cell.strip():
                    try:
                        cells[pred] = float(cell)
                    except ValueError:
                        raise ConfigError(f"severity file {path}: entry {row[0].strip()} -> {pred} = {cell!r} is "
                                          "not a number. Fix: give a number ≥ 0 or leave the cell empty.") from None
            if row[0].strip() in table:
                raise ConfigError(f"severity file {path}: true class {row[0].strip()!r} has two rows. Fix: one row "
                                  "per class.")
            table[row[0].strip()] = {k: v for k, v in cells.items() if k != row[0].strip() or v != 0}
        return cls.from_mapping(table, header, default=default, source=str(path)).reordered(classes, num_classes)

    @classmethod
    def load(cls, spec: Any, classes: Sequence[Any] | None = None, *, num_classes: int | None = None,
             base_dir: str | Path | None = None, default: float = DEFAULT_WEIGHT) -> SeverityMatrix:
        """From whatever the user gave: a SeverityMatrix, a .toml/.csv path, a dict, or a tensor/array/list."""
        if isinstance(spec, SeverityMatrix):
            return spec.reordered(classes, num_classes)
        if isinstance(spec, (str, Path)):
            path = Path(spec).expanduser()
            path = path if path.is_absolute() or base_dir is None else Path(base_dir) / path
            loader = {".toml": cls.from_toml, ".csv": cls.from_csv}.get(path.suffix.lower())
            if loader is None:
                raise ConfigError(f"severity file {path} must end in .toml or .csv. Fix: use one of the two formats.")
            return loader(path, classes, num_classes=num_classes, default=default)
        if isinstance(spec, Mapping):
            return cls.from_mapping(spec, classes, num_classes=num_classes, default=default)
        return cls.from_tensor(spec, classes, source=type(spec).__name__).reordered(classes, num_classes)

    # ------------------------------------------------------------------ alignment with the model
    def reordered(self, classes: Sequence[Any] | None = None, num_classes: int | None = None) -> SeverityMatrix:
        """This matrix in the order of ``classes`` (the model's output order) and checked against ``num_classes``.

        Names that are exactly ``"0" … "K-1"`` are indices. A size other than the model's or a name
        outside ``classes`` is a ConfigError naming both.
        """
        k = self.num_classes
        if num_classes is not None and num_classes != k:
            raise ConfigError(f"severity matrix from {self.source} is {k}×{k} ({k} classes) but the model has "
                              f"{num_classes} classes. Fix: give a {num_classes}×{num_classes} severity matrix, one "
                              "row and column per model output.")
        target = _fix_names(classes, "classes=") if classes is not None else tuple(str(i) for i in range(k))
        if set(target) == set(self.classes):
            perm = torch.tensor([self.classes.index(c) for c in target])
            return SeverityMatrix(self.weights[perm][:, perm].clone(), target, self.source)
        if classes is None:
            return self
        unknown = [c for c in self.classes if c not in target]
        missing = [c for c in target if c not in self.classes]
        raise ConfigError(f"severity matrix from {self.source} names unknown classes {unknown} (missing: {missing}); "
                          f"the model's classes are {list(target)}. Fix: use the same class names as classes=[...].")


# ----------------------------------------------------------------------------- the engine
@dataclass(frozen=True, eq=False)
class WeightedConfusionResult:
    """Σ W∘C / N, its upper confidence bound and the per-pair breakdown (sorted by contribution)."""

    value: float
    bound: float
    confidence: float
    method: str
    n: int
    accuracy: float
    max_weight: float
    classes: tuple[str, ...]
    confusion: Tensor  # (K, K) int64
    weights: Tensor  # (K, K) float64
    pair_index: Tensor  # (P, 2) int64: misclassified pairs with count > 0, by contribution
    pair_count: Tensor
    pair_weight: Tensor
    pair_contribution: Tensor

    def pairs(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The breakdown as records (true, predicted, count, weight, contribution), largest first."""
        rows = zip(self.pair_index[:limit].tolist(), self.pair_count[:limit].tolist(),
                   self.pair_weight[:limit].tolist(), self.pair_contribution[:limit].tolist())
        return [{"true": self.classes[i], "predicted": self.classes[j], "count": c, "weight": w, "contribution": v}
                for (i, j), c, w, v in rows]

    def to_details(self, top: int = 10) -> dict[str, Any]:
        k = len(self.classes)
        out: dict[str, Any] = {
            "value": self.value, "bound": self.bound, "confidence": self.confidence, "bound_method": self.method,
            "n": self.n, "accuracy": self.accuracy, "errors": int(self.pair_count.sum()),
            "max_weight": self.max_weight, "classes": list(self.classes), "pairs": self.pairs(top),
            "pairs_total": int(self.pair_index.shape[0]),
        }
        if k <= 64:  # small enough to plot
            out["confusion"] = self.confusion.tolist()
        return out

    def detail(self) -> str:
        head = (f"expected severity {self.value:.4g} per input ({self.confidence:.0%} upper bound {self.bound:.4g}, "
                f"{self.method}), accuracy {self.accuracy:.3f}, n={self.n}")
        if not self.pair_index.shape[0]:
            return head + "; no misclassification"
        worst = self.pairs(1)[0]
        return (head + f"; worst pair {worst['true']} -> {worst['predicted']}: {worst['count']}× weight "
                f"{worst['weight']:g} = {worst['contribution']:.4g} per input")


class WeightedConfusionEngine(Engine):
    """Confusion counts (true × predicted) weighted by a :class:`SeverityMatrix` (see the module doc)."""

    def __init__(self, weights: SeverityMatrix | Any, classes: Sequence[Any] | None = None, *,
                 confidence: float = 0.95, method: str = "kl", device: torch.device | str | None = None) -> None:
        super().__init__(device)
        self.severity = weights if isinstance(weights, SeverityMatrix) else SeverityMatrix.from_tensor(weights, classes)
        if classes is not None and isinstance(weights, SeverityMatrix):
            self.severity = weights.reordered(classes)
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
            raise ConfigError(f"confidence must be in (0, 1), got {confidence!r}. Fix: e.g. confidence=0.95.")
        if method not in BOUND_METHODS:
            raise ConfigError(f"method {method!r} is not one of {BOUND_METHODS}. Fix: use 'kl'.")
        self.confidence, self.method = float(confidence), method
        k = self.num_classes
        self._weights = self.severity.weights.to(self.device)
        self.add_state("confusion", torch.zeros((k, k), dtype=torch.int64), "sum")
        self.add_state("out_of_range", torch.zeros((), dtype=torch.int64), "sum")

    @property
    def num_classes(self) -> int:
        return self.severity.num_classes

    def config(self) -> dict[str, Any]:
        return {"weights": self.severity.weights.tolist(), "classes": list(self.severity.classes),
                "confidence": self.confidence, "method": self.method}

    def _move_buffers(self, device: torch.device) -> None:
        self._weights = self._weights.to(device)

    def update(self, predictions: Tensor, labels: Tensor) -> None:
        """Fold a batch: ``predictions`` and ``labels`` are (B,) integer class indices (no host sync)."""
        for name, t in (("predictions", predictions), ("labels", labels)):
            if not isinstance(t, Tensor) or t.ndim != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise DataError(f"{name} must be a 1-D integer tensor of class indices, got "
                                f"{getattr(t, 'shape', type(t).__name__)} {getattr(t, 'dtype', '')}. Fix: pass "
                                "logits.argmax(1) and the integer labels.")
        if predictions.shape != labels.shape:
            raise DataError(f"{predictions.shape[0]} predictions but {labels.shape[0]} labels. "
                            "Fix: one label per input.")
        k = self.num_classes
        pred, true = predictions.to(self.device, torch.int64), labels.to(self.device, torch.int64)
        valid = (true >= 0) & (true < k) & (pred >= 0) & (pred < k)
        cell = torch.where(valid, true * k + pred, torch.full_like(true, k * k))
        flat = torch.zeros(k * k + 1, dtype=torch.int64, device=self.device)
        flat.index_add_(0, cell, torch.ones_like(cell))  # one scatter-add: no host sync, unlike bincount on CUDA
        self.confusion = self.confusion + flat[:-1].view(k, k)
        self.out_of_range = self.out_of_range + flat[-1]

    def compute(self) -> WeightedConfusionResult:
        bad = int(self.out_of_range)
        if bad:
            raise DataError(f"{bad} inputs have a label or prediction outside 0..{self.num_classes - 1}; the severity "
                            f"matrix has {self.num_classes} classes. Fix: give a matrix with one row per class.")
        counts = self.confusion.cpu()
        n = int(counts.sum())
        if n == 0:
            raise DataError("no inputs were seen; the weighted confusion needs at least one. Fix: pass data.")
        w = self.severity.weights
        contrib = (w * counts.to(torch.float64)).reshape(-1) / n
        flat_counts = counts.reshape(-1)
        off = ~torch.eye(self.num_classes, dtype=torch.bool).reshape(-1) & (flat_counts > 0)
        cand = torch.nonzero(off).reshape(-1)  # ascending cell index: the last tie-break
        cand = cand[torch.sort(flat_counts[cand], descending=True, stable=True).indices]
        cand = cand[torch.sort(contrib[cand], descending=True, stable=True).indices]
        value = float(contrib.sum())
        bound = float(severity_upper_bound(value, n, self.severity.max_weight, self.confidence, self.method))
        k = self.num_classes
        return WeightedConfusionResult(
            value=value, bound=max(bound, value), confidence=self.confidence, method=self.method, n=n,
            accuracy=float(counts.diagonal().sum()) / n, max_weight=self.severity.max_weight,
            classes=self.severity.classes, confusion=counts, weights=w,
            pair_index=torch.stack([cand // k, cand % k], dim=1), pair_count=flat_counts[cand],
            pair_weight=w.reshape(-1)[cand], pair_contribution=contrib[cand])
