"""torch's intra-op threads (pytest_dnnsafety.runtime.threads) and startup imports out of the gates' timings.

The policy is checked as a pure function (settings, environment, cores, busy cores given), the load
measurement against a real competing process, and the whole path through pytest in subprocesses
(each applies its plan to its own torch): the run header shows the count; a user setting (ini,
env, CLI) wins over auto; OMP_NUM_THREADS is respected; ``-n 2`` workers get half the cores; a
bad value is a usage error naming its source. The gate timing test imports a module that sleeps
0.6 s on import inside a gate and checks that ``seconds`` excludes it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import GateProject
from pytest_dnnsafety.runtime import threads
from pytest_dnnsafety.settings import Settings
from pytest_dnnsafety.errors import ConfigError

CORES = threads.usable_cores()


def _settings(cli: str | None = None, env: str | None = None, ini: str | None = None) -> Settings:
    return Settings(cli={"dnnsafety_threads": cli} if cli is not None else {},
                    ini=lambda name: ini if (ini is not None and name == "dnnsafety_threads") else "",
                    env={"DNNSAFETY_THREADS": env} if env is not None else {})


# ---------------------------------------------------------------------------------- the policy


@pytest.mark.parametrize("cores, workers, busy, expected", [
    (4, 1, 0, 4), (2, 2, 0, 1), (8, 3, 0, 2), (1, 4, 0, 1),   # the cores shared by the workers
    (2, 1, 1.0, 1), (2, 1, 0.4, 2), (2, 1, 0.6, 1),          # a core counts when others use > half of it
    (8, 2, 6.2, 2), (8, 1, 16.0, 1), (4, 1, None, 4),        # never below 1; no measurement: no load rule
])
def test_auto_divides_the_usable_cores_and_leaves_busy_ones(cores: int, workers: int, busy: float | None,
                                                            expected: int) -> None:
    config = SimpleNamespace(workerinput={"workercount": workers}) if workers > 1 else None
    plan = threads.plan(_settings(), config, env={}, cores=cores, busy=busy)
    assert plan.threads == expected and plan.source == "auto"
    if workers > 1:
        assert f"shared by {workers} xdist workers" in plan.reason
    assert plan.header().startswith(f"threads={expected} (auto: {cores} usable core")


def test_controller_plans_for_its_workers_and_torchrun_ranks_share_too() -> None:
    controller = SimpleNamespace(option=SimpleNamespace(dist="load", numprocesses=4))
    assert threads.plan(_settings(), controller, env={}, cores=8, busy=0).threads == 2
    ranks = threads.plan(_settings(), None, env={"LOCAL_WORLD_SIZE": "2"}, cores=8, busy=0)
    assert ranks.threads == 4 and "2 torchrun local ranks" in ranks.reason


@pytest.mark.parametrize("cli, env, ini, expected, source", [
    (None, None, "3", 3, "ini option dnnsafety_threads"),
    (None, "5", "3", 5, "environment variable DNNSAFETY_THREADS"),
    ("2", "5", "3", 2, "command-line option --dnnsafety-threads"),
])
def test_a_user_setting_wins_over_omp_num_threads_and_auto(cli, env, ini, expected, source) -> None:
    plan = threads.plan(_settings(cli, env, ini), env={"OMP_NUM_THREADS": "7"}, cores=8, busy=2.0)
    assert plan.threads == expected and plan.source.startswith(source)
    assert plan.header() == f"threads={expected} (from {plan.source})"


def test_omp_then_mkl_num_threads_are_respected() -> None:
    plan = threads.plan(_settings(), env={"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "5"}, cores=8, busy=0)
    assert (plan.threads, plan.source) == (3, "environment variable OMP_NUM_THREADS")
    assert plan.header() == "threads=3 (from OMP_NUM_THREADS)"
    assert threads.plan(_settings(), env={"MKL_NUM_THREADS": "5"}, cores=8, busy=0).threads == 5
    assert threads.plan(_settings(), env={"OMP_NUM_THREADS": "4,2"}, cores=8, busy=0).threads == 4  # nested
    # not a count: torch ignores it too, so auto decides
    assert threads.plan(_settings(), env={"OMP_NUM_THREADS": "many"}, cores=2, busy=0).source == "auto"
    # an explicit plugin "auto" asks for the plugin's policy even with OMP_NUM_THREADS set
    explicit = threads.plan(_settings(ini="auto"), env={"OMP_NUM_THREADS": "3"}, cores=2, busy=0)
    assert explicit.threads == 2 and explicit.source.startswith("auto (ini option")


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5", ""])
def test_a_bad_value_names_its_source_and_the_fix(raw: str) -> None:
    if not raw:  # an empty variable is unset: the default
        assert _settings(env=raw).get("threads").value == "auto"
        return
    with pytest.raises(ConfigError, match=r"dnnsafety_threads=.*\(from environment variable DNNSAFETY_THREADS\): "
                                          r"expected auto or an integer >= 1\. Fix: use auto or a positive integer"):
        _settings(env=raw).get("threads")


def test_cgroup_quota_caps_the_cores(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads._cgroup_cpus(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads._cgroup_cpus(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert threads._cgroup_cpus(v1) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    assert threads._cgroup_cpus(v1) is None
    assert 1 <= threads.usable_cores() <= (os.cpu_count() or 1)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="the load measurement reads /proc/stat (Linux)")
def test_busy_cores_sees_a_competing_process() -> None:
    competitor = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    try:
        time.sleep(0.2)
        # Other load on a shared machine only adds to what is seen; the competitor alone is ~1 core.
        assert threads.busy_cores(0.3) >= 0.7
    finally:
        competitor.kill()
        competitor.wait()


def test_busy_cores_subtracts_this_process_own_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counters say 2 of 2 cores were busy over the window; this process used 1 of them: 1 other."""
    ticks = iter([(100, 1_000), (300, 1_200)])  # (busy, total) jiffies before / after: 200 of 200 busy
    monkeypatch.setattr(threads, "_affinity", lambda: {0, 1})
    monkeypatch.setattr(threads, "_cpu_ticks", lambda cpus: next(ticks))
    clock = iter([0.0, 0.2])  # perf_counter: a 0.2 s window
    monkeypatch.setattr(threads.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: None)
    own = iter([SimpleNamespace(user=1.0, system=0.0), SimpleNamespace(user=1.15, system=0.05)])  # 0.2 s CPU
    monkeypatch.setattr(threads.os, "times", lambda: next(own))
    assert threads.busy_cores() == pytest.approx(1.0)


# ---------------------------------------------------------------------------------- through pytest

GATE_CONFTEST = '''
import json, os, sys
import pytest
from pytest_dnnsafety import GateDef, Measurement, hookimpl


def _measure(spec, fx, ctx):
    if spec.options.get("slow_import"):
        import slow_import_module  # sleeps on import: startup, not the metric
    import torch
    with open(os.environ["THREADS_LOG"], "a") as log:
        log.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                              "torch_threads": torch.get_num_threads()}) + "\\n")
    return Measurement(1.0)


GATE = GateDef(marker="thread_probe", metric="probe", op=">=", threshold_range=(0.0, 2.0),
               fixtures={}, measure=_measure, doc="records torch's thread count",
               params=(__import__("pytest_dnnsafety").Param("slow_import", (bool,), False, None, "import slowly"),))


@hookimpl
def pytest_dnnsafety_register_gates(registry):
    registry.add(GATE)
'''

GATE_TESTS = '''
import pytest

@pytest.mark.thread_probe(0.5, slow_import=True)
def test_first():
    pass

@pytest.mark.thread_probe(0.5)
def test_second():
    pass
'''


def _probe_project(project: GateProject, *, slow_import: float = 0.0) -> Path:
    project.write("conftest.py", GATE_CONFTEST)
    project.write("slow_import_module.py", f"import time\ntime.sleep({slow_import})\n")
    project.tests(GATE_TESTS)
    return project.pytester.path / "threads.log"


def _run(project: GateProject, log: Path, *args: str, env: dict[str, str] | None = None) -> tuple[str, list[dict]]:
    """A fresh pytest process (its own torch); returns its output and the thread counts the gates saw."""
    project.finish()
    run_env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "DNNSAFETY_THREADS", "PYTEST_ADDOPTS")}
    run_env.update({"THREADS_LOG": str(log), "PYTHONPATH": str(project.pytester.path), **(env or {})})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "--dnnsafety-json=e.json", *args], cwd=project.pytester.path, env=run_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_header_shows_the_threads_an_ini_setting_wins_and_imports_are_startup(gate_project: GateProject) -> None:
    log = _probe_project(gate_project, slow_import=0.6)
    gate_project.ini["dnnsafety_threads"] = "1"
    out, seen = _run(gate_project, log, env={"OMP_NUM_THREADS": "2"})
    header = re.search(r"^dnnsafety: .*threads=1 \(from ini option dnnsafety_threads in .*pyproject.toml\)$", out,
                       re.M)
    assert header, out
    assert [s["torch_threads"] for s in seen] == [1, 1]  # set before the gates ran, over OMP_NUM_THREADS
    env = json.loads((gate_project.pytester.path / "e.json").read_text())["environment"]["threads"]
    assert env["threads"] == 1 and env["applied"] and env["torch_threads"] == 1
    assert env["source"].startswith("ini option dnnsafety_threads")
    # the first gate imported a module that sleeps 0.6 s on import: startup, not the gate's time
    gates = {g["nodeid"].split("::")[1]: g
             for g in json.loads((gate_project.pytester.path / "e.json").read_text())["gates"]}
    first, second = gates["test_first"], gates["test_second"]
    assert first["startup_seconds"] >= 0.6
    assert first["seconds"] < 0.3, first  # the probe itself takes milliseconds
    assert second["startup_seconds"] < 0.1 and second["seconds"] < 0.3


@pytest.mark.slow
def test_omp_num_threads_is_respected_and_the_cli_wins_over_it(gate_project: GateProject) -> None:
    log = _probe_project(gate_project)
    out, seen = _run(gate_project, log, env={"OMP_NUM_THREADS": str(CORES)})
    assert re.search(rf"^dnnsafety: .*threads={CORES} \(from OMP_NUM_THREADS\)$", out, re.M), out
    assert {s["torch_threads"] for s in seen} == {CORES}
    log.unlink()
    out, seen = _run(gate_project, log, "--dnnsafety-threads=1", env={"OMP_NUM_THREADS": str(CORES),
                                                                      "DNNSAFETY_THREADS": "2"})
    assert re.search(r"^dnnsafety: .*threads=1 \(from command-line option --dnnsafety-threads\)$", out, re.M), out
    assert {s["torch_threads"] for s in seen} == {1}


@pytest.mark.slow
def test_xdist_workers_share_the_cores(gate_project: GateProject) -> None:
    log = _probe_project(gate_project)
    out, seen = _run(gate_project, log, "-n", "2")
    share = max(1, CORES // 2)
    match = re.search(r"^dnnsafety: .*threads=(\d+) per worker \(auto: (\d+) usable cores? shared by 2 xdist "
                      r"workers.*\)$", out, re.M)
    assert match and 1 <= int(match.group(1)) <= share and int(match.group(2)) == CORES, out
    assert len(seen) == 2 and all(1 <= s["torch_threads"] <= share for s in seen), seen
    env = json.loads((gate_project.pytester.path / "e.json").read_text())["environment"]["threads"]
    assert env["applied"] is False and env["processes"] == 2 and env["threads"] == share


def test_header_in_process_and_a_bad_cli_value_is_a_usage_error(gate_project: GateProject) -> None:
    gate_project.tests("def test_plain():\n    pass\n")
    result = gate_project.run("--dnnsafety-threads=2")
    result.stdout.fnmatch_lines(["dnnsafety: *threads=2 (from command-line option --dnnsafety-threads)"])
    result = gate_project.run("--dnnsafety-threads=zero")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*dnnsafety_threads='zero' (from command-line option --dnnsafety-threads): "
                                 "expected auto or an integer >= 1. Fix: use auto or a positive integer*"])


def test_a_run_without_gates_shows_the_threads_but_never_imports_torch(gate_project: GateProject) -> None:
    gate_project.tests("import sys\n\ndef test_plain():\n    assert 'torch' not in sys.modules\n")
    result = gate_project.run(subprocess=True)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["dnnsafety: *threads=* (auto: * usable core*)"])


# ---------------------------------------------------------------------------------- gate timing


def test_import_clock_counts_only_imports_that_load_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_dnnsafety.gates.evaluation import ImportClock

    (tmp_path / "clock_slow_pkg").mkdir()
    (tmp_path / "clock_slow_pkg" / "__init__.py").write_text("import time\ntime.sleep(0.2)\nfrom . import inner\n")
    (tmp_path / "clock_slow_pkg" / "inner.py").write_text("import time\ntime.sleep(0.1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "clock_slow_pkg", raising=False)
    monkeypatch.delitem(sys.modules, "clock_slow_pkg.inner", raising=False)
    import builtins

    original = builtins.__import__
    with ImportClock() as clock:
        import clock_slow_pkg  # noqa: F401  (0.3 s, nested import counted once)
        for _ in range(1000):
            import json as _json  # noqa: F401  (already loaded: not counted)
    assert builtins.__import__ is original
    assert 0.3 <= clock.seconds < 0.5
