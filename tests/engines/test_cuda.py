"""CUDA: every engine gives the CPU's result on the GPU, and its batch loop never waits for the host.

Skipped as a whole without CUDA (CI has none). Run it on a GPU machine with
``tests/engines/cuda_check.sh`` (or ``python -m pytest tests/engines/test_cuda.py``).

(a) **Same result.** Each engine family runs once on the CPU and once on ``cuda`` over the same
seeded inputs; counts and booleans must be equal, floats equal up to 1e-5 relative. Inputs that
come out of a model (activations, attacks, occlusion maps, certified bounds, verification) use a
float64 copy of the digits CNN (``tests/_digits.py``, images ``(N, 1, 8, 8)``): float64 on both
devices leaves no rounding difference large enough to flip a threshold or an arg-max, so even
those results can be compared exactly (activations are the exception: ``capture`` keeps them in
float32). TF32 is switched off in this process (torch may let cuDNN use it for float32
convolutions, ~1e-3 relative); the plugin run end to end compares ``example_project`` on the CPU
and on CUDA as users get it, and again with TF32 forced off (``NVIDIA_TF32_OVERRIDE=0``).

Known CPU/CUDA differences that are not defects: Monte Carlo estimates drawn with a generator on
the gate's device (the pmi gate: CUDA's random stream is not the CPU's) agree only statistically.

(b) **No host synchronisation in the batch loop.** The loop (the ``update`` calls, or the runner's
per-batch body) runs under ``torch.cuda.set_sync_debug_mode("error")``: any synchronising CUDA
call (``.item()``, ``bool(tensor)``, ``.cpu()``, ``nonzero``, a blocking copy) raises. The one read
an engine makes after its loop (``compute``, the guards' ``check``) stays outside. With
``DNNSAFETY_SYNC_DEBUG=warn`` the same blocks record every synchronising call instead and the test
fails listing all of them (``file:line`` in the package), for diagnosis.

Where an engine does synchronise inside its loop, the case is marked ``xfail(strict=True)`` with
the reason (the sites it syncs at), so a fix turns it into an XPASS that must be un-marked.

``DNNSAFETY_TEST_DEVICE=cpu`` runs the file on a machine without CUDA, comparing the CPU with
itself (a dry run of the code paths; the sync checks become no-ops).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import traceback
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

_FORCED = os.environ.get("DNNSAFETY_TEST_DEVICE")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() and not _FORCED, reason="needs CUDA"),
    # torch says so (once) on the first set_sync_debug_mode; it is the tool's caveat, not a finding
    pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature"),
]

DEV = torch.device(_FORCED or "cuda")
ON_CUDA = DEV.type == "cuda"  # the known CUDA defects below are expected only there (a CPU dry run passes them)
CPU = torch.device("cpu")
#: "error" (the default: the first synchronising call raises) or "warn" (record them all, then fail).
SYNC_MODE = os.environ.get("DNNSAFETY_SYNC_DEBUG", "error")
RTOL, ATOL = 1e-5, 1e-9
#: What torch says (warns, or raises in "error" mode) at a synchronising call under sync debugging.
SYNC_WARNING = "called a synchronizing CUDA operation"


def syncs(reason: str) -> pytest.MarkDecorator:
    """An engine that synchronises with the host inside its loop today (found on an H100, torch 2.11)."""
    return pytest.mark.xfail(ON_CUDA, strict=True, reason=f"host sync in the batch loop: {reason}")
ROOT = Path(__file__).resolve().parents[2]


# ============================================================================ helpers
@pytest.fixture(autouse=True, scope="module")
def _no_tf32() -> Iterator[None]:
    """Full float32 precision on the GPU (TF32 convolutions/matmuls would differ from the CPU by ~1e-3)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _site(stack: list[traceback.FrameSummary]) -> str:
    """Where a synchronising call came from: the innermost package frame (and the innermost frame)."""
    frames = [f for f in stack if "warnings" not in Path(f.filename).name]
    ours = [f for f in frames if f"{os.sep}pytest_dnnsafety{os.sep}" in f.filename]
    inner = frames[-1] if frames else None
    where = ours[-1] if ours else inner
    if where is None:
        return "?"
    rel = where.filename.split(f"{os.sep}pytest_dnnsafety{os.sep}")[-1]
    text = f"pytest_dnnsafety/{rel}:{where.lineno} ({where.name}): {where.line}" if ours else \
        f"{where.filename}:{where.lineno} ({where.name}): {where.line}"
    if inner is not None and inner is not where:
        text += f"  [innermost {Path(inner.filename).name}:{inner.lineno} {inner.line}]"
    return text


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """The block must not synchronise with the host (``torch.cuda.set_sync_debug_mode``, reset to 0 after)."""
    if not ON_CUDA:
        yield
        return
    torch.cuda.synchronize()  # whatever is queued before the block is not the block's
    if SYNC_MODE != "warn":
        torch.cuda.set_sync_debug_mode(SYNC_MODE)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return
    with count_host_syncs() as sites:
        yield
    if sites:
        counts: dict[str, int] = {}
        for site in sites:
            counts[site] = counts.get(site, 0) + 1
        raise AssertionError(f"{len(sites)} synchronising CUDA call(s) in the batch loop:\n" +
                             "\n".join(f"  {n}x {site}" for site, n in counts.items()))


@contextlib.contextmanager
def strict_batches(module: Any, monkeypatch: pytest.MonkeyPatch, name: str = "iter_batches") -> Iterator[list[int]]:
    """Run the body of ``module``'s batch loop under :func:`no_host_sync` (the batch slicing itself stays outside).

    ``module.iter_batches`` is wrapped: sync debugging is on from the moment a batch is handed
    out until the loop asks for the next one. Yields the list of batch sizes seen.
    """
    original = getattr(module, name)
    seen: list[int] = []

    def strict(data: Any, batch_size: int) -> Iterator[Any]:
        for batch in original(data, batch_size):
            with no_host_sync():
                yield batch
            seen.append(int(batch[0].shape[0]))

    monkeypatch.setattr(module, name, strict)
    yield seen


def assert_same(cpu: Any, gpu: Any, path: str = "result", *, rtol: float = RTOL, atol: float = ATOL,
                skip: frozenset[str] = frozenset({"seconds"})) -> None:
    """``gpu`` equals ``cpu``: ints, bools, strings and integer tensors exactly; floats up to ``rtol``."""
    if dataclasses.is_dataclass(cpu) and not isinstance(cpu, type):
        assert type(gpu) is type(cpu), f"{path}: {type(gpu).__name__} vs {type(cpu).__name__}"
        for f in dataclasses.fields(cpu):
            if f.name not in skip:
                assert_same(getattr(cpu, f.name), getattr(gpu, f.name), f"{path}.{f.name}", rtol=rtol, atol=atol,
                            skip=skip)
    elif isinstance(cpu, Mapping):
        assert isinstance(gpu, Mapping) and set(gpu) == set(cpu), f"{path}: keys {sorted(gpu)} vs {sorted(cpu)}"
        for key in cpu:
            if key not in skip:
                assert_same(cpu[key], gpu[key], f"{path}[{key!r}]", rtol=rtol, atol=atol, skip=skip)
    elif isinstance(cpu, (list, tuple)):
        assert isinstance(gpu, (list, tuple)) and len(gpu) == len(cpu), f"{path}: length {len(gpu)} vs {len(cpu)}"
        for i, (a, b) in enumerate(zip(cpu, gpu)):
            assert_same(a, b, f"{path}[{i}]", rtol=rtol, atol=atol, skip=skip)
    elif isinstance(cpu, Tensor):
        assert isinstance(gpu, Tensor), f"{path}: {type(gpu).__name__} vs a tensor"
        a, b = cpu.detach().cpu(), gpu.detach().cpu()
        assert a.shape == b.shape and a.dtype == b.dtype, f"{path}: {b.shape}/{b.dtype} vs {a.shape}/{a.dtype}"
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{path}: {m}")
        else:
            assert torch.equal(a, b), f"{path}: {int((a != b).sum())} of {a.numel()} entries differ"
    elif isinstance(cpu, bool) or isinstance(gpu, bool):
        assert gpu == cpu, f"{path}: {gpu!r} vs {cpu!r}"
    elif isinstance(cpu, float) or isinstance(gpu, float):
        a, b = float(cpu), float(gpu)
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(b, a, rel_tol=rtol, abs_tol=atol), \
            f"{path}: {b!r} on {DEV} vs {a!r} on the CPU"
    elif isinstance(cpu, torch.device) or isinstance(gpu, torch.device):
        pass  # where a result lives is not part of the result
    else:
        assert gpu == cpu, f"{path}: {gpu!r} vs {cpu!r}"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _on(model: nn.Module, device: torch.device) -> nn.Module:
    return copy.deepcopy(model).to(device).eval()


@pytest.fixture(scope="module")
def digits() -> tuple[Tensor, Tensor]:
    """256 digits, (N, 1, 8, 8) float32 in [0, 1], int64 labels."""
    from _digits import digits_images

    return digits_images(256)


@pytest.fixture(scope="module")
def cnn() -> nn.Module:
    """The trained digits CNN, float32, on the CPU."""
    from _digits import digits_cnn

    return digits_cnn()


@pytest.fixture(scope="module")
def cnn64(cnn: nn.Module) -> nn.Module:
    return copy.deepcopy(cnn).double().eval()


@pytest.fixture(scope="module")
def digits64(digits: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    return digits[0].double(), digits[1]


@pytest.fixture(scope="module")
def acts(cnn: nn.Module, digits: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
    """Real per-neuron activations (computed once on the CPU): conv channel maxima (N, 32), dense (N, 64)."""
    from pytest_dnnsafety.engines.core.capture import capture

    out = capture(cnn, digits, ["features.3", "classifier.1"], batch_size=128)
    return {"conv": out["features.3"].max, "dense": out["classifier.1"].max}


# ============================================================================ neurons, patterns
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("layer", ["conv", "dense"])
def test_neuron_k_activation_cuda_equals_cpu(acts: dict[str, Tensor], layer: str, k: int) -> None:
    from pytest_dnnsafety.engines.neurons.kactivation import NeuronKActivationEngine

    a = acts[layer]
    cpu = NeuronKActivationEngine(a.shape[1], k=k, activation_threshold=0.1)
    gpu = NeuronKActivationEngine(a.shape[1], k=k, activation_threshold=0.1, device=DEV)
    for chunk in a.split(37):
        cpu.update(chunk)
        gpu.update(chunk.to(DEV))
    assert gpu.occupied.device.type == DEV.type
    assert torch.equal(cpu.occupied, gpu.occupied.cpu())
    assert_same(cpu.compute(), gpu.compute())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_neuron_k_activation_update_loop_does_not_sync(acts: dict[str, Tensor], k: int) -> None:
    from pytest_dnnsafety.engines.neurons.kactivation import NeuronKActivationEngine

    a = acts["conv"].to(DEV)
    engine = NeuronKActivationEngine(a.shape[1], k=k, device=DEV)
    with no_host_sync():
        for chunk in a.split(37):
            engine.update(chunk, validate=False)
    assert engine.compute().n_inputs == a.shape[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_neuron_k_activation_updates_after_the_first_do_not_sync(acts: dict[str, Tensor], k: int) -> None:
    from pytest_dnnsafety.engines.neurons.kactivation import NeuronKActivationEngine

    a = acts["conv"].to(DEV)
    engine = NeuronKActivationEngine(a.shape[1], k=k, device=DEV)
    engine.update(a[:37], validate=False)  # builds the plan
    with no_host_sync():
        for chunk in a[37:].split(37):
            engine.update(chunk, validate=False)
    assert engine.compute().n_inputs == a.shape[0]


def test_neuron_pattern_cuda_equals_cpu(acts: dict[str, Tensor]) -> None:
    from pytest_dnnsafety.engines.neurons.patterns import NeuronPatternEngine

    for a, groups in ((acts["conv"], 8), (acts["dense"], 10)):
        cpu = NeuronPatternEngine(a.shape[1], groups=groups)
        gpu = NeuronPatternEngine(a.shape[1], groups=groups, device=DEV)
        for chunk in a.split(50):
            cpu.update(chunk)
            gpu.update(chunk.to(DEV))
        assert torch.equal(cpu.histogram, gpu.histogram.cpu())
        assert_same(cpu.compute(), gpu.compute())


def test_neuron_pattern_update_loop_does_not_sync(acts: dict[str, Tensor]) -> None:
    from pytest_dnnsafety.engines.neurons.patterns import NeuronPatternEngine

    a = acts["dense"].to(DEV)
    engine = NeuronPatternEngine(a.shape[1], groups=10, device=DEV)
    with no_host_sync():
        for chunk in a.split(50):
            engine.update(chunk, validate=False)
    assert engine.compute().n_inputs == a.shape[0]


def test_neuron_engines_on_conv_images_cuda_equals_cpu(cnn64: nn.Module, digits64: tuple[Tensor, Tensor]) -> None:
    """The whole path from images: a CUDA model's captured activations give the CPU's coverage and pattern."""
    from pytest_dnnsafety.engines.core.capture import ActivationCache
    from pytest_dnnsafety.engines.neurons.kactivation import NeuronKActivationEngine
    from pytest_dnnsafety.engines.neurons.patterns import NeuronPatternEngine

    results = []
    for device in (CPU, DEV):
        model = _on(cnn64, device)
        got = ActivationCache().get(model, digits64, ["features.1", "classifier.1"], batch_size=64, device=device)
        conv, dense = got["features.1"].max, got["classifier.1"].mean
        assert conv.device.type == device.type
        kact = NeuronKActivationEngine(conv.shape[1], k=2, device=conv.device)
        kact.update(conv)
        pattern = NeuronPatternEngine(dense.shape[1], groups=10, device=dense.device)
        pattern.update(dense)
        results.append((kact.compute(), pattern.compute()))
    assert_same(results[0], results[1])


# ============================================================================ scenario coverage
CARDS = (3, 4, 2, 5, 3)


def _codes(n: int = 3000, seed: int = 0) -> Tensor:
    g = _gen(seed)
    return torch.stack([torch.randint(0, c, (n,), generator=g) for c in CARDS], dim=1)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_scenario_coverage_cuda_equals_cpu(k: int) -> None:
    from pytest_dnnsafety.engines.coverage.scenario import ScenarioCoverageEngine
    from pytest_dnnsafety.engines.core.projection import ProjectionLayout

    codes = _codes()[:400]  # few rows: some k = 3 cells stay empty
    total = ProjectionLayout(CARDS, k).total
    feasible = torch.rand(total, generator=_gen(5)) > 0.1
    cpu = ScenarioCoverageEngine(CARDS, k=k, min_count=2, feasible=feasible)
    gpu = ScenarioCoverageEngine(CARDS, k=k, min_count=2, feasible=feasible, device=DEV)
    for chunk in codes.split(97):
        cpu.update(chunk)
        gpu.update(chunk.to(DEV))
    assert torch.equal(cpu.counts, gpu.counts.cpu())
    assert_same(cpu.compute(), gpu.compute())


@pytest.mark.parametrize("k", [2, 3])
def test_scenario_coverage_update_loop_does_not_sync(k: int) -> None:
    from pytest_dnnsafety.engines.coverage.scenario import ScenarioCoverageEngine

    codes = _codes().to(DEV)
    engine = ScenarioCoverageEngine(CARDS, k=k, device=DEV)
    with no_host_sync():
        for chunk in codes.split(500):
            engine.update(chunk, validate=False)
    assert int(engine.counts.sum()) == codes.shape[0] * math.comb(len(CARDS), k)


# ============================================================================ reliability
def test_cell_tally_cuda_equals_cpu_and_does_not_sync() -> None:
    from pytest_dnnsafety.engines.reliability import CellTallyEngine

    g = _gen(3)
    cells = torch.randint(0, 50, (4000,), generator=g).sort().values  # batches cover contiguous cells
    preds = torch.randint(0, 4, (4000,), generator=g)
    cpu, gpu = CellTallyEngine(50, 4), CellTallyEngine(50, 4, device=DEV)
    cells_d, preds_d = cells.to(DEV), preds.to(DEV)
    bounds = [(int(c.min()), int(c.max()) + 1) for c in cells.split(500)]  # host-side, before the loop
    for (lo, hi), c, p in zip(bounds, cells.split(500), preds.split(500)):
        cpu.update(c, p, cell_range=(lo, hi))
    with no_host_sync():
        for (lo, hi), c, p in zip(bounds, cells_d.split(500), preds_d.split(500)):
            gpu.update(c, p, cell_range=(lo, hi))
    assert torch.equal(cpu.compute(), gpu.compute().cpu())


def _grid_model(x: Tensor) -> Tensor:
    """Class 1 right of x₀ = ½, except the cells x₀ ∈ [¼, ½), x₁ ≥ ¾ (wrong there): edges on the 1/8 grid.

    Every cell is decided whole, so the failure counts do not depend on which random points the
    device's generator draws inside the cells.
    """
    wrong = (x[:, 0] >= 0.25) & (x[:, 0] < 0.5) & (x[:, 1] >= 0.75)
    cls = (x[:, 0] >= 0.5) ^ wrong
    return torch.stack([(~cls).to(x.dtype), cls.to(x.dtype)], dim=1)


def _grid_problem() -> tuple[Any, tuple[Tensor, Tensor]]:
    from pytest_dnnsafety.engines.reliability.profile import OperationalProfile

    x_op = torch.rand(300, 2, generator=_gen(11), dtype=torch.float64)
    centres = (torch.cartesian_prod(torch.arange(8), torch.arange(8)).to(torch.float64) + 0.5) / 8
    return OperationalProfile(x_op, "scott"), (centres, (centres[:, 0] >= 0.5).long())


def _assess(device: torch.device, **extra: Any) -> Any:
    from pytest_dnnsafety.engines.reliability import ReliabilityWarning, assess_reliability

    profile, labelled = _grid_problem()  # the KDE (and its bootstrap) on the CPU, as the plugin builds it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReliabilityWarning)
        return assess_reliability(_grid_model, profile, labelled, eps=0.125, box=([0.0, 0.0], [1.0, 1.0]),
                                  samples_per_cell=256, bootstrap=20, seed=3, device=device, batch_size=8192,
                                  compare_methods=("normal", "clopper-pearson"), **extra)


def test_reliability_grid_assessment_cuda_equals_cpu() -> None:
    cpu, gpu = _assess(CPU), _assess(DEV)
    assert gpu.cells_evaluated == 64 and gpu.model_queries == 64 * 256
    assert int(gpu.cells.failures.sum()) > 0  # the wrong region is sampled
    assert_same(cpu, gpu)
    assert_same(cpu.cells, gpu.cells, "result.cells")


def test_reliability_monte_carlo_batches_do_not_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Monte Carlo batch (``_run_blocks``: draw, model, tally) runs without a host sync."""
    from pytest_dnnsafety.engines.reliability import sampler

    original = sampler.MonteCarloSampler._run_blocks
    calls = []

    def strict(self: Any, *args: Any, **kwargs: Any) -> int:
        with no_host_sync():
            out = original(self, *args, **kwargs)
        calls.append(out)
        return out

    monkeypatch.setattr(sampler.MonteCarloSampler, "_run_blocks", strict)
    result = _assess(DEV)
    assert calls == [8192, 8192] and result.model_queries == 16384


class GridNet(nn.Module):
    """:func:`_grid_model` as a module with a parameter (so it has a device)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(2))  # exact identity: x·I = x

    def forward(self, x: Tensor) -> Tensor:
        return _grid_model(self.lin(x))


def test_reliability_grid_with_a_cuda_module_and_a_cpu_profile() -> None:
    """A profile built on the CPU (as a user's OperationalProfile fixture is) with device=cuda and a CUDA model."""
    from pytest_dnnsafety.engines.reliability import ReliabilityWarning, assess_reliability

    profile, labelled = _grid_problem()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReliabilityWarning)
        result = assess_reliability(GridNet().to(DEV), profile, labelled, eps=0.125, box=([0.0, 0.0], [1.0, 1.0]),
                                    samples_per_cell=64, bootstrap=0, seed=3, device=DEV, batch_size=8192)
    assert result.cells_evaluated == 64


# ============================================================================ performance per scenario, confusion
def test_scenario_performance_cuda_equals_cpu_and_does_not_sync() -> None:
    from pytest_dnnsafety.engines.performance.scenario import ScenarioPerformanceEngine

    g = _gen(4)
    domains = (("day", "dusk", "night"), ("low", "high"))
    groups = torch.randint(0, 6, (3000,), generator=g)
    labels = torch.randint(0, 5, (3000,), generator=g)
    correct = torch.rand(3000, generator=g) < 0.8 - 0.1 * (groups == 5)
    options = {"confidence": 0.9, "min_samples": 20, "num_classes": 5,
               "feasible": [True, True, True, True, True, False]}
    cpu = ScenarioPerformanceEngine(["lighting", "noise"], domains, **options)
    gpu = ScenarioPerformanceEngine(["lighting", "noise"], domains, device=DEV, **options)
    for gr, c, lab in zip(groups.split(400), correct.split(400), labels.split(400)):
        cpu.update(gr, c, lab)
    batches = list(zip(groups.to(DEV).split(400), correct.to(DEV).split(400), labels.to(DEV).split(400)))
    with no_host_sync():
        for gr, c, lab in batches:
            gpu.update(gr, c, lab)
    assert_same(cpu.compute(), gpu.compute())


def test_weighted_confusion_cuda_equals_cpu_and_does_not_sync() -> None:
    from pytest_dnnsafety.engines.confusion.weighted import WeightedConfusionEngine

    g = _gen(6)
    k = 6
    weights = torch.rand(k, k, generator=g, dtype=torch.float64) * 3
    weights.fill_diagonal_(0.0)
    labels = torch.randint(0, k, (5000,), generator=g)
    preds = torch.where(torch.rand(5000, generator=g) < 0.7, labels, torch.randint(0, k, (5000,), generator=g))
    cpu = WeightedConfusionEngine(weights, confidence=0.95)
    gpu = WeightedConfusionEngine(weights, confidence=0.95, device=DEV)
    for p, y in zip(preds.split(700), labels.split(700)):
        cpu.update(p, y)
    batches = list(zip(preds.to(DEV).split(700), labels.to(DEV).split(700)))
    with no_host_sync():
        for p, y in batches:
            gpu.update(p, y)
    assert torch.equal(cpu.confusion, gpu.confusion.cpu())
    assert_same(cpu.compute(), gpu.compute())


# ============================================================================ occlusion
def _hot_occ(n: int, p: int, seed: int) -> tuple[Tensor, Tensor]:
    g = _gen(seed)
    hot = torch.rand(n, p, generator=g) < 0.2
    occ = torch.rand(n, p, generator=g) < 0.4
    hot[:5] = False  # inputs without a hot position
    occ[5:8] = False  # and with an empty mask
    return hot, occ


def test_occlusion_engine_cuda_equals_cpu_and_does_not_sync() -> None:
    from pytest_dnnsafety.engines.interpretability.occlusion import OcclusionEngine

    hot, occ = _hot_occ(300, 49, 8)
    below = torch.rand(300, generator=_gen(9)) < 0.1
    cpu = OcclusionEngine(no_hot="skip", empty_mask="skip")
    gpu = OcclusionEngine(no_hot="skip", empty_mask="skip", device=DEV)
    per_cpu, per_gpu = [], []
    for start in range(0, 300, 64):
        per_cpu.append(cpu.update(hot[start:start + 64], occ[start:start + 64], start, below[start:start + 64]))
    batches = [(hot[s:s + 64].to(DEV), occ[s:s + 64].to(DEV), s, below[s:s + 64].to(DEV)) for s in range(0, 300, 64)]
    with no_host_sync():
        for h, o, s, b in batches:
            per_gpu.append(gpu.update(h, o, s, b))
    assert_same(per_cpu, per_gpu, "per-input values")
    assert_same(cpu.compute(), gpu.compute())


def _masks(x: Tensor) -> Tensor:
    return x[:, 0] > 0.3


def test_assess_occlusion_on_images_cuda_equals_cpu(cnn64: nn.Module, digits64: tuple[Tensor, Tensor]) -> None:
    from pytest_dnnsafety.engines.interpretability.occlusion import assess_occlusion

    x, y = digits64[0][:96], digits64[1][:96]
    results = [assess_occlusion(_on(cnn64, device), (x, y), _masks(x), size=2, stride=1, fill=0.0, rho=0.5,
                                batch_size=32, max_batch=500, device=device) for device in (CPU, DEV)]
    assert results[0].n == 96 and results[0].hot_total > 0
    # the worst inputs listed in the details (and their maps): see the test below
    assert_same(results[0], results[1], skip=frozenset({"seconds", "worst_inputs", "maps"}))


def test_assess_occlusion_worst_inputs_cuda_equal_cpu(cnn64: nn.Module, digits64: tuple[Tensor, Tensor]) -> None:
    from pytest_dnnsafety.engines.interpretability.occlusion import assess_occlusion

    x, y = digits64[0][:96], digits64[1][:96]
    results = [assess_occlusion(_on(cnn64, device), (x, y), _masks(x), size=2, stride=1, fill=0.0, rho=0.5,
                                batch_size=32, max_batch=500, device=device) for device in (CPU, DEV)]
    assert_same(results[0].worst_inputs, results[1].worst_inputs, "worst_inputs")
    assert_same(results[0].maps, results[1].maps, "maps")


def test_assess_occlusion_batch_loop_does_not_sync(cnn: nn.Module, digits: tuple[Tensor, Tensor],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_dnnsafety.engines.interpretability import occlusion
    from pytest_dnnsafety.engines.core import runner

    x, y = digits[0][:96], digits[1][:96]
    with strict_batches(runner, monkeypatch) as seen:
        result = occlusion.assess_occlusion(_on(cnn, DEV), (x, y), _masks(x), size=2, stride=1, rho=0.5,
                                            outputs="logits", batch_size=32, max_batch=500, device=DEV)
    assert seen == [32, 32, 32] and result.n == 96


# ============================================================================ robustness: attacks and families
ATTACKS = [
    pytest.param("fgsm", {"norm": "linf"}, id="fgsm-linf"),
    pytest.param("fgsm", {"norm": "l2"}, id="fgsm-l2"),
    pytest.param("pgd", {"norm": "linf", "steps": 5}, id="pgd-linf"),
    pytest.param("pgd", {"norm": "l2", "steps": 5, "loss": "margin"}, id="pgd-l2-margin"),
]


def _attack(name: str, model: nn.Module, x: Tensor, y: Tensor, eps: float, options: dict[str, Any]) -> Tensor:
    from pytest_dnnsafety.engines.robustness import fgsm, pgd

    fn = fgsm if name == "fgsm" else pgd
    return fn(model, x, y, eps, _gen(21), clip=(0.0, 1.0), **options)


@pytest.mark.parametrize(("name", "options"), ATTACKS)
def test_attacks_cuda_equal_cpu(cnn64: nn.Module, digits64: tuple[Tensor, Tensor], name: str,
                                options: dict[str, Any]) -> None:
    x, y = digits64[0][:64], digits64[1][:64]
    eps = 0.05 if options["norm"] == "linf" else 0.5
    cpu = _attack(name, _on(cnn64, CPU), x, y, eps, options)
    gpu = _attack(name, _on(cnn64, DEV), x.to(DEV), y.to(DEV), eps, options)
    assert gpu.device.type == DEV.type and not torch.equal(cpu, x)
    assert_same(cpu, gpu, f"{name} result")


@pytest.mark.parametrize(("name", "options"), ATTACKS)
def test_attacks_do_not_sync(cnn: nn.Module, digits: tuple[Tensor, Tensor], name: str,
                             options: dict[str, Any]) -> None:
    """As the runners call them: inputs on the device, the family's CPU generator (seeded per batch)."""
    model = _on(cnn, DEV)
    x, y = digits[0][:64].to(DEV), digits[1][:64].to(DEV)
    eps = 0.05 if options["norm"] == "linf" else 0.5
    with no_host_sync():
        out = _attack(name, model, x, y, eps, options)
    assert out.shape == x.shape


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_pgd_with_a_device_generator_does_not_sync(cnn: nn.Module, digits: tuple[Tensor, Tensor], norm: str) -> None:
    """The PGD loop itself is sync-free: with a generator on the device the random start stays there."""
    from pytest_dnnsafety.engines.robustness import pgd

    model = _on(cnn, DEV)
    x, y = digits[0][:64].to(DEV), digits[1][:64].to(DEV)
    gen = torch.Generator(device=DEV).manual_seed(21)
    with no_host_sync():
        out = pgd(model, x, y, 0.05 if norm == "linf" else 0.5, gen, norm=norm, steps=5, clip=(0.0, 1.0))
    assert out.shape == x.shape


def _family_eps(name: str) -> float:
    return {"gaussian_noise": 0.05, "brightness": 0.1, "contrast": 0.2, "blur": 0.8, "rotation": 10.0,
            "translation": 1.0, "occlusion": 0.25, "fgsm": 0.05, "fgsm_l2": 0.5, "pgd": 0.05,
            "pgd_l2": 0.5}[name]


def _family_names() -> list[str]:
    from pytest_dnnsafety.engines.robustness import FAMILIES

    return sorted(FAMILIES)


@pytest.mark.parametrize("name", _family_names())
def test_perturbation_families_cuda_equal_cpu(cnn64: nn.Module, digits64: tuple[Tensor, Tensor], name: str) -> None:
    from pytest_dnnsafety.engines.robustness import make_family

    family = make_family(name, clip=(0.0, 1.0))
    x, y = digits64[0][:48], digits64[1][:48]
    cpu = family(_on(cnn64, CPU), x, y, _family_eps(name), _gen(5))
    gpu = family(_on(cnn64, DEV), x.to(DEV), y.to(DEV), _family_eps(name), _gen(5))
    assert gpu.device.type == DEV.type and not torch.equal(cpu, x)
    assert_same(cpu, gpu, f"{name} output")


@pytest.mark.parametrize("name", _family_names())
def test_perturbation_families_do_not_sync(cnn: nn.Module, digits: tuple[Tensor, Tensor], name: str) -> None:
    """A family call as the runner makes it per batch: device inputs, a CPU generator, its guard, known outputs."""
    from pytest_dnnsafety.engines.robustness import make_family
    from pytest_dnnsafety.engines.core.guard import ForwardGuard

    family = make_family(name, clip=(0.0, 1.0))
    model = _on(cnn, DEV)
    x, y = digits[0][:48].to(DEV), digits[1][:48].to(DEV)
    guard = ForwardGuard("test")
    with no_host_sync():
        out = family(model, x, y, _family_eps(name), _gen(5), guard=guard, outputs="logits")
    guard.check()
    assert out.shape == x.shape


# ============================================================================ robustness: adversarial confidence
def test_adversarial_confidence_engine_cuda_equals_cpu_and_does_not_sync() -> None:
    from pytest_dnnsafety.engines.robustness import AdversarialConfidenceEngine

    g = _gen(12)
    p_clean = torch.rand(600, generator=g, dtype=torch.float64)
    p_pert = torch.rand(3, 600, generator=g, dtype=torch.float64)
    c_clean = torch.rand(600, generator=g) < 0.9
    c_pert = torch.rand(3, 600, generator=g) < 0.7
    cpu, gpu = AdversarialConfidenceEngine(3), AdversarialConfidenceEngine(3, device=DEV)
    for s in range(0, 600, 128):
        cpu.update(p_clean[s:s + 128], p_pert[:, s:s + 128], c_clean[s:s + 128], c_pert[:, s:s + 128])
    on = [t.to(DEV) for t in (p_clean, p_pert, c_clean, c_pert)]
    with no_host_sync():
        for s in range(0, 600, 128):
            gpu.update(on[0][s:s + 128], on[1][:, s:s + 128], on[2][s:s + 128], on[3][:, s:s + 128])
    assert_same(cpu.compute(), gpu.compute())


ADV_FAMILIES = ("gaussian_noise", "brightness", "rotation", "occlusion", "fgsm", "pgd")


def _adv(model: nn.Module, data: tuple[Tensor, Tensor], device: torch.device, outputs: str = "auto") -> Any:
    from pytest_dnnsafety.engines.robustness import assess_adversarial_confidence, make_family

    families = {name: make_family(name, clip=(0.0, 1.0)) for name in ADV_FAMILIES}
    eps = {name: _family_eps(name) for name in ADV_FAMILIES}
    return assess_adversarial_confidence(model, data, families, eps, batch_size=40, device=device, seed=7,
                                         clip=(0.0, 1.0), outputs=outputs)


def test_adversarial_confidence_cuda_equals_cpu(cnn64: nn.Module, digits64: tuple[Tensor, Tensor]) -> None:
    data = (digits64[0][:80], digits64[1][:80])
    cpu, gpu = (_adv(_on(cnn64, device), data, device) for device in (CPU, DEV))
    assert cpu.n == 80 and cpu.loss > 0
    assert_same(cpu, gpu)


def test_adversarial_confidence_batch_loop_does_not_sync(cnn: nn.Module, digits: tuple[Tensor, Tensor],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_dnnsafety.engines.core import runner

    with strict_batches(runner, monkeypatch) as seen:
        result = _adv(_on(cnn, DEV), (digits[0][:80], digits[1][:80]), DEV, outputs="logits")
    assert seen == [40, 40] and result.n == 80


# ============================================================================ robustness: bounds, verification
def _box(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    from pytest_dnnsafety.engines.robustness import input_box

    return input_box(x, eps, (0.0, 1.0))


@pytest.mark.parametrize("method", ["ibp", "crown"])
def test_certified_bounds_cuda_equal_cpu(cnn64: nn.Module, digits64: tuple[Tensor, Tensor], method: str) -> None:
    from pytest_dnnsafety.engines.robustness import BoundedModel

    x, y = digits64[0][:12], digits64[1][:12]
    out = []
    for device in (CPU, DEV):
        bounded = BoundedModel(_on(cnn64, device))
        lo, hi = _box(x.to(device), 0.01)
        bounds = bounded.ibp(lo, hi) if method == "ibp" else bounded.crown(lo, hi)
        out.append((bounds, bounded.margin_lower_bounds(lo, hi, y.to(device), method)))
    assert_same(out[0], out[1], f"{method} bounds", rtol=1e-7, atol=1e-9)


@syncs("engines/bounds.py _prepare checks its box with bool(isfinite(...).all()) and bool((lo > hi).any()), "
       "margin_lower_bounds checks the labels with bool(...any()); CROWN (bounds_crown.py _one_relu_bounds, lower) "
       "reads counts with int(counts.max()) and .tolist(): every call, i.e. every batch of verify_robustness")
@pytest.mark.parametrize("method", ["ibp", "crown"])
def test_certified_bounds_do_not_sync(cnn: nn.Module, digits: tuple[Tensor, Tensor], method: str) -> None:
    from pytest_dnnsafety.engines.robustness import BoundedModel

    bounded = BoundedModel(_on(cnn, DEV))
    x, y = digits[0][:12].to(DEV), digits[1][:12].to(DEV)
    lo, hi = (x - 0.01).clamp(0, 1), (x + 0.01).clamp(0, 1)
    with no_host_sync():
        margins = bounded.margin_lower_bounds(lo, hi, y, method)
    assert margins.shape == (12, 10)


def test_verification_engine_cuda_equals_cpu() -> None:
    from pytest_dnnsafety.engines.robustness import VerificationEngine
    from pytest_dnnsafety.engines.robustness.verification import FALSIFIED, UNKNOWN, VERIFIED

    g = _gen(13)
    verdicts = torch.tensor([VERIFIED, FALSIFIED, UNKNOWN])[torch.randint(0, 3, (500,), generator=g)]
    margins = torch.randn(500, generator=g, dtype=torch.float64) * 3
    cpu, gpu = VerificationEngine(0.01), VerificationEngine(0.01, device=DEV)
    for v, m in zip(verdicts.split(128), margins.split(128)):
        cpu.update(v, m)
        gpu.update(v.to(DEV), m.to(DEV))
    assert torch.equal(cpu.margins, gpu.margins.cpu())
    assert_same(cpu.compute(), gpu.compute())


def test_verification_engine_update_loop_does_not_sync() -> None:
    from pytest_dnnsafety.engines.robustness import VerificationEngine

    g = _gen(13)
    verdicts = torch.randint(0, 3, (500,), generator=g).to(DEV)
    margins = (torch.randn(500, generator=g, dtype=torch.float64) * 3).to(DEV)
    engine = VerificationEngine(0.01, device=DEV)
    with no_host_sync():
        for v, m in zip(verdicts.split(128), margins.split(128)):
            engine.update(v, m)
    assert engine.compute().n == 500


def test_verify_robustness_on_images_cuda_equals_cpu(cnn64: nn.Module, digits64: tuple[Tensor, Tensor]) -> None:
    from pytest_dnnsafety.engines.robustness import verify_robustness

    data = (digits64[0][:64], digits64[1][:64])
    cpu, gpu = (verify_robustness(_on(cnn64, device), data, 0.02, clip=(0.0, 1.0), batch_size=32, device=device,
                                  attack_steps=5) for device in (CPU, DEV))
    assert cpu.n == 64 and cpu.verified and (cpu.falsified or cpu.unknown)
    assert_same(cpu, gpu, rtol=1e-7)


@syncs("engines/robustness/verification.py verify_robustness: torch.nonzero selects the undecided inputs (the one "
       "documented sync per batch; removing it would change the PGD draws and the CPU results) plus CROWN's "
       "unstable-neuron counts while bounds_crown.HOST_SIZING is on (the faster default)")
def test_verify_robustness_batch_loop_does_not_sync(cnn: nn.Module, digits: tuple[Tensor, Tensor],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_dnnsafety.engines.core import runner
    from pytest_dnnsafety.engines.robustness import verification

    with strict_batches(runner, monkeypatch) as seen:
        result = verification.verify_robustness(_on(cnn, DEV), (digits[0][:64], digits[1][:64]), 0.02,
                                                clip=(0.0, 1.0), batch_size=32, device=DEV, attack_steps=5)
    assert seen == [32, 32] and result.n == 64


@contextlib.contextmanager
def count_host_syncs() -> Iterator[list[str]]:
    """Record (not raise) every synchronising CUDA call of the block; yields their sites (empty off CUDA)."""
    sites: list[str] = []
    if not ON_CUDA:
        yield sites
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if SYNC_WARNING in str(message):
                sites.append(_site(traceback.extract_stack()[:-1]))
            else:
                original(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("method", ["ibp", "crown"])
def test_unchecked_certified_bounds_do_not_sync(cnn: nn.Module, digits: tuple[Tensor, Tensor], method: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``check=False`` (what verify_robustness uses on a device) skips the host reads and gives the same margins.

    CROWN sized by shapes (``HOST_SIZING = False``; by default it reads its unstable-neuron counts).
    """
    from pytest_dnnsafety.engines.robustness import BoundedModel, input_box
    from pytest_dnnsafety.engines.bounds import crown as bounds_crown

    monkeypatch.setattr(bounds_crown, "HOST_SIZING", False)
    bounded = BoundedModel(_on(cnn, DEV))
    x, y = digits[0][:12].to(DEV), digits[1][:12].to(DEV)
    with no_host_sync():
        lo, hi = input_box(x, 0.01, (0.0, 1.0), check=False)
        margins = bounded.margin_lower_bounds(lo, hi, y, method, check=False)
    assert torch.equal(margins, bounded.margin_lower_bounds(*input_box(x, 0.01, (0.0, 1.0)), y, method))


def test_crown_sized_by_shapes_equals_crown_sized_by_counts(cnn64: nn.Module, digits64: tuple[Tensor, Tensor],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device CROWN sizes its chunks from shapes (every row, masked); the counts' sizing gives the same bounds."""
    from pytest_dnnsafety.engines.robustness import BoundedModel
    from pytest_dnnsafety.engines.bounds import crown as bounds_crown

    bounded = BoundedModel(_on(cnn64, DEV))
    lo, hi = _box(digits64[0][:24].to(DEV), 0.02)
    y = digits64[1][:24].to(DEV)
    got = {}
    for host_sizing in (True, False):
        monkeypatch.setattr(bounds_crown, "HOST_SIZING", host_sizing)
        got[host_sizing] = (bounded.crown(lo, hi), bounded.margin_lower_bounds(lo, hi, y, "crown"))
    assert_same(got[True], got[False], "crown by shapes", rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("method", "host_sizing"), [("ibp", True), ("crown", False)])
def test_verify_robustness_syncs_once_per_batch(cnn: nn.Module, digits: tuple[Tensor, Tensor], method: str,
                                                host_sizing: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one documented host sync per batch: torch.nonzero selecting the undecided inputs for PGD (nothing else).

    For CROWN with its chunks sized by shapes; by default it also reads its unstable-neuron counts (faster).
    """
    from pytest_dnnsafety.engines.core import runner
    from pytest_dnnsafety.engines.robustness import verification
    from pytest_dnnsafety.engines.bounds import crown as bounds_crown

    monkeypatch.setattr(bounds_crown, "HOST_SIZING", host_sizing)
    per_batch: list[list[str]] = []
    original = runner.iter_batches

    def counted(data: Any, batch_size: int) -> Iterator[Any]:
        for batch in original(data, batch_size):
            with count_host_syncs() as sites:
                yield batch
            per_batch.append(sites)

    monkeypatch.setattr(runner, "iter_batches", counted)
    result = verification.verify_robustness(_on(cnn, DEV), (digits[0][:64], digits[1][:64]), 0.02, method=method,
                                            clip=(0.0, 1.0), batch_size=32, device=DEV, attack_steps=5)
    assert result.n == 64 and len(per_batch) == 2
    for sites in per_batch:
        assert len(sites) == (1 if ON_CUDA else 0) and all("nonzero" in site for site in sites), sites


def _verify_error(model: nn.Module, x: Tensor, y: Tensor, device: torch.device) -> str:
    from pytest_dnnsafety.engines.robustness import verify_robustness
    from pytest_dnnsafety.errors import DataError

    with pytest.raises(DataError) as info:
        verify_robustness(_on(model, device), (x, y), 0.02, clip=(0.0, 1.0), batch_size=16, device=device,
                          attack_steps=2)
    return str(info.value)


@pytest.mark.parametrize("bad", ["outside-clip", "nan", "both"])
def test_verify_robustness_deferred_input_checks_raise_as_on_the_cpu(cnn64: nn.Module,
                                                                     digits64: tuple[Tensor, Tensor],
                                                                     bad: str) -> None:
    """The input checks are read after the loop on every device: the same error as the CPU's."""
    x, y = digits64[0][:48].clone(), digits64[1][:48]
    if bad in ("outside-clip", "both"):
        x[37, 0, 2, 2], x[38, 0, 4, 4], x[45, 0, 1, 1] = 1.5, -0.5, 2.0  # three values, all in batch 2
    if bad in ("nan", "both"):
        x[20, 0, 3, 3] = math.nan  # batch 1 (before the values outside clip in "both")
    cpu, gpu = (_verify_error(cnn64, x, y, device) for device in (CPU, DEV))
    assert gpu == cpu
    assert ("NaN/inf" in cpu) == (bad != "outside-clip")


# ============================================================================ activations
def test_activation_cache_cuda_equals_cpu(cnn: nn.Module, cnn64: nn.Module, digits: tuple[Tensor, Tensor],
                                          digits64: tuple[Tensor, Tensor]) -> None:
    """Activations, logits and confidences agree to 1e-5; predictions exactly for a float64 model.

    ``capture`` keeps its reductions and outputs in float32 whatever the model's dtype (by design),
    so even the float64 model's activations differ by float32 rounding (~1e-7) between devices.
    """
    from pytest_dnnsafety.engines.core.capture import ActivationCache

    layers = ["features.1", "features.4", "classifier.1"]
    for model, data in ((cnn, digits), (cnn64, digits64)):
        got = []
        for device in (CPU, DEV):
            cache, m = ActivationCache(), _on(model, device)
            acts = cache.get(m, data, layers, batch_size=100, device=device)
            outputs = cache.outputs(m, data, batch_size=100, device=device)
            assert cache.forward_passes == 1 and acts["features.4"].max.device.type == device.type
            got.append((acts, outputs))
        (acts_cpu, out_cpu), (acts_gpu, out_gpu) = got
        assert_same(acts_cpu, acts_gpu, "activations", rtol=1e-5, atol=1e-5)
        assert_same(out_cpu.confidence, out_gpu.confidence, "confidence", rtol=1e-5, atol=1e-6)
        assert_same(out_cpu.logits, out_gpu.logits, "logits", rtol=1e-5, atol=1e-5)
        assert_same(out_cpu.labels, out_gpu.labels, "labels")
        if model is cnn64:
            assert_same(out_cpu.predictions, out_gpu.predictions, "predictions")
        else:  # float32: equal wherever the top two logits are not (almost) tied
            top = out_cpu.logits.topk(2, dim=1).values
            clear = (top[:, 0] - top[:, 1]) > 1e-4
            assert torch.equal(out_cpu.predictions[clear], out_gpu.predictions.cpu()[clear])


def test_activation_cache_batch_loop_does_not_sync(cnn: nn.Module, digits: tuple[Tensor, Tensor],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared pass (hooks, outputs, labels) of ActivationCache.get / .outputs on a CUDA model."""
    from pytest_dnnsafety.engines.core import capture as activations
    from pytest_dnnsafety.engines.core import runner

    cache, model = activations.ActivationCache(), _on(cnn, DEV)
    with strict_batches(runner, monkeypatch) as seen:  # the shared pass runs its batches through the runner
        acts = cache.get(model, digits, ["features.1", "classifier.1"], batch_size=64, device=DEV)
        out = cache.outputs(model, digits, batch_size=64, device=DEV)
    assert seen == [64] * 4 and acts["features.1"].max.device.type == DEV.type and out.labels is not None


# ============================================================================ the plugin, end to end
EXAMPLE = ROOT / "example_project"
#: The example's generated (git-ignored) model and data; ``python -m digits_demo.train`` writes them.
EXAMPLE_FILES = ("models/digits_cnn.pt", "data/eval.npz", "data/scenarios.csv", "data/operation.npz")
#: The runs compared: the CPU, CUDA as users get it (TF32 as torch defaults it), CUDA with TF32 forced off.
RUNS = {"cpu": ("cpu", {}), "cuda": ("cuda", {}), "cuda-no-tf32": ("cuda", {"NVIDIA_TF32_OVERRIDE": "0"})}


def _plugin_args() -> list[str]:
    """``-p pytest_dnnsafety.plugin.hooks`` unless the installed entry point loads it already."""
    installed = any(ep.value == "pytest_dnnsafety.plugin.hooks" for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "pytest_dnnsafety.plugin.hooks"]


def _run_example(device: str, extra_env: dict[str, str], out: Path) -> dict[str, Any]:
    env = {**os.environ, **extra_env,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("DNNSAFETY_SYNC_DEBUG", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_plugin_args(),
           f"--dnnsafety-device={device}", f"--dnnsafety-json={out}"]
    done = subprocess.run(cmd, cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=500,
                          check=False)
    assert out.exists(), f"{device}: no evidence written (exit {done.returncode}):\n{done.stdout[-4000:]}\n" \
                         f"{done.stderr[-4000:]}"
    run = json.loads(out.read_text())
    errors = [f"{g['nodeid']}: {g['summary']}" for g in run["gates"] if g["status"] == "error"]
    assert not errors, f"{out.stem}: gates in error, nothing to compare:\n" + "\n".join(errors[:5])
    return run


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    if not ON_CUDA:
        pytest.skip("the end-to-end comparison needs CUDA")
    missing = [f for f in EXAMPLE_FILES if not (EXAMPLE / f).exists()]
    if missing:
        pytest.skip(f"example_project lacks its generated files {missing}: run `python -m digits_demo.train` in "
                    f"example_project/ first (tests/engines/cuda_check.sh does)")
    keep = os.environ.get("DNNSAFETY_EVIDENCE_DIR")  # keep the evidence files (for diagnosis)
    tmp = Path(keep) if keep else tmp_path_factory.mktemp("example")
    tmp.mkdir(parents=True, exist_ok=True)
    return {name: _run_example(device, env, tmp / f"{name}.json") for name, (device, env) in RUNS.items()}


#: Gates whose value is a Monte Carlo estimate drawn with a generator on the gate's device: CUDA's
#: random stream is not the CPU's, so only the verdict (and a statistical closeness) can be compared.
DEVICE_RANDOM = {"max_pmi_ub"}
#: Gates whose value is a ratio of wall-clock times (a monitor's cost per input relative to the model's forward
#: pass): it depends on the hardware, not only on the numbers; only the verdict is compared.
DEVICE_TIMED = {"max_monitor_overhead"}


def _gates(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["nodeid"]: g for g in run["gates"]}


def _compare_runs(cpu_run: dict[str, Any], gpu_run: dict[str, Any], rel: float) -> list[str]:
    cpu, gpu = _gates(cpu_run), _gates(gpu_run)
    assert set(gpu) == set(cpu) and len(cpu) >= 15, sorted(set(gpu) ^ set(cpu))
    problems = []
    for nodeid, a in cpu.items():
        b = gpu[nodeid]
        assert a["device"] == "cpu" and b["device"].startswith("cuda"), (nodeid, a["device"], b["device"])
        if (a["status"], a["passed"]) != (b["status"], b["passed"]):
            problems.append(f"{nodeid}: verdict {b['status']} on cuda vs {a['status']} on cpu")
        if a["marker"] in DEVICE_RANDOM or a["marker"] in DEVICE_TIMED:
            continue
        for key in ("value", "bound"):
            x, y = a.get(key), b.get(key)
            if (x is None) != (y is None) or (x is not None and not math.isclose(y, x, rel_tol=rel, abs_tol=1e-12)):
                problems.append(f"{nodeid} ({a['marker']}): {key} {y!r} on cuda vs {x!r} on cpu")
    return problems


@pytest.mark.parametrize("run", ["cuda", "cuda-no-tf32"])
def test_example_project_cuda_gates_equal_cpu(example_runs: dict[str, dict[str, Any]], run: str) -> None:
    """``--dnnsafety-device=cuda`` vs ``cpu``: every gate's value and bound to 1e-4 relative, every verdict equal.

    ``cuda-no-tf32`` (NVIDIA_TF32_OVERRIDE=0) tells a TF32 effect from a real difference should ``cuda`` fail.
    """
    problems = _compare_runs(example_runs["cpu"], example_runs[run], 1e-4)
    assert not problems, "\n".join(problems)


def test_example_project_monte_carlo_gates_agree_statistically(example_runs: dict[str, dict[str, Any]]) -> None:
    cpu = _gates(example_runs["cpu"])
    for name in ("cuda", "cuda-no-tf32"):
        gpu = _gates(example_runs[name])
        for nodeid, a in cpu.items():
            if a["marker"] in DEVICE_RANDOM:
                b = gpu[nodeid]
                assert b["status"] == a["status"], (name, nodeid, a["status"], b["status"])
                assert math.isclose(b["value"], a["value"], rel_tol=0.1, abs_tol=0.01), \
                    (name, nodeid, a["value"], b["value"])
