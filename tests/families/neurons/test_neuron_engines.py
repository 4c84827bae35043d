"""Neuron k-activation coverage (§II-B, eq. 2) and the activation-pattern metric (§II-C, eq. 3)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pytest_dnnsafety.engines.neurons.kactivation as neurons_module
from pytest_dnnsafety.engines import (
    Engine,
    NeuronCoverageResult,
    NeuronKActivationEngine,
    NeuronPatternEngine,
    PatternResult,
)
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError

Cell = tuple[tuple[int, ...], tuple[int, ...]]


# ---------------------------------------------------------------------- references
def brute_force(on: list[list[int]], c: int, k: int) -> tuple[list[Cell], set[Cell]]:
    """All cells in order (combinations × product) and the occupied ones, with itertools and a set."""
    cells = [
        (tup, states)
        for tup in itertools.combinations(range(c), k)
        for states in itertools.product((0, 1), repeat=k)
    ]
    occupied: set[Cell] = set()
    for tup in itertools.combinations(range(c), k):
        for row in on:
            occupied.add((tup, tuple(row[i] for i in tup)))
    return cells, occupied


def brute_force_shares(cells: list[Cell], occupied: set[Cell], c: int) -> list[float]:
    hit = [0] * c
    seen = [0] * c
    for tup, states in cells:
        for n in tup:
            seen[n] += 1
            hit[n] += (tup, states) in occupied
    return [h / s for h, s in zip(hit, seen)]


def random_on(gen: torch.Generator, n: int, c: int) -> torch.Tensor:
    """0/1 on-matrix with a random firing rate per neuron (some neurons nearly always on or off)."""
    rates = torch.rand(c, generator=gen) ** 2
    extreme = torch.rand(c, generator=gen) < 0.3
    rates[extreme] = torch.where(torch.rand(c, generator=gen) < 0.5, 0.97, 0.03)[extreme]
    return (torch.rand(n, c, generator=gen) < rates).to(torch.int64)


def as_activations(on: torch.Tensor, gen: torch.Generator, threshold: float = 0.0) -> torch.Tensor:
    """Float activations that are on exactly where ``on`` is 1 (off values include the threshold itself)."""
    high = threshold + 0.01 + torch.rand(on.shape, generator=gen)
    low = threshold - torch.rand(on.shape, generator=gen)
    low[torch.rand(on.shape, generator=gen) < 0.3] = threshold  # exactly at the threshold: off
    return torch.where(on.bool(), high, low)


def run(acts: torch.Tensor, k: int, threshold: float = 0.0, batch: int | None = None) -> NeuronKActivationEngine:
    engine = NeuronKActivationEngine(acts.shape[1], k=k, activation_threshold=threshold)
    for part in acts.split(batch or max(1, acts.shape[0])):
        engine.update(part)
    return engine


def check_against_brute_force(on: torch.Tensor, k: int, gen: torch.Generator, threshold: float = 0.0) -> None:
    n, c = on.shape
    engine = run(as_activations(on, gen, threshold), k, threshold)
    res = engine.compute()
    cells, occupied = brute_force(on.tolist(), c, k)
    missing = [cell for cell in cells if cell not in occupied]
    assert res.total == len(cells) == math.comb(c, k) * 2**k
    assert res.covered == len(occupied)
    assert res.value == len(occupied) / len(cells)
    assert res.n_inputs == n and res.k == k and res.n_neurons == c
    assert engine.missing_cells(None) == missing  # same cells, same (stable) order
    assert set(engine.missing_cells(None)) == set(missing)
    assert list(res.missing_patterns) == missing[:10]
    shares = brute_force_shares(cells, occupied, c)
    assert list(res.per_neuron) == pytest.approx(shares, abs=0, rel=1e-12)
    expected_least = sorted((i for i in range(c) if shares[i] < 1), key=lambda i: (shares[i], i))[:10]
    assert [i for i, _ in res.least_covered] == expected_least


# ---------------------------------------------------------------------- k-activation: exactness
@pytest.mark.parametrize(
    ("c", "k"), [(c, k) for c in (1, 2, 3, 4, 7, 13, 20) for k in (1, 2, 3) if k <= c]
)
def test_k_activation_equals_itertools_reference(c: int, k: int) -> None:
    gen = torch.Generator().manual_seed(1000 * c + k)
    for n in (1, 2, 5, 40):
        check_against_brute_force(random_on(gen, n, c), k, gen)


@pytest.mark.parametrize("k", [2, 3])
def test_k_activation_chunked_paths_equal_reference(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    """Tiny budgets force many neuron chunks, row slabs and row passes, and unaligned widths."""
    monkeypatch.setattr(neurons_module, "_CUBE_ELEMS", 64)
    monkeypatch.setattr(neurons_module, "_PAIR_ELEMS", 16)
    monkeypatch.setattr(neurons_module, "_SLAB_ELEMS", 200)
    monkeypatch.setattr(neurons_module, "_PASS_ELEMS", 19 * 7)
    monkeypatch.setattr(neurons_module, "_ALIGN", 4)
    gen = torch.Generator().manual_seed(7 + k)
    on = random_on(gen, 31, 19)
    engine = run(as_activations(on, gen), k)
    assert len(engine._chunks()) > 3
    check_against_brute_force(on, k, gen)


@pytest.mark.parametrize("k", [2, 3])
def test_k_activation_equals_dense_einsum_reference_on_a_wider_layer(k: int) -> None:
    """c = 70: an independent dense reference (one einsum per pattern) instead of Python loops."""
    gen = torch.Generator().manual_seed(70 + k)
    on = random_on(gen, 60, 70)
    engine = run(as_activations(on, gen), k)
    b = on.to(torch.float64)
    sides = (1 - b, b)  # state 0, state 1
    tuples = torch.tensor(list(itertools.combinations(range(70), k)))
    expected = []
    for states in itertools.product((0, 1), repeat=k):
        if k == 2:
            dense = torch.einsum("ni,nj->ij", sides[states[0]], sides[states[1]])
            expected.append(dense[tuples[:, 0], tuples[:, 1]] > 0)
        else:
            dense = torch.einsum("ni,nj,nl->ijl", sides[states[0]], sides[states[1]], sides[states[2]])
            expected.append(dense[tuples[:, 0], tuples[:, 1], tuples[:, 2]] > 0)
    assert torch.equal(engine.occupied, torch.stack(expected, dim=1))


def test_hand_worked_three_neurons_two_inputs_k2() -> None:
    # Inputs (on = activation > 0; 0.0 is exactly at the threshold, so off):
    #   x1 = (0.7, 0.0, 2.0) -> n0=1 n1=0 n2=1
    #   x2 = (-1., 0.0, 0.3) -> n0=0 n1=0 n2=1
    # The C(3,2)·2² = 12 cells and who occupies them:
    #   (n0,n1): 00 x2 | 01 -  | 10 x1 | 11 -
    #   (n0,n2): 00 -  | 01 x2 | 10 -  | 11 x1
    #   (n1,n2): 00 -  | 01 x1,x2 | 10 - | 11 -
    # -> 5 occupied of 12. n0 is in 8 cells, 4 occupied (0.5); n1: 3/8; n2: 3/8.
    engine = NeuronKActivationEngine(3, k=2)
    engine.update(torch.tensor([[0.7, 0.0, 2.0], [-1.0, 0.0, 0.3]]))
    res = engine.compute()
    assert (res.covered, res.total, res.n_inputs) == (5, 12, 2)
    assert res.value == 5 / 12
    assert res.per_neuron == (0.5, 0.375, 0.375)
    assert res.least_covered == ((1, 0.375), (2, 0.375), (0, 0.5))
    assert res.missing_patterns == (
        ((0, 1), (0, 1)),
        ((0, 1), (1, 1)),
        ((0, 2), (0, 0)),
        ((0, 2), (1, 0)),
        ((1, 2), (0, 0)),
        ((1, 2), (1, 0)),
        ((1, 2), (1, 1)),
    )
    assert engine.occupied.tolist() == [
        [True, False, True, False],
        [False, True, False, True],
        [False, True, False, False],
    ]
    assert res.detail() == (
        "k=2, 5/12 cells, 2 inputs; least covered: n1 0.38, n2 0.38, n0 0.50; missing: n0=0 n1=1, n0=1 n1=1, "
        "n0=0 n2=0, …"
    )
    assert res.summary().startswith("0.417 (k=2, 5/12 cells")


def test_no_inputs_gives_zero_coverage_and_full_missing_list() -> None:
    res = NeuronKActivationEngine(4, k=3).compute()
    assert (res.value, res.covered, res.total, res.n_inputs) == (0.0, 0, 32, 0)
    assert res.per_neuron == (0.0,) * 4
    assert len(res.missing_patterns) == 10 and res.missing_patterns[0] == ((0, 1, 2), (0, 0, 0))
    engine = NeuronKActivationEngine(4, k=3)
    engine.update(torch.zeros(0, 4))
    assert engine.compute() == res


def test_full_coverage_has_no_least_covered_or_missing() -> None:
    on = torch.tensor(list(itertools.product((0, 1), repeat=5)), dtype=torch.float32)
    engine = NeuronKActivationEngine(5, k=3)
    engine.update(on)
    res = engine.compute()
    assert res.value == 1.0 and res.missing == 0
    assert res.least_covered == () and res.missing_patterns == ()
    assert res.detail() == "k=3, 80/80 cells, 32 inputs"


def test_to_details_is_plain_json() -> None:
    gen = torch.Generator().manual_seed(3)
    engine = run(as_activations(random_on(gen, 9, 6), gen, 0.5), 2, 0.5)
    res = engine.compute()
    details = res.to_details()
    assert json.loads(json.dumps(details, allow_nan=False)) == details

    def plain(value: object) -> bool:
        if isinstance(value, dict):
            return all(isinstance(key, str) and plain(v) for key, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return type(value) in (str, int, float, bool) or value is None

    assert plain(details)
    assert details["covered"] == res.covered and details["k"] == 2 and details["activation_threshold"] == 0.5
    assert details["missing_patterns"][0] == {
        "neurons": list(res.missing_patterns[0][0]),
        "states": list(res.missing_patterns[0][1]),
    }
    assert "on > 0.5" in res.detail()


def test_integer_and_bool_activations_are_accepted() -> None:
    on = torch.tensor([[1, 0, 1], [0, 0, 1]])
    by_int = run(on, 2).compute()
    by_bool = run(on.bool(), 2).compute()
    by_float = run(on.float(), 2).compute()
    assert by_int == by_bool == by_float


# ---------------------------------------------------------------------- k-activation: properties
@st.composite
def activation_sets(draw: st.DrawFn, max_c: int = 9, max_n: int = 24):
    c = draw(st.integers(1, max_c))
    k = draw(st.integers(1, min(3, c)))
    threshold = draw(st.sampled_from([0.0, 0.5, -1.0]))
    values = st.sampled_from([threshold - 1.0, threshold, threshold + 0.25, threshold + 2.0])
    rows = draw(st.lists(st.lists(values, min_size=c, max_size=c), max_size=max_n))
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), c), k, threshold


@settings(max_examples=60, deadline=None)
@given(activation_sets(), st.data())
def test_value_in_unit_interval_and_monotone_in_inputs(case, data) -> None:
    acts, k, threshold = case
    cut = data.draw(st.integers(0, acts.shape[0]))
    engine = NeuronKActivationEngine(acts.shape[1], k=k, activation_threshold=threshold)
    engine.update(acts[:cut])
    before = engine.compute()
    engine.update(acts[cut:])
    after = engine.compute()
    assert 0.0 <= before.value <= after.value <= 1.0
    assert before.covered <= after.covered
    assert all(a <= b for a, b in zip(before.per_neuron, after.per_neuron))


@settings(max_examples=60, deadline=None)
@given(activation_sets(), st.data())
def test_merge_of_two_halves_equals_one_pass(case, data) -> None:
    acts, k, threshold = case
    cut = data.draw(st.integers(0, acts.shape[0]))
    whole = run(acts, k, threshold)
    left = NeuronKActivationEngine(acts.shape[1], k=k, activation_threshold=threshold)
    right = NeuronKActivationEngine(acts.shape[1], k=k, activation_threshold=threshold)
    left.update(acts[:cut])
    right.update(acts[cut:])
    merged = left.merge(right)
    assert torch.equal(merged.occupied, whole.occupied)
    assert merged.compute() == whole.compute()


@settings(max_examples=40, deadline=None)
@given(activation_sets())
def test_payload_round_trip(case) -> None:
    acts, k, threshold = case
    engine = NeuronKActivationEngine(acts.shape[1], k=k, activation_threshold=threshold)
    engine.update(acts)
    payload = json.loads(json.dumps(engine.state_payload()))
    for cls in (Engine, NeuronKActivationEngine):
        back = cls.from_payload(payload)
        assert isinstance(back, NeuronKActivationEngine)
        assert back.config() == engine.config()
        assert torch.equal(back.occupied, engine.occupied)
        assert back.compute() == engine.compute()
        back.update(acts)  # a rebuilt engine keeps counting
        assert back.compute().covered == engine.compute().covered


@settings(max_examples=60, deadline=None)
@given(activation_sets())
def test_k1_is_single_neuron_on_off_coverage(case) -> None:
    acts, _, threshold = case
    c = acts.shape[1]
    res = run(acts, 1, threshold).compute()
    on = acts > threshold
    seen_on = on.any(0).tolist() if acts.shape[0] else [False] * c
    seen_off = (~on).any(0).tolist() if acts.shape[0] else [False] * c
    assert res.total == 2 * c
    assert res.covered == sum(seen_on) + sum(seen_off)
    assert res.per_neuron == tuple((a + b) / 2 for a, b in zip(seen_on, seen_off))
    expected_missing = [((i,), (s,)) for i in range(c) for s in (0, 1) if not (seen_on if s else seen_off)[i]]
    assert list(res.missing_patterns) == expected_missing[:10]


@settings(max_examples=40, deadline=None)
@given(activation_sets(), st.lists(st.integers(1, 7), min_size=1, max_size=6))
def test_batch_size_does_not_change_any_result(case, sizes) -> None:
    acts, k, threshold = case
    one = NeuronKActivationEngine(acts.shape[1], k=k, activation_threshold=threshold)
    one.update(acts)
    batched = NeuronKActivationEngine(acts.shape[1], k=k, activation_threshold=threshold)
    start, i = 0, 0
    while start < acts.shape[0]:
        step = sizes[i % len(sizes)]
        batched.update(acts[start : start + step])
        start, i = start + step, i + 1
    assert torch.equal(batched.occupied, one.occupied)
    assert batched.compute() == one.compute()


@settings(max_examples=60, deadline=None)
@given(activation_sets())
def test_activation_threshold_is_strict(case) -> None:
    """Engine(x, t) == engine on the 0/1 matrix (x > t) with threshold 0: values equal to t are off."""
    acts, k, threshold = case
    c = acts.shape[1]
    direct = NeuronKActivationEngine(c, k=k, activation_threshold=threshold)
    direct.update(acts)
    binary = NeuronKActivationEngine(c, k=k)
    binary.update((acts > threshold).to(torch.float32))
    assert torch.equal(direct.occupied, binary.occupied)
    at_threshold = NeuronKActivationEngine(c, k=1, activation_threshold=threshold)
    at_threshold.update(torch.full((3, c), threshold))
    res = at_threshold.compute()
    assert res.per_neuron == (0.5,) * c and res.missing_patterns == tuple(((i,), (1,)) for i in range(min(c, 10)))


# ---------------------------------------------------------------------- pattern metric
def pattern_reference(counts: list[int], c: int, gamma: int) -> tuple[list[int], int, float]:
    """Direct eq. (3): groups by min(γ-1, ⌊count·γ/c⌋), j = first largest group, outside j-1..j+1."""
    sizes = [0] * gamma
    for count in counts:
        sizes[min(gamma - 1, math.floor(count * gamma / c))] += 1
    j = sizes.index(max(sizes))
    outside = sum(size for i, size in enumerate(sizes) if i not in (j - 1, j, j + 1))
    return sizes, j, outside / len(counts)


@pytest.mark.parametrize(("c", "gamma"), [(10, 10), (10, 3), (7, 4), (256, 10), (13, 1), (5, 5), (100, 7)])
def test_pattern_metric_equals_direct_computation(c: int, gamma: int) -> None:
    gen = torch.Generator().manual_seed(c * 31 + gamma)
    for n in (1, 3, 50, 400):
        centre = torch.rand(1, generator=gen).item()
        acts = torch.randn(n, c, generator=gen) + 2 * (centre - 0.5) + 0.8 * torch.randn(n, 1, generator=gen)
        engine = NeuronPatternEngine(c, groups=gamma)
        engine.update(acts)
        res = engine.compute()
        counts = (acts > 0).sum(1).tolist()
        sizes, j, value = pattern_reference(counts, c, gamma)
        assert list(res.group_sizes) == sizes
        assert res.dominant_group == j
        assert res.value == value
        assert res.n_inputs == n and res.deviating == round(value * n)


def test_pattern_boundary_rule_for_c_not_divisible_by_groups() -> None:
    # c = 10, γ = 3: width 10/3; group = min(2, ⌊3·count/10⌋)
    engine = NeuronPatternEngine(10, groups=3)
    assert engine.group_of(torch.arange(11)).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    rows = []
    for count in range(11):
        rows.append([1.0] * count + [0.0] * (10 - count))
    engine.update(torch.tensor(rows))
    res = engine.compute()
    assert res.group_sizes == (4, 3, 4)
    assert res.group_ranges == ((0, 3), (4, 6), (7, 10))
    assert res.dominant_group == 0  # tie between groups 0 and 2 -> the lowest index
    assert res.value == 4 / 11  # group 2 lies outside {-1, 0, 1}
    assert res.detail() == "γ=3 over 10 neurons, 11 inputs; dominant group 0 (0–3 on): 4; 4 outside groups 0–1"
    assert res.summary() == f"{4 / 11:.3f} ({res.detail()})"


def test_pattern_ties_pick_the_lowest_group() -> None:
    # c = 4, γ = 4, counts 0,0,2,2,3 -> sizes [2, 0, 2, 1]; tie 0 vs 2 -> j = 0, outside {0, 1}: 3 of 5.
    rows = [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [0, 1, 0, 1], [1, 1, 1, 0]]
    engine = NeuronPatternEngine(4, groups=4)
    engine.update(torch.tensor(rows, dtype=torch.float32))
    res = engine.compute()
    assert res.group_sizes == (2, 0, 2, 1)
    assert res.dominant_group == 0
    assert (res.deviating, res.value) == (3, 3 / 5)


def test_pattern_threshold_is_strict_and_all_in_one_group_gives_zero() -> None:
    engine = NeuronPatternEngine(4, groups=2, activation_threshold=0.5)
    engine.update(torch.tensor([[0.5, 0.5, 0.6, 0.0], [0.5, 0.9, 0.1, 0.2]]))
    res = engine.compute()
    assert res.group_sizes == (2, 0) and res.value == 0.0  # one on each: counts 1, 1


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 12).flatmap(
        lambda c: st.tuples(
            st.just(c),
            st.integers(1, c),
            st.lists(st.lists(st.sampled_from([-1.0, 0.0, 1.0]), min_size=c, max_size=c), min_size=1, max_size=30),
        )
    ),
    st.data(),
)
def test_pattern_merge_payload_and_reference(case, data) -> None:
    c, gamma, rows = case
    acts = torch.tensor(rows)
    cut = data.draw(st.integers(0, len(rows)))
    left, right = NeuronPatternEngine(c, groups=gamma), NeuronPatternEngine(c, groups=gamma)
    left.update(acts[:cut])
    right.update(acts[cut:])
    whole = NeuronPatternEngine(c, groups=gamma)
    whole.update(acts)
    merged = left.merge(right)
    assert torch.equal(merged.histogram, whole.histogram)
    res = merged.compute()
    assert res == whole.compute()
    assert 0.0 <= res.value <= 1.0
    sizes, j, value = pattern_reference((acts > 0).sum(1).tolist(), c, gamma)
    assert (list(res.group_sizes), res.dominant_group, res.value) == (sizes, j, value)
    back = Engine.from_payload(json.loads(json.dumps(whole.state_payload())))
    assert isinstance(back, NeuronPatternEngine) and back.compute() == res
    details = res.to_details()
    assert json.loads(json.dumps(details)) == details


def test_pattern_result_is_frozen() -> None:
    engine = NeuronPatternEngine(3, groups=3)
    engine.update(torch.ones(2, 3))
    res = engine.compute()
    assert isinstance(res, PatternResult)
    with pytest.raises(AttributeError):
        res.value = 0.5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        NeuronKActivationEngine(3).compute().value = 1.0  # type: ignore[misc]
    assert isinstance(NeuronKActivationEngine(3).compute(), NeuronCoverageResult)


# ---------------------------------------------------------------------- errors
def small_pattern_engine(n_neurons, **kwargs) -> NeuronPatternEngine:
    """A pattern engine whose group count fits small layers (the default γ = 10 needs c ≥ 10)."""
    return NeuronPatternEngine(n_neurons, groups=1, **kwargs)


ENGINES = pytest.mark.parametrize(
    "engine_cls", [NeuronKActivationEngine, small_pattern_engine], ids=["k_activation", "pattern"]
)


@ENGINES
def test_activations_with_wrong_ndim(engine_cls) -> None:
    with pytest.raises(DataError, match=r"2-D.*\(2, 4, 3, 3\).*amax\(dim=\(2, 3\)\)"):
        engine_cls(4).update(torch.zeros(2, 4, 3, 3))
    with pytest.raises(DataError, match=r"2-D.*\(4,\)"):
        engine_cls(4).update(torch.zeros(4))


@ENGINES
def test_activations_with_wrong_number_of_neurons(engine_cls) -> None:
    with pytest.raises(DataError, match=r"have 5 neurons.*n_neurons=4"):
        engine_cls(4).update(torch.zeros(3, 5))


@ENGINES
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_activations_with_nan_or_inf(engine_cls, bad: float) -> None:
    acts = torch.zeros(3, 4)
    acts[2, 1] = bad
    engine = engine_cls(4)
    with pytest.raises(DataError, match=r"non-finite.*input 2, neuron 1"):
        engine.update(acts)
    engine.update(acts, validate=False)  # the caller's choice: no check, no sync


@ENGINES
def test_activations_not_a_tensor(engine_cls) -> None:
    with pytest.raises(DataError, match="must be a torch.Tensor"):
        engine_cls(2).update([[0.0, 1.0]])
    with pytest.raises(DataError, match="real numbers"):
        engine_cls(2).update(torch.zeros(1, 2, dtype=torch.complex64))


@pytest.mark.parametrize("k", [0, 4, -1, 2.0, True])
def test_k_outside_one_to_three(k) -> None:
    with pytest.raises(ConfigError, match="k=.* must be an integer between 1 and 3"):
        NeuronKActivationEngine(10, k=k)


def test_k_larger_than_neurons() -> None:
    with pytest.raises(ConfigError, match=r"k=3 needs at least 3 neurons but n_neurons=2"):
        NeuronKActivationEngine(2, k=3)


@ENGINES
@pytest.mark.parametrize("c", [0, -3, 2.5])
def test_n_neurons_below_one(engine_cls, c) -> None:
    with pytest.raises(ConfigError, match="n_neurons=.* must be"):
        engine_cls(c)


@pytest.mark.parametrize("groups", [0, 11, -2])
def test_groups_outside_one_to_neurons(groups: int) -> None:
    with pytest.raises(ConfigError, match=r"groups=-?\d+ must be an integer between 1 and 10"):
        NeuronPatternEngine(10, groups=groups)


@ENGINES
@pytest.mark.parametrize("threshold", [float("nan"), float("inf"), "0", None])
def test_activation_threshold_not_finite(engine_cls, threshold) -> None:
    with pytest.raises(ConfigError, match="activation_threshold must be a finite number"):
        engine_cls(4, activation_threshold=threshold)


def test_too_many_cells_for_k3() -> None:
    with pytest.raises(ConfigError, match=r"k=3 over n_neurons=1024 gives .* cells \(limit"):
        NeuronKActivationEngine(1024, k=3)


def test_pattern_without_inputs() -> None:
    engine = NeuronPatternEngine(8, groups=4)
    engine.update(torch.zeros(0, 8))
    with pytest.raises(MetricError, match=r"no inputs were measured"):
        engine.compute()


def test_merge_with_different_configuration() -> None:
    with pytest.raises(ValueError, match="different 'k'"):
        NeuronKActivationEngine(5, k=2).merge(NeuronKActivationEngine(5, k=3))
    with pytest.raises(ValueError, match="different 'activation_threshold'"):
        NeuronPatternEngine(5, groups=2).merge(NeuronPatternEngine(5, groups=2, activation_threshold=1.0))


def test_to_device_rebuilds_the_plan() -> None:
    engine = NeuronKActivationEngine(6, k=3)
    engine.update(torch.randn(5, 6))
    assert engine._plan is not None
    engine.to("cpu")
    assert engine._plan is None
    engine.update(torch.randn(5, 6))
    assert engine.compute().n_inputs == 10


def test_large_bool_states_travel_bit_packed() -> None:
    """A k=3 table of 256 neurons (22 million cells) crosses xdist as a compact string."""
    engine = NeuronKActivationEngine(256, k=3)
    engine.update((torch.rand(64, 256, generator=torch.Generator().manual_seed(5)) > 0.5).float())
    payload = engine.state_payload()
    text = json.dumps(payload)
    assert len(text) < 4_000_000  # 22M cells at 1 bit each, base64: ~3.7 MB (a JSON list would be ~140 MB)
    rebuilt = NeuronKActivationEngine.from_payload(json.loads(text))
    assert rebuilt.compute().covered == engine.compute().covered
