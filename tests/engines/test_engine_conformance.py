"""Conformance of every metric engine to the Engine protocol (issue #20, item 6).

Each concrete :class:`~pytest_dnnsafety.engines.core.base.Engine` of the package has a case in
``tests/_engine_cases.py`` (a new engine without one fails :func:`test_every_engine_has_a_case`).
Per engine:

1. batch-split invariance: one batch or several give the same ``compute()``;
2. merge: two engines over two halves, merged, equal one engine over all;
3. payload round trip: ``from_payload(state_payload())`` (also through ``json``) gives equal
   states and ``compute()``;
4. reset: the default states, and fresh data then computes what a fresh engine does (also: the
   configuration survives ``from_config(config())`` through JSON, and an empty batch changes nothing);
5. determinism: the same inputs twice give identical states;
6. 2-rank gloo ``sync``: each rank updates with its half and ``sync()``s; ``compute()`` equals the
   single-process result, also when one rank saw every row and the other none (one spawn runs every
   case; the assertions are per engine); likewise a merge with an engine that saw nothing;
7. with CUDA: CPU/CUDA parity of ``compute()`` (built on CUDA, or moved there with ``to()``) and no
   host sync inside ``update`` (under ``torch.cuda.set_sync_debug_mode("error")``, with the case's
   trusted arguments).

Results are compared exactly, except for cases that declare float sums (``exact=False`` with the
reason), which are compared to a relative tolerance.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from _engine_cases import CASES, HALF, N, SPLIT, EngineCase, computed, discover_engines, gloo_rank, run_rows, same
from _gloo import GLOO_AVAILABLE, run_on_gloo_ranks

from pytest_dnnsafety.engines.core.base import Engine

CUDA = torch.cuda.is_available()
IDS = [case.id for case in CASES]


def _states_identical(a: Engine, b: Engine) -> str | None:
    """None when every state has the same dtype, shape and values (NaN equal to NaN), bit for bit."""
    if a.state_names != b.state_names:
        return f"state names {a.state_names} vs {b.state_names}"
    for name in a.state_names:
        x, y = getattr(a, name).cpu(), getattr(b, name).cpu()
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"state {name!r}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        equal = x == y
        if x.dtype.is_floating_point:
            equal |= torch.isnan(x) & torch.isnan(y)
        if not bool(equal.all()):
            return f"state {name!r} differs: {x.flatten()[:8].tolist()} vs {y.flatten()[:8].tolist()}"
    return None


def _check(case: EngineCase, got: Any, want: Any, exact: bool | None = None) -> None:
    assert "error" not in want, f"{case.id}: the reference compute() failed: {want['error']}"
    problem = same(got, want, case.exact if exact is None else exact, case.rtol)
    assert problem is None, f"{case.id}: {problem}"


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """Every case's ``compute()`` over all N rows (seed 0) in one batch."""
    return {case.id: computed(run_rows(case, case.rows(0), [N])) for case in CASES}


def test_every_engine_has_a_case() -> None:
    engines = discover_engines()
    covered = {case.engine for case in CASES}
    missing = [cls._qualified_name() for cls in engines if cls not in covered]
    assert not missing, f"engines without a conformance case in tests/_engine_cases.py: {missing}"
    stale = [cls._qualified_name() for cls in covered if cls not in engines]
    assert not stale, f"cases for classes that are not registered engines: {stale}"
    assert len(IDS) == len(set(IDS)) == len(engines)
    print(f"{len(engines)} engines, {len(CASES)} conformance cases")
    assert len(engines) >= 12  # the engines of issue #20's start; helpers only add


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cases_are_honest_about_exactness(case: EngineCase) -> None:
    assert case.exact or case.why, f"{case.id}: not exact without a reason"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_batch_split_invariance(case: EngineCase, reference: dict[str, Any]) -> None:
    assert sum(SPLIT) == N
    _check(case, computed(run_rows(case, case.rows(0), SPLIT)), reference[case.id])
    _check(case, computed(run_rows(case, case.rows(0), [1] * N)), reference[case.id])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_merge_of_two_halves_equals_one_pass(case: EngineCase, reference: dict[str, Any]) -> None:
    rows = case.rows(0)
    first = run_rows(case, {k: t[:HALF] for k, t in rows.items()}, [5, HALF - 5])
    second = run_rows(case, {k: t[HALF:] for k, t in rows.items()}, [N - HALF], start=HALF)
    assert first.merge(second) is first
    _check(case, computed(first), reference[case.id])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_payload_round_trip(case: EngineCase) -> None:
    engine = run_rows(case, case.rows(0), SPLIT)
    payload = engine.state_payload()
    text = json.dumps(payload, allow_nan=False)  # plain JSON: non-finite floats are encoded by the engine
    copies = (Engine.from_payload(payload), type(engine).from_payload(payload), Engine.from_payload(json.loads(text)))
    for copy in copies:
        assert type(copy) is type(engine) and copy.config() == engine.config()
        problem = _states_identical(copy, engine)
        assert problem is None, f"{case.id}: {problem}"
        _check(case, computed(copy), computed(engine), exact=True)
    # the rebuilt engine keeps working: more rows fold in as into the original
    more = case.rows(1)
    again = run_rows(case, more, [N], start=N, engine=Engine.from_payload(json.loads(text)))
    _check(case, computed(again), computed(run_rows(case, more, [N], start=N, engine=engine)), exact=True)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reset_gives_the_defaults_and_a_fresh_engine(case: EngineCase) -> None:
    engine = run_rows(case, case.rows(0), SPLIT)
    engine.reset()
    fresh = case.build(None)
    problem = _states_identical(engine, fresh)
    assert problem is None, f"{case.id} after reset(): {problem}"
    for name in engine.state_names:
        assert getattr(engine, name).device == engine.device
    rows = case.rows(1)
    _check(case, computed(run_rows(case, rows, SPLIT, engine=engine)), computed(run_rows(case, rows, SPLIT)),
           exact=True)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_determinism(case: EngineCase) -> None:
    rows = case.rows(3)
    a, b = run_rows(case, rows, SPLIT), run_rows(case, rows, SPLIT)
    problem = _states_identical(a, b)
    assert problem is None, f"{case.id}: {problem}"
    _check(case, computed(a), computed(b), exact=True)


# ------------------------------------------------------------------------------------------- gloo


@pytest.fixture(scope="module")
def gloo_results() -> dict[str, Any]:
    """Every case on two gloo ranks, in one spawn (spawning is the slow part)."""
    if not GLOO_AVAILABLE:
        pytest.skip("torch.distributed gloo is not available")
    ranks = run_on_gloo_ranks(gloo_rank, 2)
    assert [sorted(r) for r in ranks] == [sorted(IDS)] * 2
    return {case: [r[case] for r in ranks] for case in IDS}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gloo_sync_of_two_halves_equals_one_pass(case: EngineCase, reference: dict[str, Any],
                                                   gloo_results: dict[str, Any]) -> None:
    """Both rounds of :func:`_engine_cases.gloo_rank`: two halves, and every row on rank 0 (none on 1)."""
    want = json.loads(json.dumps(reference[case.id]))  # the ranks' results came through JSON too
    for rank, rounds in enumerate(gloo_results[case.id]):
        assert set(rounds) == {"halves", "one_rank"}
        for name, got in rounds.items():
            assert not (isinstance(got, dict) and set(got) == {"error"}), f"{case.id} {name} rank {rank}: {got}"
            problem = same(got, want, case.exact, case.rtol)
            assert problem is None, f"{case.id} {name} rank {rank}: {problem}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_merge_with_an_engine_that_saw_nothing(case: EngineCase, reference: dict[str, Any]) -> None:
    rows = case.rows(0)
    _check(case, computed(run_rows(case, rows, SPLIT).merge(case.build(None))), reference[case.id])
    _check(case, computed(case.build(None).merge(run_rows(case, rows, SPLIT))), reference[case.id])


# ------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cuda_compute_matches_cpu(case: EngineCase, reference: dict[str, Any]) -> None:
    engine = run_rows(case, case.rows(0), SPLIT, device="cuda")
    assert all(getattr(engine, name).device.type == "cuda" for name in engine.state_names)
    _check(case, computed(engine), reference[case.id])


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_engine_moved_to_cuda_with_to_matches_cpu(case: EngineCase, reference: dict[str, Any]) -> None:
    """``to()`` moves the states and the configuration buffers (``_move_buffers``), half-way through too."""
    rows = case.rows(0)
    engine = run_rows(case, {k: t[:HALF] for k, t in rows.items()}, [HALF]).to("cuda")
    run_rows(case, {k: t[HALF:] for k, t in rows.items()}, [N - HALF], start=HALF, device="cuda", engine=engine)
    _check(case, computed(engine), reference[case.id])


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_no_host_sync_in_update(case: EngineCase) -> None:
    rows = {name: t.to("cuda") for name, t in case.rows(0).items()}
    engine = case.build("cuda")
    run_rows(case, rows, [3], trusted=True, engine=engine)  # warm-up: lazy set-up may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_rows(case, {k: t[3:] for k, t in rows.items()}, SPLIT[:-1] + [SPLIT[-1] - 3], start=3, trusted=True,
                 engine=engine)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_config_round_trip_and_an_empty_batch_changes_nothing(case: EngineCase) -> None:
    engine = case.build(None)
    assert type(engine).from_config(json.loads(json.dumps(engine.config()))).config() == engine.config()
    rows = case.rows(0)
    run_rows(case, {name: t[:0] for name, t in rows.items()}, [0], engine=engine)
    problem = _states_identical(engine, case.build(None))
    assert problem is None, f"{case.id}: an empty batch changed the states: {problem}"
