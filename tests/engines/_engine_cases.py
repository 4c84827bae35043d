"""The engine conformance cases: one small configuration and seeded update arguments per engine.

Every concrete :class:`~pytest_dnnsafety.engines.core.base.Engine` of the package must have a case here
(``tests/engines/test_engine_conformance.py`` discovers the engines by importing every module of
``pytest_dnnsafety`` and fails on one without a case). A case builds the engine from a small
configuration (``build(device)``), generates per-input rows from a seed (``rows(seed)``: a dict of
tensors whose dim 0 runs over the inputs) and turns a slice of those rows into the arguments of one
``update`` call (``args(chunk, start, trusted)``; ``start`` is the global index of the slice's first
row, ``trusted`` asks for the no-host-sync form, e.g. ``validate=False``). Concatenating two slices'
rows therefore gives the batch of both, which is how the harness checks batch-split invariance,
merges of halves and 2-rank gloo sync against one pass.

An engine whose ``compute()`` is not exactly independent of the batch split (float sums, whose
rounding depends on the order of additions) says so with ``exact=False`` and ``why``; its results
are compared with a relative tolerance instead of exactly. Nothing is skipped silently.

``plain(value)`` turns a ``compute()`` result (dataclasses, tensors, tuples, dicts) into JSON-able
values, ``same(a, b, exact)`` compares two of them, and ``gloo_rank`` is the function run on each
gloo rank (module level, so that ``torch.multiprocessing.spawn`` can pickle it).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import math
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

import pytest_dnnsafety
from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.confusion.weighted import WeightedConfusionEngine
from pytest_dnnsafety.engines.detection.matching import BoxMatchEngine
from pytest_dnnsafety.engines.inspection.deepinspect import InspectionEngine
from pytest_dnnsafety.engines.monitors.features import ClassGaussianStats
from pytest_dnnsafety.engines.monitors.metrics import DetectionEngine
from pytest_dnnsafety.engines.inspection.multilabel import MultiLabelInspectionEngine
from pytest_dnnsafety.engines.neurons.kactivation import NeuronKActivationEngine
from pytest_dnnsafety.engines.interpretability.occlusion import OcclusionEngine
from pytest_dnnsafety.engines.neurons.patterns import NeuronPatternEngine
from pytest_dnnsafety.engines.performance.scenario import ScenarioPerformanceEngine
from pytest_dnnsafety.engines.quantification.engine import PER_INPUT, SafeRadiusEngine
from pytest_dnnsafety.engines.reliability.tally import CellTallyEngine
from pytest_dnnsafety.engines.robustness.confidence import AdversarialConfidenceEngine
from pytest_dnnsafety.engines.robustness.verification import (
    FALSIFIED,
    UNKNOWN,
    VERIFIED,
    VerificationEngine,
)
from pytest_dnnsafety.engines.coverage.scenario import ScenarioCoverageEngine

__all__ = ["EngineCase", "CASES", "N", "HALF", "SPLIT", "discover_engines", "plain", "same", "run_rows",
           "gloo_rank"]

#: Inputs per case; the split used for the batch-split check; the first rank's (or half's) share.
N = 48
SPLIT = [7, 1, 23, 17]
HALF = 19

Args = tuple[tuple[Any, ...], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class EngineCase:
    """How to build one engine and feed it: see the module docstring."""

    engine: type[Engine]
    build: Callable[[torch.device | str | None], Engine]
    rows: Callable[[int], dict[str, Tensor]]
    args: Callable[[dict[str, Tensor], int, bool], Args]
    exact: bool = True
    why: str = ""  # required when exact is False: why the results only agree up to rounding
    rtol: float = 1e-9

    def __post_init__(self) -> None:
        if not self.exact and not self.why:
            raise ValueError(f"{self.engine.__name__}: a case that is not exact must say why")

    @property
    def id(self) -> str:
        return self.engine.__name__


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ints(gen: torch.Generator, high: int, *shape: int) -> Tensor:
    return torch.randint(0, high, shape, generator=gen, dtype=torch.int64)


def _bools(gen: torch.Generator, *shape: int, p: float = 0.5) -> Tensor:
    return torch.rand(*shape, generator=gen) < p


# ------------------------------------------------------------------------------------------- the cases

_SEVERITY = [[0.0, 1.0, 4.0, 0.5], [2.0, 0.0, 1.0, 8.0], [0.25, 3.0, 0.0, 1.0], [1.0, 1.0, 6.0, 0.0]]


def _confusion_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    labels = _ints(gen, 4, N)
    right = _bools(gen, N, p=0.6)  # a classifier right 60 % of the time
    return {"predictions": torch.where(right, labels, _ints(gen, 4, N)), "labels": labels}


def _inspection_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    labels = _ints(gen, 4, N)
    return {"active": _bools(gen, N, 6), "predictions": torch.where(_bools(gen, N, p=0.7), labels, _ints(gen, 4, N)),
            "labels": labels}


def _multilabel_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    labels = _bools(gen, N, 4, p=0.4)
    return {"active": _bools(gen, N, 6), "predicted": labels ^ _bools(gen, N, 4, p=0.2),
            "labels": labels.to(torch.int64)}


def _gaussian_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    return {"features": torch.randn(N, 4, generator=gen, dtype=torch.float64), "classes": _ints(gen, 3, N)}


def _detection_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    return {"alarm": _bools(gen, N), "is_ood": _bools(gen, N, p=0.3)}


def _activation_rows(seed: int) -> dict[str, Tensor]:
    return {"activations": torch.randn(N, 6, generator=_gen(seed))}


def _occlusion_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    occluding = _bools(gen, N, 9, p=0.4)
    occluding[::11] = False  # a few empty masks (counted, left out under empty_mask='skip')
    hot = _bools(gen, N, 9, p=0.3)
    hot[::7] = False  # and inputs with no hot position
    return {"hot": hot, "occluding": occluding, "below_rho": _bools(gen, N, p=0.1),
            "maps": torch.rand(N, 9, generator=gen, dtype=torch.float64), "cls": _ints(gen, 3, N),
            "p_clean": torch.rand(N, generator=gen, dtype=torch.float64)}


def _safe_radius_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    rows = {name: torch.rand(N, generator=gen, dtype=torch.float64) for name in
            ("s", "q", "radius", "unsafe", "linf", "certified", "q_ratio", "q_gradient", "pgd", "s_hat", "dist")}
    rows["certified"][::5] = 0.5  # ties: the worst rows are kept by input index
    return {**rows, "iterations": _ints(gen, 9, N), "evaluations": _ints(gen, 99, N), "converged": _bools(gen, N),
            "applicable": _bools(gen, N, p=0.8), "x": torch.rand(N, 2, 3, generator=gen),
            "x_hat": torch.rand(N, 2, 3, generator=gen)}


def _safe_radius_args(chunk: dict[str, Tensor], start: int, trusted: bool) -> Args:
    values = {name: chunk[name] for name in PER_INPUT}
    return (start, values), {"gated": chunk["certified"], "x": chunk["x"], "x_hat": chunk["x_hat"],
                             "s_hat": chunk["s_hat"], "dist": chunk["dist"]}


def _performance_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    return {"group_index": _ints(gen, 6, N), "correct": _bools(gen, N, p=0.8), "labels": _ints(gen, 3, N)}


def _coco_rows(seed: int) -> dict[str, Tensor]:
    """Per image up to 3 objects and 4 detections (padded, with validity masks): jittered copies and clutter."""
    gen = _gen(seed)
    corner = torch.rand(N, 3, 2, generator=gen) * 20
    gt = torch.cat([corner, corner + 4 + torch.rand(N, 3, 2, generator=gen) * 8], dim=2)
    pick = _ints(gen, 3, N * 4).reshape(N, 4)
    det = gt[torch.arange(N)[:, None], pick] + torch.randn(N, 4, 4, generator=gen)
    det[..., 2:] = torch.maximum(det[..., 2:], det[..., :2] + 1)
    gt_label, det_label = _ints(gen, 3, N * 3).reshape(N, 3), _ints(gen, 3, N * 4).reshape(N, 4)
    return {"gt": gt, "gt_label": gt_label, "gt_valid": _bools(gen, N, 3, p=0.6), "det": det,
            "det_label": torch.where(_bools(gen, N, 4, p=0.7), gt_label[torch.arange(N)[:, None], pick], det_label),
            "det_score": torch.rand(N, 4, generator=gen, dtype=torch.float64), "det_valid": _bools(gen, N, 4, p=0.7)}


def _coco_args(chunk: dict[str, Tensor], start: int, trusted: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from pytest_dnnsafety.data.tasks import BoxSet

    n = chunk["gt"].shape[0]

    def packed(prefix: str, per: int, scores: bool) -> BoxSet:
        valid = chunk[f"{prefix}_valid"]
        image = torch.arange(n, device=valid.device)[:, None].expand(n, per)[valid]
        return BoxSet(chunk[prefix][valid], chunk[f"{prefix}_label"][valid], image, n,
                      chunk["det_score"][valid] if scores else None)

    return (packed("det", 4, True), packed("gt", 3, False)), {"start": start}


def _tally_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    return {"cells": _ints(gen, 7, N), "predictions": _ints(gen, 3, N)}


def _confidence_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    clean = torch.rand(N, generator=gen)
    return {"p_clean": clean, "p_pert": clean[:, None] * torch.rand(N, 3, generator=gen),
            "correct_clean": _bools(gen, N, p=0.8), "correct_pert": _bools(gen, N, 3, p=0.5),
            "labels": _ints(gen, 4, N), "inputs": torch.rand(N, 5, generator=gen)}


def _accepts(function: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(function).parameters


def _confidence_engine(device: torch.device | str | None) -> Engine:
    # n_classes (label counts) and the keyword arguments below are used where the engine takes them
    extra = {"n_classes": 4} if _accepts(AdversarialConfidenceEngine.__init__, "n_classes") else {}
    return AdversarialConfidenceEngine(3, device=device, **extra)


def _confidence_args(chunk: dict[str, Tensor], start: int, trusted: bool) -> Args:
    args = (chunk["p_clean"], chunk["p_pert"].T, chunk["correct_clean"], chunk["correct_pert"].T)
    n, kwargs = chunk["p_clean"].shape[0], {}
    if _accepts(AdversarialConfidenceEngine.update, "rows"):  # the global row indices, as the runner gives
        kwargs["rows"] = torch.arange(start, start + n, device=chunk["p_clean"].device)
    for name in ("labels", "inputs"):
        if _accepts(AdversarialConfidenceEngine.update, name):
            kwargs[name] = chunk[name]
    return args, kwargs


def _verification_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    codes = torch.tensor([UNKNOWN, VERIFIED, FALSIFIED])
    return {"verdicts": codes[_ints(gen, 3, N)], "margins": torch.randn(N, generator=gen, dtype=torch.float64) * 3}


_CARDS = [3, 2, 4]
_SCENARIO_TOTAL = 3 * 2 + 3 * 4 + 2 * 4


def _scenario_feasible() -> Tensor:
    mask = torch.ones(_SCENARIO_TOTAL, dtype=torch.bool)
    mask[[1, 9, 20]] = False
    return mask


def _scenario_rows(seed: int) -> dict[str, Tensor]:
    gen = _gen(seed)
    return {"codes": torch.stack([_ints(gen, c, N) for c in _CARDS], dim=1)}


def _positional(*names: str, **fixed: Any) -> Callable[[dict[str, Tensor], int, bool], Args]:
    """``update(*rows[names], **fixed)``."""
    return lambda chunk, start, trusted: (tuple(chunk[n] for n in names), dict(fixed))


def _validated(*names: str) -> Callable[[dict[str, Tensor], int, bool], Args]:
    """``update(*rows[names])``, with ``validate=False`` (no host sync) when trusted."""
    return lambda chunk, start, trusted: (tuple(chunk[n] for n in names), {"validate": False} if trusted else {})


CASES: tuple[EngineCase, ...] = (
    EngineCase(WeightedConfusionEngine,
               lambda device: WeightedConfusionEngine(torch.tensor(_SEVERITY), ["a", "b", "c", "d"], confidence=0.9,
                                                      device=device),
               _confusion_rows, _positional("predictions", "labels")),
    EngineCase(InspectionEngine, lambda device: InspectionEngine(6, 4, threshold=0.5, device=device),
               _inspection_rows, _positional("active", "predictions", "labels")),
    EngineCase(BoxMatchEngine, lambda device: BoxMatchEngine([0.5, 0.75], max_detections=3, device=device),
               _coco_rows, _coco_args),
    EngineCase(MultiLabelInspectionEngine, lambda device: MultiLabelInspectionEngine(6, 4, threshold=0.5, device=device),
               _multilabel_rows, _positional("active", "predicted", "labels")),
    EngineCase(ClassGaussianStats, lambda device: ClassGaussianStats(3, 4, device=device),
               _gaussian_rows, _positional("features", "classes"), exact=False,
               why="float64 sums of the features and of their outer products: the rounding depends on the split"),
    EngineCase(DetectionEngine, lambda device: DetectionEngine(device=device),
               _detection_rows, _positional("alarm", "is_ood")),
    EngineCase(NeuronKActivationEngine,
               lambda device: NeuronKActivationEngine(6, k=2, activation_threshold=0.1, device=device),
               _activation_rows, _validated("activations")),
    EngineCase(OcclusionEngine,
               lambda device: OcclusionEngine(no_hot="skip", empty_mask="skip", worst=3, positions=9, device=device),
               _occlusion_rows,
               lambda chunk, start, trusted: ((chunk["hot"], chunk["occluding"], start),
                                              {"below_rho": chunk["below_rho"], "maps": chunk["maps"],
                                               "cls": chunk["cls"], "p_clean": chunk["p_clean"]})),
    EngineCase(SafeRadiusEngine,
               lambda device: SafeRadiusEngine(worst=4, input_shape=(2, 3), dtype="float32", device=device),
               _safe_radius_rows, _safe_radius_args),
    EngineCase(NeuronPatternEngine, lambda device: NeuronPatternEngine(6, groups=3, device=device),
               _activation_rows, _validated("activations")),
    EngineCase(ScenarioPerformanceEngine,
               lambda device: ScenarioPerformanceEngine(["weather", "road"], [["sun", "rain", "fog"], ["dry", "wet"]],
                                                        confidence=0.9, min_samples=3, num_classes=3,
                                                        feasible=[True, True, True, True, True, False], device=device),
               _performance_rows, _positional("group_index", "correct", "labels")),
    EngineCase(CellTallyEngine, lambda device: CellTallyEngine(7, 3, device=device),
               _tally_rows, _positional("cells", "predictions")),
    EngineCase(AdversarialConfidenceEngine, _confidence_engine, _confidence_rows, _confidence_args, exact=True),
    EngineCase(VerificationEngine, lambda device: VerificationEngine(0.01, method="crown", device=device),
               _verification_rows, _positional("verdicts", "margins")),
    EngineCase(ScenarioCoverageEngine,
               lambda device: ScenarioCoverageEngine(_CARDS, k=2, min_count=2, feasible=_scenario_feasible(),
                                                     device=device, names=["weather", "road", "time"]),
               _scenario_rows, _validated("codes")),
)


# ------------------------------------------------------------------------------------------- discovery


def discover_engines() -> list[type[Engine]]:
    """Every concrete Engine subclass defined in the package (every module of it imported first)."""
    for info in pkgutil.walk_packages(pytest_dnnsafety.__path__, "pytest_dnnsafety."):
        importlib.import_module(info.name)
    found = {cls for cls in Engine._registry.values()
             if cls.__module__.startswith("pytest_dnnsafety.") and not inspect.isabstract(cls)}
    return sorted(found, key=lambda cls: cls._qualified_name())


# ------------------------------------------------------------------------------------------- helpers


def run_rows(case: EngineCase, rows: Mapping[str, Tensor], sizes: list[int], start: int = 0,
             device: torch.device | str | None = None, engine: Engine | None = None,
             trusted: bool = False) -> Engine:
    """An engine (new, or ``engine``) updated with ``rows`` cut into batches of ``sizes``."""
    engine = case.build(device) if engine is None else engine
    offset = 0
    for size in sizes:
        chunk = {name: t[offset:offset + size] for name, t in rows.items()}
        if device is not None:
            chunk = {name: t.to(device) for name, t in chunk.items()}
        args, kwargs = case.args(chunk, start + offset, trusted)
        engine.update(*args, **kwargs)
        offset += size
    return engine


def plain(value: Any) -> Any:
    """``value`` as JSON-able values: tensors become ``{"dtype", "shape", "values"}``, dataclasses dicts."""
    if isinstance(value, Tensor):
        t = value.detach().cpu()
        return {"__tensor__": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "values": t.tolist()}
    if isinstance(value, np.ndarray):
        return plain(torch.from_numpy(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__type__": type(value).__name__,
                **{f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "__dict__"):
        return {"__type__": type(value).__name__,
                **{key: plain(item) for key, item in vars(value).items() if not key.startswith("_")}}
    return repr(value)


def same(a: Any, b: Any, exact: bool = True, rtol: float = 1e-9, path: str = "result") -> str | None:
    """None when ``a`` and ``b`` (from :func:`plain`) agree, else where and how they differ.

    Exact: equal values, NaN equal to NaN, and ``1 == 1.0`` is not accepted (type and value). Not
    exact: floats agree to ``rtol`` (absolute 1e-12 near 0); everything else must still be equal.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(set(a) ^ set(b))} only on one side"
        for key in a:
            problem = same(a[key], b[key], exact, rtol, f"{path}.{key}")
            if problem:
                return problem
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            problem = same(x, y, exact, rtol, f"{path}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return None
        if a == b or (not exact and math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)):
            return None
        return f"{path}: {a!r} vs {b!r}"
    if type(a) is not type(b) or a != b:
        return f"{path}: {a!r} ({type(a).__name__}) vs {b!r} ({type(b).__name__})"
    return None


def computed(engine: Engine) -> Any:
    """``plain(engine.compute())``, or the error it raised as ``{"error": "Type: message"}``."""
    try:
        return plain(engine.compute())
    except Exception as exc:  # noqa: BLE001 - an error is a result to compare
        return {"error": f"{type(exc).__name__}: {exc}"}


# ------------------------------------------------------------------------------------------- gloo


def gloo_rank(rank: int, world: int) -> dict[str, Any]:
    """On each of 2 gloo ranks: every case's engine updated with this rank's rows, synced, computed.

    Two rounds per case: ``halves`` (rank 0 takes rows ``[0, HALF)``, rank 1 rows ``[HALF, N)``; cat
    states gather in rank order) and ``one_rank`` (rank 0 takes every row and rank 1 none, as a
    torchrun rank left without batches). An update error is recorded, and ``sync`` is still called so
    that the ranks' collectives stay aligned for the next round.
    """
    assert world == 2
    out: dict[str, Any] = {}
    for case in CASES:
        rows = case.rows(0)
        out[case.id] = {}
        for name, cut in (("halves", HALF), ("one_rank", N)):
            lo, hi = (0, cut) if rank == 0 else (cut, N)
            engine = case.build(None)
            error = None
            try:
                if hi > lo:
                    run_rows(case, {key: t[lo:hi] for key, t in rows.items()}, [hi - lo], start=lo, engine=engine)
            except Exception as exc:  # noqa: BLE001
                error = f"update: {type(exc).__name__}: {exc}"
            try:
                engine.sync()
            except Exception as exc:  # noqa: BLE001
                error = error or f"sync: {type(exc).__name__}: {exc}"
            out[case.id][name] = {"error": error} if error else computed(engine)
    return out
