"""Ball cells at image scale (issue #21): the sampler's blocks and batches, known-truth coverage, streamed data.

* Images cut the Monte Carlo stream into blocks of at most ``BLOCK_ELEMS`` values
  (:func:`~pytest_dnnsafety.engines.reliability.sampler.block_size`): up to 1,024 values per input
  nothing changed (the stream of earlier releases), above it the stream is new — so its bound is
  checked here by simulation on a known-truth case (L∞ and L2), and its independence of the
  batch size across both of the sampler's paths (in-place per ball, gathered rows).
* Centres and labelled points from a ``DataLoader`` (:mod:`~pytest_dnnsafety.engines.reliability.streamed`)
  give the numbers of the same data held, read in blocks no larger than ``STREAM_ELEMS`` values,
  and the ``max_pmi_ub`` gate streams a loader of :class:`_streaming.StreamingImages` (never calling
  the whole-data reader).
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from _streaming import FAMILIES, write_project
from pytest_dnnsafety.runtime import torchrun as ranks
from pytest_dnnsafety.engines.reliability import (BLOCK, ReliabilityAssessor, ReliabilityOptions, assess_reliability,
                                                   streamed)
from pytest_dnnsafety.engines.reliability.sampler import block_size
from pytest_dnnsafety.errors import DataError, MetricError

D = 3 * 32 * 32  # a CIFAR-sized image: blocks of 256 samples
SHAPE = (1, 48, 48)  # the tests' images: 2,304 values, blocks of 256 samples (the new stream), cheaper than CIFAR


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def test_block_size_keeps_the_old_stream_up_to_1024_values_and_shrinks_for_images() -> None:
    assert block_size("grid", 10**6) == BLOCK
    assert [block_size("balls", d) for d in (1, 2, 64, 1024)] == [BLOCK] * 4
    assert block_size("balls", D) == block_size("balls", math.prod(SHAPE)) == 256
    assert block_size("balls", 3 * 224 * 224) == 4
    assert block_size("balls", 10**8) == 1


def _images(m: int, seed: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return 0.2 + 0.6 * torch.rand((m, *shape), generator=torch.Generator().manual_seed(seed))


def _pixel_model(x: torch.Tensor) -> torch.Tensor:
    logit = 4 * (x.reshape(x.shape[0], -1)[:, :8].mean(1) - 0.5)
    return torch.stack([logit, -logit], 1)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_image_balls_do_not_depend_on_the_batch_size(norm: str) -> None:
    """The same samples, so the same failures, whatever the batch: 200 samples per ball in batches of 1 and 4 blocks
    (1,024 and 4,096 samples, balls written in place one by one) and "auto"; then 4 samples per ball, where a
    batch of 4 blocks touches all 300 balls (their corners gathered to the rows) and one of 1 block 256."""
    radius = 0.1 if norm == "linf" else 2.0
    for m, n, sizes in ((12, 200, (1024, 4096, "auto")), (300, 4, (1024, 4096))):
        x = _images(m, 1)
        y = torch.arange(m) % 2
        results = [_quiet(assess_reliability, _pixel_model, x, (x, y), cells="balls", norm=norm, radius=radius,
                          clip=(0.0, 1.0), samples_per_cell=n, bootstrap=0, batch_size=b, seed=4) for b in sizes]
        fails = [r.cells.failures for r in results]
        assert int(fails[0].sum()) > 0
        assert all(torch.equal(fails[0], f) for f in fails[1:])


# ---------------------------------------------------------------------------------------------- coverage
COVERAGE_SEEDS = 60
P_FAIL = 0.1


def _stripe_model(x: torch.Tensor) -> torch.Tensor:
    """Class 0, except where the first value's fractional part of 40·x₀ is below ``P_FAIL`` (class 1).

    An L∞ ball of radius 0.05 (unclipped) spans 4 periods in x₀, so a uniform sample fails with
    probability exactly ``P_FAIL``, in every ball.
    """
    fail = torch.remainder(x.reshape(x.shape[0], -1)[:, 0].double() * 40.0, 1.0) < P_FAIL
    return torch.nn.functional.one_hot(fail.long(), 2).float()


def _shell_model(centre: torch.Tensor, radius: float):
    """Fails inside the L2 ball of radius ``radius · P_FAIL^{1/d}`` around ``centre``: probability ``P_FAIL`` for a
    uniform sample of the L2 ball of ``radius`` there (``P(‖x − c‖ ≤ s) = (s/ε)^d``)."""
    d = centre.numel()
    inner = radius * P_FAIL ** (1.0 / d)

    def model(x: torch.Tensor) -> torch.Tensor:
        dist = torch.linalg.vector_norm(x.reshape(x.shape[0], -1).double() - centre.reshape(1, -1).double(), dim=1)
        return torch.nn.functional.one_hot((dist <= inner).long(), 2).float()

    return model


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_image_ball_bounds_cover_a_known_truth(norm: str) -> None:
    """The new image-sized stream (blocks of 256 samples at 1×48×48): the true pmi is exactly ``P_FAIL`` in every
    ball; over 60 seeds the mean estimate is within 3 standard errors of it and the sound bounds cover it at
    least at the nominal 97.5 %."""
    m, n = 8, 100
    if norm == "linf":
        centres = _images(m, 7).reshape(m, -1)
        centres[:, 0] = 0.3 + torch.arange(m) / (40.0 * m)  # balls of x₀-width 0.1 = 4 periods, unclipped
        centres = centres.reshape(m, *SHAPE)
        model, radius = _stripe_model, 0.05
    else:
        centres = torch.full((m, *SHAPE), 0.5)  # one centre for all (the model knows it); no clipping at 0.4
        radius = 0.4
        model = _shell_model(centres[0], radius)
    labels = torch.zeros(m, dtype=torch.int64)  # every ball normal, label 0
    estimates, covered = [], {"chernoff": 0, "clopper-pearson": 0}
    for seed in range(COVERAGE_SEEDS):
        result = _quiet(assess_reliability, model, centres, (centres, labels), cells="balls", norm=norm,
                        radius=radius, clip=(0.0, 1.0), samples_per_cell=n, bootstrap=0, seed=seed,
                        compare_methods=("clopper-pearson",), labelled_from_profile=False)
        assert result.cells_normal == m
        estimates.append(result.E)
        covered["chernoff"] += int(result.Ub >= P_FAIL)
        covered["clopper-pearson"] += int(result.alternatives["clopper-pearson"].Ub >= P_FAIL)
    mean = sum(estimates) / len(estimates)
    se = math.sqrt(P_FAIL * (1 - P_FAIL) / (m * n * COVERAGE_SEEDS))
    assert abs(mean - P_FAIL) <= 3 * se, (mean, se)
    assert covered["chernoff"] / COVERAGE_SEEDS >= 0.975, covered
    assert covered["clopper-pearson"] / COVERAGE_SEEDS >= 0.975, covered


# ---------------------------------------------------------------------------------------------- streamed data
def _held_and_streamed(mixed: bool = False, **options):
    x = _images(40, 2, (2, 4, 4))
    y = (x.reshape(40, -1)[:, :8].mean(1) > 0.5).long()
    base = dict(cells="balls", clip=(0.0, 1.0), samples_per_cell=200, bootstrap=0, seed=3)
    base.update(options)
    held = _quiet(assess_reliability, _pixel_model, x, (x, y), **base)
    centres = x if mixed else DataLoader(TensorDataset(x), batch_size=7)  # mixed: held centres, streamed labels
    stream = _quiet(assess_reliability, _pixel_model, centres, DataLoader(TensorDataset(x, y), batch_size=9), **base)
    return held, stream


@pytest.mark.parametrize("options", [
    {"norm": "linf"},
    {"norm": "l2", "bootstrap": 20},
    {"norm": "linf", "radius": 0.3, "empty_cell_label": "nearest"},
    {"norm": "linf", "max_balls": 17, "allocation": "adaptive"},
    {"norm": "l2", "mixed": True},
], ids=["linf", "l2-bootstrap", "nearest", "max_balls-adaptive", "held-centres"])
def test_streamed_balls_give_the_numbers_of_the_held_data(options: dict) -> None:
    held, stream = _held_and_streamed(**options)
    assert stream.r_hat == held.r_hat
    assert (stream.E, stream.Ub, stream.model_queries) == (held.E, held.Ub, held.model_queries)
    for field in ("flat", "cell_type", "label", "failures", "trials"):
        assert torch.equal(getattr(stream.cells, field), getattr(held.cells, field)), field
    assert stream.cells.lower.shape == (stream.cells_evaluated, 0)  # no corners from streamed centres
    assert stream.labelled_check == held.labelled_check


@pytest.mark.slow
def test_streamed_balls_hold_a_bounded_block_and_shard_like_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _images(60, 3, (2, 4, 4))
    y = torch.arange(60) % 2
    monkeypatch.setattr(streamed, "STREAM_ELEMS", 32 * 10)  # blocks of 10 inputs of 32 values
    seen: list[int] = []
    distances = streamed._ball_distances

    def spy(a: torch.Tensor, b: torch.Tensor, norm: str) -> torch.Tensor:
        seen.append(max(a.shape[0], b.shape[0]))
        return distances(a, b, norm)

    monkeypatch.setattr(streamed, "_ball_distances", spy)
    options = dict(cells="balls", radius=0.05, clip=(0.0, 1.0), samples_per_cell=1000, bootstrap=0, seed=1)
    loaders = (DataLoader(TensorDataset(x), batch_size=8), DataLoader(TensorDataset(x, y), batch_size=8))
    single = ReliabilityAssessor(*loaders, options=ReliabilityOptions.of(**options))
    assert max(seen) <= 10
    engine = single.sample(_pixel_model)
    held_rows = []
    parts = []
    for rank in range(3):  # each rank's window starts a pass and skips to its first block
        assessor = ReliabilityAssessor(*loaders, options=ReliabilityOptions.of(**options))
        parts.append(assessor.sample(_pixel_model, rank=rank, world_size=3))
        held_rows.append(int(assessor._window._held.shape[0]))
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merge(part)
    assert torch.equal(merged.compute(), engine.compute())
    assert max(held_rows) <= 20  # a model batch's balls (2 blocks: ≤ 10) and a loader batch (8), not all 60


def test_streamed_loaders_must_be_ordered_and_re_iterable() -> None:
    x = _images(20, 4, (1, 4, 4))
    y = torch.arange(20) % 2
    shuffled = DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True)
    with pytest.raises(DataError, match="shuffle=False"):
        ReliabilityAssessor(x, shuffled, options=ReliabilityOptions.of(cells="balls", radius=0.05))

    class Once(torch.utils.data.IterableDataset):
        def __init__(self) -> None:
            self.used = False

        def __iter__(self):
            if self.used:
                return iter(())
            self.used = True
            return iter(zip(x, y))

    with pytest.raises(DataError, match="re-iterable"):
        ReliabilityAssessor(x, DataLoader(Once(), batch_size=5),
                            options=ReliabilityOptions.of(cells="balls", radius=0.05))
    unlabelled = DataLoader(TensorDataset(x), batch_size=5)
    with pytest.raises(DataError, match="without labels"):
        ReliabilityAssessor(x, unlabelled, options=ReliabilityOptions.of(cells="balls", radius=0.05))


@pytest.mark.slow
def test_the_pmi_gate_streams_a_loader_of_images(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The streaming family's ``max_pmi_ub`` (centres and labelled points from one ``DataLoader`` of
    ``StreamingImages``) reaches a verdict without the whole-data reader."""
    import pytest_dnnsafety.files.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("max_pmi_ub with cells='balls' materialised a DataLoader")

    monkeypatch.setattr(loading, "as_tensors", refuse)
    tests = write_project(pytester.path, {"pmi": FAMILIES["pmi"]})
    for name in ranks.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STREAM_RECORD_DIR", str(pytester.path))
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", "--dnnsafety-json=evidence.json")
    gates = json.loads((pytester.path / "evidence.json").read_text())["gates"]
    assert [g["nodeid"].split("::")[1] for g in gates] == list(tests), result.stdout.str()[-3000:]
    assert gates[0]["status"] in {"passed", "failed"}, gates[0]["summary"]
    record = json.loads((pytester.path / "ranksingle.json").read_text())
    assert record["loaded"]["pmi"] >= 60


def test_streamed_balls_refuse_what_the_held_data_refuse() -> None:
    """Streamed like held: a wrong model gets a high bound, labels outside the model's classes and NaN logits
    are errors naming the fix (never a number)."""
    x = _images(40, 2, (2, 4, 4))
    y = (x.reshape(40, -1)[:, :8].mean(1) > 0.5).long()
    base = dict(cells="balls", clip=(0.0, 1.0), samples_per_cell=200, bootstrap=0, seed=3, norm="linf")
    centres = DataLoader(TensorDataset(x), batch_size=7)

    def labelled(labels: torch.Tensor) -> DataLoader:
        return DataLoader(TensorDataset(x, labels), batch_size=9)

    right = _quiet(assess_reliability, _pixel_model, centres, labelled(1 - y), **base)
    wrong = _quiet(assess_reliability, _pixel_model, centres, labelled(y), **base)  # wrong on every input
    assert right.Ub < 0.2 and wrong.E > 0.8 and wrong.labelled_check["errors"] == 40
    with pytest.raises(DataError, match="holds class 43 but the model has 2 classes"):
        _quiet(assess_reliability, _pixel_model, centres, labelled(y + 42), **base)
    with pytest.raises(MetricError, match="NaN/inf"):
        _quiet(assess_reliability, lambda z: _pixel_model(z) * float("nan"), centres, labelled(y), **base)
