"""Issue #20 acceptance: under torchrun (2 gloo ranks) every gate family shards its batches and gives the
single-process values.

One user project (:func:`_streaming.write_project` with ``per_family=True``) holds one test per gate
of every built-in family; each family reads its own streaming loader (``data_<family>``) and its own
model (``model_<family>``), so nothing is shared between families and the project's conftest counts,
per process and per family, the inputs each loader loaded and the rows each model forwarded. The
project runs once in one process and once under ``torch.distributed.run --nproc-per-node 2``
(gloo, CPU). Per family:

* every gate's status, value and bound equal the single-process run's exactly (a timing gate:
  the status only);
* the family sharded its batches: each rank loaded fewer inputs than the single process, and the
  two together as many, give or take one first batch that a rank may read for the data's facts
  (input shape, labelled); a family that evaluates the whole data on every rank loads it twice. ``max_pmi_ub`` reads its labelled data whole by design: its model's forward
  rows are counted instead (its Monte Carlo queries are what it splits). ``min_scene_coverage``
  reads the scenario table, not the data, and ``max_monitor_overhead`` is a timing that rank 0
  takes (``GateDef.timed``): both are left out of the sharding checks.

Fast: every built-in gate declares ``GateDef.shards``. The evidence JSON does not record whether a
gate was sharded (only the run's ``world_size``): the loads are the measurement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _streaming import FAMILIES, MODEL_FREE, write_project
from pytest_dnnsafety.gates import builtin_registry
from test_torchrun import GLOO, TIMED, _clean_env, _torchrun

TESTS = Path(__file__).resolve().parents[1]  # tests/: the shared helper modules
#: Families whose loads say nothing about sharding: they read no data (the table's length only), or their
#: value is a wall-clock timing that rank 0 takes alone (GateDef.timed: max_monitor_overhead).
NO_DATA = MODEL_FREE | {"monitor_overhead"}
#: Families that hold their data whole by design: their model's forward rows are compared instead.
WHOLE_DATA = {"pmi"}
#: The labelled operational inputs of max_pmi_ub (every rank forwards them), with a few probe rows to spare.
PMI_LABELLED = 60 + 4
#: The loaders' batch size (``STREAM_BATCH``): a rank may read a data set's first batch for its facts.
FIRST_BATCH = 64

TWO_RANKS = [pytest.mark.slow,
             pytest.mark.skipif(not GLOO, reason="torch.distributed with the gloo backend is not available")]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in NO_DATA])
def test_every_gate_of_the_family_declares_that_it_shards(family: str) -> None:
    """``GateDef.shards`` (what the session and the docs go by) says so for every built-in gate; the slow
    tests below check that the batches are really split."""
    registry = builtin_registry()
    markers = [marker.split("(")[0] for marker in FAMILIES[family][1]]
    assert [m for m in markers if not registry.get(m).shards] == [], family


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The project run in one process (``one``) and under 2 gloo ranks (``two``): evidence and per-rank records."""
    root = tmp_path_factory.mktemp("torchrun_families")
    project = root / "project"
    tests = write_project(project, per_family=True)
    result: dict = {"tests": tests}
    for name in ("one", "two"):
        out = root / name
        out.mkdir()
        env = _clean_env(STREAM_RECORD_DIR=str(out), DNNSAFETY_TORCHRUN_TIMEOUT="240",
                         PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
        args = ["-p", "no:cacheprovider", "-p", "no:randomly", "-q", f"--dnnsafety-json={out / 'evidence.json'}"]
        if name == "one":
            proc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=project, env=env,
                                  capture_output=True, text=True, timeout=900)
        else:
            proc = _torchrun(args, project, env, timeout=900)
        log = proc.stdout[-4000:] + proc.stderr[-4000:]
        assert (out / "evidence.json").is_file(), log
        evidence = json.loads((out / "evidence.json").read_text())
        result[name] = {g["nodeid"].split("::")[1]: g for g in evidence["gates"]}
        result[name + "_log"] = log
        result[name + "_world"] = evidence["environment"]["world_size"]
        result[name + "_records"] = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert (result["one_world"], result["two_world"]) == (1, 2)
    assert len(result["one_records"]) == 1 and len(result["two_records"]) == 2, result["two_log"]
    return result


def _family_tests(runs: dict, family: str) -> list[str]:
    return [name for name in runs["tests"] if name.startswith(f"test_{family}_")]


@pytest.mark.parametrize("family", list(FAMILIES))
@TWO_RANKS[0]
@TWO_RANKS[1]
def test_family_gives_the_single_process_values_under_two_ranks(runs: dict, family: str) -> None:
    for name in _family_tests(runs, family):
        single, sharded = runs["one"].get(name), runs["two"].get(name)
        assert single is not None and sharded is not None, (name, runs["two_log"])
        assert single["status"] in {"passed", "failed"}, (name, single["summary"])
        assert sharded["status"] == single["status"], (name, sharded["summary"], single["summary"])
        if single["marker"] in TIMED:
            continue
        assert (sharded["value"], sharded["bound"]) == (single["value"], single["bound"]), name  # exact


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in NO_DATA])
@TWO_RANKS[0]
@TWO_RANKS[1]
def test_family_shards_its_batches(runs: dict, family: str) -> None:
    (single,) = runs["one_records"]
    rank0, rank1 = runs["two_records"]
    what = "rows" if family in WHOLE_DATA else "loaded"  # forward rows of its model / inputs of its loader
    one, r0, r1 = single[what].get(family, 0), rank0[what].get(family, 0), rank1[what].get(family, 0)
    measured = f"{family}: {what} {one} in one process; rank 0 {r0}, rank 1 {r1}"
    print(measured)
    assert one > 0, measured
    assert r0 < one and r1 < one, measured
    # max_pmi_ub: every rank forwards the labelled inputs (held whole by design), then its share of the samples;
    # the others: a rank may read the data's first batch once more for its facts (input shape, labelled), and the
    # task inference reads a map-style dataset's first item once per process (tasks.infer_task), and the cost probe
    # (gates/cost.py) reads the first batch for its 4 inputs once per process
    overlap = PMI_LABELLED if family in WHOLE_DATA else 2 * FIRST_BATCH + 1
    assert one <= r0 + r1 <= one + overlap, measured
