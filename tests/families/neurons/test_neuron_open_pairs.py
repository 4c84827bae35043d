"""k-activation's incremental k = 2 path (only the open pairs get work) against brute force and the dense path."""

from __future__ import annotations

import itertools

import pytest
import torch

from pytest_dnnsafety.engines import NeuronKActivationEngine
from pytest_dnnsafety.engines.neurons import open_pairs
from pytest_dnnsafety.engines.neurons.open_pairs import OpenPairs, decode_pairs


def brute_table(on: torch.Tensor, k: int) -> torch.Tensor:
    """The occupied table (tuples in combinations order × patterns in product order) by itertools and a set."""
    rows = on.tolist()
    c = on.shape[1]
    table = []
    for tup in itertools.combinations(range(c), k):
        seen = {tuple(row[i] for i in tup) for row in rows}
        table.append([states in seen for states in itertools.product((0, 1), repeat=k)])
    return torch.tensor(table, dtype=torch.bool).reshape(-1, 2**k)


def layer_on(gen: torch.Generator, n: int, c: int) -> torch.Tensor:
    """0/1 states like a layer's: common, rare, never-on, always-on neurons and near copies of others."""
    rates = 0.1 + 0.6 * torch.rand(c, generator=gen)
    kind = torch.randint(0, 6, (c,), generator=gen)
    rates[kind == 0] = 0.01
    rates[kind == 1] = 0.0
    rates[kind == 2] = 1.0
    on = torch.rand(n, c, generator=gen) < rates
    copies = torch.nonzero(kind == 3).reshape(-1)
    source = torch.randint(0, c, (len(copies),), generator=gen)
    flip = torch.rand(n, len(copies), generator=gen) < 0.01
    on[:, copies] = on[:, source] ^ flip
    return on.to(torch.int64)


def as_acts(on: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Activations with those states: positive when on, zero or negative when off."""
    mag = torch.rand(on.shape, generator=gen) + 0.1
    return torch.where(on.bool(), mag, -mag * (torch.rand(on.shape, generator=gen) < 0.5))


def streamed(acts: torch.Tensor, sizes: list[int], **kwargs) -> NeuronKActivationEngine:
    engine = NeuronKActivationEngine(acts.shape[1], **kwargs)
    start = 0
    for size in itertools.cycle(sizes):
        if start >= acts.shape[0]:
            break
        engine.update(acts[start : start + size])
        start += size
    return engine


@pytest.fixture
def eager(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Build the open list from the first block on and take the cover path whenever it can; count its uses."""
    monkeypatch.setattr(open_pairs, "OPEN_SHARE", 1.0)
    monkeypatch.setattr(open_pairs, "COVER_SHARE", 1.0)
    uses: list[int] = []
    fold = OpenPairs.fold

    def counted(self, occupied, b, s):  # type: ignore[no-untyped-def]
        done = fold(self, occupied, b, s)
        uses.append(int(done))
        return done

    monkeypatch.setattr(OpenPairs, "fold", counted)
    return uses


def dense(acts: torch.Tensor, sizes: list[int], monkeypatch: pytest.MonkeyPatch) -> NeuronKActivationEngine:
    with monkeypatch.context() as m:
        m.setattr(open_pairs, "MAX_OPEN_PAIRS", -1)
        return streamed(acts, sizes, k=2)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("sizes", [[1], [3, 7], [40], [400]])
def test_open_pair_path_equals_brute_force_and_dense(seed: int, sizes: list[int], eager, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(seed)
    c = 5 + seed * 3
    on = layer_on(gen, 120 if sizes == [1] else 400, c)
    acts = as_acts(on, gen)
    engine = streamed(acts, sizes, k=2)
    assert sum(eager) > 0  # the incremental path did run
    assert torch.equal(engine.occupied, brute_table(on, 2))
    reference = dense(acts, sizes, monkeypatch)
    assert torch.equal(engine.occupied, reference.occupied)
    assert engine.compute() == reference.compute()


def test_default_settings_on_a_wider_layer_equal_dense(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(7)
    on = layer_on(gen, 3_000, 96)
    acts = as_acts(on, gen)
    uses: list[int] = []
    fold = OpenPairs.fold
    monkeypatch.setattr(OpenPairs, "fold", lambda self, *a: uses.append(1) or fold(self, *a))
    engine = streamed(acts, [250], k=2)
    assert uses  # default thresholds: the open list took over after the first blocks
    assert torch.equal(engine.occupied, dense(acts, [250], monkeypatch).occupied)
    assert torch.equal(engine.occupied, brute_table(on, 2))


def test_state_changed_outside_update_rebuilds_the_list(eager) -> None:
    gen = torch.Generator().manual_seed(3)
    c = 12
    on = layer_on(gen, 300, c)
    acts = as_acts(on, gen)
    engine = streamed(acts[:100], [50], k=2)
    other = streamed(acts[100:200], [50], k=2)
    engine.merge(other)  # replaces the state tensor
    engine.update(acts[200:250])
    engine.occupied[0] |= True  # in place: bumps the version counter
    engine.occupied[0] = brute_table(on[:250], 2)[0]
    engine.update(acts[250:])
    assert torch.equal(engine.occupied, brute_table(on, 2))
    engine.reset()
    engine.update(acts[:10])
    assert torch.equal(engine.occupied, brute_table(on[:10], 2))
    engine.to("cpu")
    engine.update(acts[10:])
    assert torch.equal(engine.occupied, brute_table(on, 2))


def test_complete_layer_needs_no_more_work(eager) -> None:
    on = torch.tensor(list(itertools.product((0, 1), repeat=4)))  # every pattern of every pair
    engine = streamed(on.float(), [16], k=2)
    assert engine.compute().value == 1.0
    engine.update(on.float())  # nothing open: the update returns at once
    assert engine._open is not None and len(engine._open) == 0
    assert engine.compute().value == 1.0


def test_decode_pairs_is_combinations_order() -> None:
    c = 9
    pairs = list(itertools.combinations(range(c), 2))
    first, second = decode_pairs(torch.arange(len(pairs)), c)
    assert list(zip(first.tolist(), second.tolist())) == pairs


@pytest.mark.parametrize("k", [1, 3])
def test_streamed_k1_and_k3_equal_brute_force(k: int) -> None:
    gen = torch.Generator().manual_seed(11 + k)
    on = layer_on(gen, 200, 9)
    engine = streamed(as_acts(on, gen), [1, 13, 60], k=k)
    assert torch.equal(engine.occupied, brute_table(on, k))
