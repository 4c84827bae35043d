"""torchrun sharding (:mod:`pytest_dnnsafety.runtime.torchrun`): shards, detection, and whole runs under 2 gloo ranks.

* unit: :func:`shard` partitions ``0..n-1`` like a brute-force split; torchrun detection reads the
  environment; :func:`batch_shard` cuts at batch boundaries; a rank's sharded forward pass gives
  bit-identical rows to the same rows of a whole pass (and the cache keeps them apart);
* the example project under ``python -m torch.distributed.run --nproc-per-node 2`` (gloo) against
  one process: every gate's value, bound, status and details equal (exactly: shards are whole
  batches and the all-reduced states are integer counts and flags; timing gates excepted), one
  evidence JSON / HTML / JUnit set written by rank 0 only, equal exit codes;
* a tiny project whose gate depends on the rank: an ``error`` on both ranks, both exit non-zero;
  and a sharded gate that fails on one rank's shard only (NaN outputs there) errors on both ranks
  instead of deadlocking in the all-reduce.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

from _details import reproducible
from pytest_dnnsafety.runtime import torchrun as ranks
from pytest_dnnsafety.engines.core.capture import ActivationCache, capture

EXAMPLE = Path(__file__).resolve().parents[2] / "example_project"
TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
#: Gates whose value is a wall-clock timing: equal verdicts, not equal values.
TIMED = {"max_monitor_overhead"}
#: Details that are wall-clock timings.
GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ranks.TORCHRUN_ENV and not k.startswith("PYTEST_")}
    env.update(extra)
    return env


def _torchrun(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "pytest", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------- unit


@pytest.mark.parametrize("n", [0, 1, 2, 7, 10, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shards_partition_the_items_in_order_like_a_brute_force_split(n: int, world: int) -> None:
    parts = [ranks.shard(n, r, world) for r in range(world)]
    assert [i for part in parts for i in part] == list(range(n))  # disjoint, in order, complete
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert all(p.step == 1 for p in parts)  # contiguous
    assert parts == [ranks.shard(n, r, world) for r in range(world)]  # deterministic


def test_bad_shard_arguments_name_the_problem() -> None:
    with pytest.raises(Exception, match="rank 2 must lie in 0..world_size-1"):
        ranks.shard(10, 2, 2)
    with pytest.raises(Exception, match="non-negative int"):
        ranks.shard(-1, 0, 1)


def test_torchrun_is_detected_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ranks.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not ranks.launched() and ranks.world_size() == 1 and ranks.rank() == 0 and ranks.is_main()
    assert ranks.batch_shard(torch.zeros(10, 2), 3) is None  # one process: the whole data
    assert ranks.gather("x") == ["x"] and ranks.together(lambda: 5) == 5
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    assert ranks.launched() and ranks.world_size() == 2 and ranks.rank() == 1 and not ranks.is_main()
    assert ranks.local_rank() == 1 and ranks.active()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a group of one is not distributed
    assert not ranks.launched() and ranks.world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_PORT")  # an incomplete environment is not torchrun's
    assert not ranks.launched()


def test_a_bad_timeout_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ranks.TIMEOUT_ENV, "soon")
    with pytest.raises(Exception, match="DNNSAFETY_TORCHRUN_TIMEOUT='soon'"):
        ranks._timeout()
    monkeypatch.setenv(ranks.TIMEOUT_ENV, "90")
    assert ranks._timeout() == 90.0


def test_batch_shards_are_whole_batches_of_the_single_process_run(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    x = torch.zeros(10, 2)
    got = ranks.batch_shard(x, 3)  # batches [0:3] [3:6] [6:9] [9:10]; rank 1 of 2 takes batches 2, 3
    assert got is not None and got.batches == (2, 4) and got.rows == (6, 10) and got.n_rows == 10
    assert ranks.batch_shard(x, 10) is None  # one batch for two ranks: evaluated whole on each
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(10)), batch_size=4)
    got = ranks.batch_shard(loader, 999)  # the loader's own batch size wins: batches of 4, 4, 2
    assert got is not None and got.batches == (1, 3) and got.rows == (4, 10)


def test_batch_shard_with_two_batches_splits_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    got = ranks.batch_shard(torch.zeros(10, 2), 8)
    assert got is not None and got.batches == (1, 2) and got.rows == (8, 10)


def test_a_shards_forward_pass_equals_the_same_rows_of_a_whole_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 3))
    x, y = torch.randn(23, 1, 8, 8), torch.randint(0, 3, (23,))
    data = torch.utils.data.TensorDataset(x, y)
    whole_out: list = []
    whole = capture(model, data, ["1"], batch_size=5, outputs=whole_out)
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    shard = ranks.batch_shard(data, 5)
    assert shard is not None and shard.rows == (10, 23)
    cache = ActivationCache()
    mine = cache.get(model, data, ["1"], batch_size=5, device="cpu", shard=shard)["1"]
    rows = shard.row_slice
    for field in ("max", "mean", "min"):  # bit-identical: the model saw exactly the same batches
        assert torch.equal(getattr(mine, field), getattr(whole["1"], field)[rows])
    out = cache.outputs(model, data, batch_size=5, device="cpu", shard=shard)
    assert torch.equal(out.predictions, whole_out[0].predictions[rows]) and torch.equal(out.labels, y[rows])
    assert cache.forward_passes == 1
    full = cache.get(model, data, ["1"], batch_size=5, device="cpu")["1"]  # a whole pass is cached apart
    assert full.n_inputs == 23 and cache.forward_passes == 2


def test_xdist_under_torchrun_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("xdist")
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*torchrun and pytest-xdist (-n/--dist) cannot be combined*"])


# ------------------------------------------------------------------------------ whole runs, 2 ranks

#: Records, per rank, what the run did: its exit status, its JUnit path and the evidence it wrote.
RECORDER = '''
import json, os
from pathlib import Path

OUTCOMES = {}


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        OUTCOMES[report.nodeid] = report.outcome


def pytest_unconfigure(config):
    plugin = config.pluginmanager.get_plugin("dnnsafety-session")
    record = {"exitstatus": int(getattr(config, "_dnnsafety_exit", -1)), "outcomes": OUTCOMES,
              "xmlpath": config.option.xmlpath,
              "evidence_path": str(plugin.evidence_path) if plugin and plugin.evidence_path else None,
              "gates": {r.nodeid + " " + r.marker: [r.status, r.value, r.summary]
                        for rows in (plugin.results.values() if plugin else ()) for r in rows}}
    Path(os.environ["RECORD_DIR"], "rank" + os.environ.get("RANK", "single") + ".json").write_text(json.dumps(record))


def pytest_sessionfinish(session, exitstatus):
    session.config._dnnsafety_exit = exitstatus
'''


def _gates(path: Path) -> dict[tuple[str, str], dict]:
    evidence = json.loads(path.read_text())
    return {(g["nodeid"], g["marker"]): g for g in evidence["gates"]}


def _junit_cases(path: Path) -> dict[str, str]:
    root = ElementTree.parse(path).getroot()
    return {f"{c.get('classname')}::{c.get('name')}": ("failed" if c.find("failure") is not None else "ok")
            for c in root.iter("testcase")}


@pytest.mark.slow
@pytest.mark.skipif(not GLOO, reason="torch.distributed with the gloo backend is not available in this torch build")
def test_example_project_under_two_gloo_ranks_equals_one_process(tmp_path: Path) -> None:
    if not (EXAMPLE / "models" / "digits_cnn.pt").is_file() or not (EXAMPLE / "data" / "eval.npz").is_file():
        pytest.skip("the example project is not trained: run `cd example_project && python -m digits_demo.train` "
                    "first (CI does before the test suite)")
    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "torchrun_recorder.py").write_text(RECORDER)
    runs = {}
    for name in ("one", "two"):
        out = tmp_path / name
        out.mkdir()
        env = _clean_env(RECORD_DIR=str(out), DNNSAFETY_TORCHRUN_TIMEOUT="240",
                         PYTHONPATH=os.pathsep.join([str(tmp_path / "rec"), os.environ.get("PYTHONPATH", "")]))
        args = ["-p", "no:cacheprovider", "-p", "no:randomly", "-p", "torchrun_recorder", "-q",
                f"--dnnsafety-json={out / 'dnnsafety.json'}", f"--dnnsafety-html={out / 'dnnsafety.html'}",
                f"--junitxml={out / 'junit.xml'}"]
        if name == "one":
            proc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=EXAMPLE, env=env, capture_output=True,
                                  text=True, timeout=900)
        else:
            proc = _torchrun(args, EXAMPLE, env, timeout=900)
        runs[name] = proc
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = tmp_path / "one", tmp_path / "two"
    # One set of reports: rank 0 wrote them, rank 1 was told not to (no JUnit path, no evidence).
    assert sorted(p.name for p in one.iterdir()) == ["dnnsafety.html", "dnnsafety.json", "junit.xml",
                                                     "ranksingle.json"]
    assert sorted(p.name for p in two.iterdir()) == ["dnnsafety.html", "dnnsafety.json", "junit.xml", "rank0.json",
                                                     "rank1.json"]
    rank0, rank1 = (json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["xmlpath"] == str(two / "junit.xml") and rank0["evidence_path"] == str(two / "dnnsafety.json")
    assert rank1["xmlpath"] is None and rank1["evidence_path"] is None
    assert rank0["exitstatus"] == rank1["exitstatus"] == 0
    assert runs["two"].stdout.count("dependability gates") == 1  # the summary once, from rank 0
    # Every gate: the same verdict on both ranks, and the same value, bound, status and details as one process.
    assert {k: v[0] for k, v in rank0["gates"].items()} == {k: v[0] for k, v in rank1["gates"].items()}
    single, sharded = _gates(one / "dnnsafety.json"), _gates(two / "dnnsafety.json")
    assert single.keys() == sharded.keys() and len(single) >= 25
    for key, expected in single.items():
        got = sharded[key]
        assert got["status"] == expected["status"], key
        if key[1] in TIMED:
            continue
        assert (got["value"], got["bound"]) == (expected["value"], expected["bound"]), key  # exact, not approximate
        drop = reproducible  # timings differ per run
        assert drop(got["details"]) == drop(expected["details"]), key
    environment = json.loads((two / "dnnsafety.json").read_text())["environment"]
    assert (environment["world_size"], environment["backend"]) == (2, "gloo")
    assert json.loads((one / "dnnsafety.json").read_text())["environment"]["world_size"] == 1
    assert _junit_cases(two / "junit.xml") == _junit_cases(one / "junit.xml")


RANK_PROJECT = '''
import os

import pytest
import torch

from pytest_dnnsafety import GateDef, Measurement, hookimpl


def _measure(spec, fx, ctx):
    return Measurement(float(os.environ.get("RANK", "0")), detail="the rank")


RANK_GATE = GateDef(marker="max_rank", metric="the rank", op="<=", threshold_range=(0.0, 10.0), params=(),
                    fixtures={}, measure=_measure, doc="a gate whose value is the process's rank")


WORLD_GATE = GateDef(marker="max_world", metric="the world size", op="<=", threshold_range=(0.0, 10.0), params=(),
                     fixtures={}, measure=lambda spec, fx, ctx: Measurement(float(os.environ.get("WORLD_SIZE", "1"))),
                     doc="a gate whose value is the same on every rank")


@hookimpl
def pytest_dnnsafety_register_gates(registry):
    registry.add(RANK_GATE)
    registry.add(WORLD_GATE)


class Spiky(torch.nn.Module):
    """NaN logits for inputs whose first feature is large: only rank 1's shard holds such rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU())
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        out = self.head(self.body(x))
        return torch.where(x[:, :1] > 100, torch.full_like(out, float("nan")), out)


@pytest.fixture(scope="session")
def model():
    return Spiky().eval()


@pytest.fixture(scope="session")
def dataset():
    torch.manual_seed(1)
    x = torch.rand(600, 4)
    x[500:, 0] = 1000.0  # batches of 256: rank 0 forwards rows 0..255, rank 1 rows 256..599
    return torch.utils.data.TensorDataset(x, torch.randint(0, 3, (600,)))
'''

RANK_TESTS = '''
import os

import pytest


@pytest.mark.max_rank(0.5)
def test_rank_dependent_gate():
    pass


@pytest.mark.min_neuron_k_activation(0.0, layer="body.1", k=1)
def test_sharded_gate_failing_on_one_shard():
    pass


@pytest.mark.max_world(5.0)
def test_gate_agreeing_on_both():
    pass


@pytest.mark.max_world(5.0)
def test_body_failing_on_rank_1_only():
    assert os.environ["RANK"] == "0"
'''


@pytest.mark.slow
@pytest.mark.skipif(not GLOO, reason="torch.distributed with the gloo backend is not available in this torch build")
def test_ranks_that_disagree_or_fail_on_one_shard_give_the_same_error_everywhere(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(textwrap.dedent(RANK_PROJECT))
    (project / "test_ranks.py").write_text(textwrap.dedent(RANK_TESTS))
    (project / "pytest.ini").write_text("[pytest]\n")
    (project / "torchrun_recorder.py").write_text(RECORDER)
    out = tmp_path / "out"
    out.mkdir()
    env = _clean_env(RECORD_DIR=str(out), DNNSAFETY_TORCHRUN_TIMEOUT="60", PYTHONPATH=str(project))
    proc = _torchrun(["-p", "no:cacheprovider", "-p", "no:randomly", "-p", "torchrun_recorder",
                      f"--dnnsafety-json={out / 'evidence.json'}", f"--junitxml={out / 'junit.xml'}"],
                     project, env, timeout=300)
    assert proc.returncode != 0, proc.stdout[-3000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for record in records:  # both ranks: the same verdicts, both runs fail
        assert record["exitstatus"] == pytest.ExitCode.TESTS_FAILED, record
        gates = {key.split("::")[-1]: value for key, value in record["gates"].items()}
        status, _, summary = gates["test_rank_dependent_gate max_rank"]
        assert status == "error" and "torchrun ranks disagree" in summary and "rank 1: failed value 1.0" in summary
        status, _, summary = gates["test_sharded_gate_failing_on_one_shard min_neuron_k_activation"]
        assert status == "error" and "NaN" in summary, summary
        assert gates["test_gate_agreeing_on_both max_world"][0] == "passed"
        # a body that fails on one rank only: no rank evaluates the gate (the collectives stay in step)
        status, _, summary = gates["test_body_failing_on_rank_1_only max_world"]
        assert status == "not-evaluated" and record["outcomes"]["test_ranks.py::test_body_failing_on_rank_1_only"] \
            == "failed", summary
    assert "rank 1 of 2 failed on its shard" in records[0]["gates"][
        "test_ranks.py::test_sharded_gate_failing_on_one_shard min_neuron_k_activation"][2]
    evidence = _gates(out / "evidence.json")
    assert {k[0].split("::")[-1]: g["status"] for k, g in evidence.items()} == {
        "test_rank_dependent_gate": "error", "test_sharded_gate_failing_on_one_shard": "error",
        "test_gate_agreeing_on_both": "passed", "test_body_failing_on_rank_1_only": "not-evaluated"}
    assert sorted(p.name for p in out.iterdir()) == ["evidence.json", "junit.xml", "rank0.json", "rank1.json"]
