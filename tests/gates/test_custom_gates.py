"""Gates from a user's conftest.py or an installed plugin, through the pytest_dnnsafety hooks.

A custom gate gets what a built-in gets: typed keywords validated at collection, fixtures,
``--strict-markers``, a terminal row, a JSON evidence row and a JUnit line, with and without
pytest-xdist; ``pytest_dnnsafety_gate_result`` is called once per gate on the controller. Also: the
registry's refusals (a marker registered twice, a malformed GateDef), the regression keywords
(``max_drop``/``max_rise``) and ``evaluate``'s contracts with the baseline and progress modules,
checked against stubs of those modules.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from conftest import GateProject
from pytest_dnnsafety import GateDef, GateRegistry, Measurement, Param, REQUIRED
from pytest_dnnsafety.settings import Resolved, Settings
from pytest_dnnsafety.gates import GATES, GateDefinitionError, evaluate, parse_marker
from pytest_dnnsafety.errors import MarkerError

#: A gate module written only against the public API; ``{marker}`` is filled in per use.
GATE_SOURCE = '''
import json
import os

import pytest
from pytest_dnnsafety import GateDef, Measurement, Param, hookimpl


def _measure(spec, fx, ctx):
    values = sorted(fx["samples"])
    trim = spec.options["trim"]
    kept = values[: len(values) - trim]
    mean = sum(kept) / len(kept)
    return Measurement(mean, detail=f"{{len(kept)}} samples, unit {{spec.options['unit']}}",
                       details={{"kept": len(kept), "seed": ctx.seed}})


def _trim(value):
    return None if 0 <= value <= 2 else f"{{value!r}} is outside [0, 2]"


GATE = GateDef(
    marker="{marker}", metric="mean latency", op="<=", threshold_range=(0.0, 1e6),
    params=(Param("trim", (int,), 0, _trim, "drop the n slowest samples, n = 0, 1 or 2"),
            Param("unit", (str,), "ms", None, "a unit name")),
    fixtures={{"samples": "latencies"}}, measure=_measure, doc="mean of the latency samples",
)


@hookimpl
def pytest_dnnsafety_register_gates(registry):
    registry.add(GATE)


@hookimpl
def pytest_dnnsafety_gate_result(result, config):
    path = os.environ.get("GATE_RESULT_LOG")
    if path:
        with open(path, "a") as log:
            log.write(json.dumps({{"nodeid": result.nodeid, "marker": result.marker, "status": result.status,
                                  "pid": os.getpid(), "worker": hasattr(config, "workerinput")}}) + "\\n")


@pytest.fixture(scope="session")
def latencies():
    return [1.0, 2.0, 3.0, 10.0]
'''

TESTS = """
import pytest

@pytest.mark.{marker}(5.0)
def test_fast(latencies):
    pass

@pytest.mark.{marker}(3.0)
def test_too_slow():
    pass

@pytest.mark.{marker}(3.0, trim=1, unit="s", max_rise=0.5)
def test_fast_without_outlier():
    pass

def test_plain():
    pass
"""

PLUGIN_MODULE = "dnnsafety_user_gates"


def _install(project: GateProject, kind: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, tuple[str, ...]]:
    """Write the gate as a conftest.py or as a plugin module given with -p; returns (marker, extra args)."""
    if kind == "conftest":
        marker = "max_conftest_latency"
        project.write("conftest.py", GATE_SOURCE.format(marker=marker))
        return marker, ()
    marker = "max_plugin_latency"
    project.write(f"{PLUGIN_MODULE}.py", GATE_SOURCE.format(marker=marker))
    # -p imports the module before rootdir's sys.path settings; workers inherit PYTHONPATH.
    monkeypatch.syspath_prepend(str(project.pytester.path))
    monkeypatch.setenv("PYTHONPATH", str(project.pytester.path))
    monkeypatch.delitem(sys.modules, PLUGIN_MODULE, raising=False)
    return marker, ("-p", PLUGIN_MODULE)


def _subprocess(kind: str, extra: tuple[str, ...]) -> bool:
    """An in-process run's xdist workers get this process's sys.path as of xdist's import, so a ``-p``
    module written now is importable by workers only from a fresh pytest process (PYTHONPATH)."""
    return kind == "plugin" and "-n" in extra


def _log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(autouse=True)
def _restore_gates():
    saved = dict(GATES)
    yield
    GATES.clear()
    GATES.update(saved)


@pytest.mark.parametrize("extra", [(), ("-n", "2")], ids=["serial", "xdist"])
@pytest.mark.parametrize("kind", ["conftest", "plugin"])
def test_custom_gate_runs_like_a_builtin(gate_project: GateProject, monkeypatch: pytest.MonkeyPatch, kind: str,
                                         extra: tuple[str, ...]) -> None:
    marker, args = _install(gate_project, kind, monkeypatch)
    log = gate_project.pytester.path / "hook.log"
    monkeypatch.setenv("GATE_RESULT_LOG", str(log))
    gate_project.tests(TESTS.format(marker=marker))
    result = gate_project.run(*args, "--strict-markers", "-W", "error", "--dnnsafety-json=e.json",
                              "--junitxml=j.xml", *extra, subprocess=_subprocess(kind, extra))
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([f"*{marker}: 4.000 > 3.000 (4 samples, unit ms)*"])
    result.stdout.fnmatch_lines([
        "*= dependability gates =*",
        f"*test_fast *{marker}*4.000*≤ 5.000*PASS",
        f"*test_too_slow*{marker}*4.000*≤ 3.000*FAIL",
        f"*test_fast_without_outlier*{marker}*2.000*≤ 3.000*PASS",
    ])
    evidence = json.loads((gate_project.pytester.path / "e.json").read_text())
    gates = {g["nodeid"].split("::")[1]: g for g in evidence["gates"]}
    assert set(gates) == {"test_fast", "test_too_slow", "test_fast_without_outlier"}
    slow = gates["test_too_slow"]
    assert slow["marker"] == marker and slow["metric"] == "mean latency" and slow["op"] == "<="
    assert slow["value"] == 4.0 and slow["threshold"] == 3.0 and slow["status"] == "failed"
    assert slow["passed"] is False and slow["details"] == {"kept": 4, "seed": 1234, "task": "single-label"}
    assert slow["inputs"]["samples"]["fixture"] == "latencies"
    assert slow["inputs"]["samples"]["origin"]["kind"] == "user fixture"
    assert gates["test_fast_without_outlier"]["value"] == 2.0
    assert gates["test_fast_without_outlier"]["summary"] == f"{marker}: 2.000 <= 3.000 (3 samples, unit s)"
    assert evidence["summary"]["passed"] == 2 and evidence["summary"]["failed"] == 1
    junit = ElementTree.parse(gate_project.pytester.path / "j.xml").getroot()
    out = junit.find(".//testcase[@name='test_fast']").findtext("system-out")
    assert f"[dnnsafety] PASSED {marker}: 4.000 <= 5.000 (4 samples, unit ms)" in out
    out = junit.find(".//testcase[@name='test_too_slow']").findtext("system-out")
    assert f"[dnnsafety] FAILED {marker}: 4.000 > 3.000" in out
    # the result hook: once per gate, on the controller only
    calls = _log(log)
    assert sorted(c["nodeid"].split("::")[1] for c in calls) == ["test_fast", "test_fast_without_outlier",
                                                                 "test_too_slow"]
    assert all(not c["worker"] for c in calls) and len({c["pid"] for c in calls}) == 1
    assert {c["nodeid"].split("::")[1]: c["status"] for c in calls}["test_too_slow"] == "failed"


@pytest.mark.parametrize(("kind", "extra"), [("conftest", ()), ("plugin", ()), ("plugin", ("-n", "2"))],
                         ids=["conftest", "plugin", "plugin-xdist"])
def test_custom_gate_bad_argument_is_a_collection_error(gate_project: GateProject, monkeypatch: pytest.MonkeyPatch,
                                                        kind: str, extra: tuple[str, ...]) -> None:
    marker, args = _install(gate_project, kind, monkeypatch)
    gate_project.tests(f"""
        import pytest

        @pytest.mark.{marker}(5.0, trim=3)
        def test_bad_trim():
            pass

        @pytest.mark.{marker}(5.0, trim="1")
        def test_trim_as_text():
            pass

        @pytest.mark.{marker}(5.0, max_drop=0.1)
        def test_wrong_regression_keyword():
            pass

        @pytest.mark.{marker}(-1.0)
        def test_threshold_out_of_range():
            pass
    """)
    result = gate_project.run(*args, *extra, subprocess=_subprocess(kind, extra))
    # pytest stops at a collection error; pytest-xdist reports it as a failed run
    assert result.ret == (pytest.ExitCode.TESTS_FAILED if extra else pytest.ExitCode.INTERRUPTED)
    out = result.stdout.str()
    for line in [
        f"test_gates.py::test_bad_trim: @pytest.mark.{marker}: argument trim: 3 is outside [0, 2]. "
        "Fix: drop the n slowest samples, n = 0, 1 or 2.",
        f"test_gates.py::test_trim_as_text: @pytest.mark.{marker}: argument trim: expected int, got str '1'.",
        f"test_gates.py::test_wrong_regression_keyword: @pytest.mark.{marker}: argument max_drop: {marker} must "
        "stay below its threshold (<=), so a regression is a rise. Fix: use max_rise=... instead.",
        f"test_gates.py::test_threshold_out_of_range: @pytest.mark.{marker}: argument threshold: -1.0 is outside "
        "[0.0, 1000000.0]. Fix: use a number in [0.0, 1000000.0].",
    ]:
        assert line in out, out
    assert "passed" not in result.parseoutcomes()


def test_markers_listing_and_strict_markers_know_custom_gates(gate_project: GateProject,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    marker, _ = _install(gate_project, "conftest", monkeypatch)
    listing = gate_project.run("--markers")
    listing.stdout.fnmatch_lines([f"@pytest.mark.{marker}(threshold, trim=0, unit='ms', samples='latencies'): "
                                  "mean of the latency samples"])


def test_gate_registered_in_a_subfolder_conftest(gate_project: GateProject) -> None:
    """The hook is historic: a conftest.py loaded during collection registers its gates as it loads."""
    gate_project.write("sub/conftest.py", GATE_SOURCE.format(marker="max_sub_latency"))
    gate_project.write("sub/test_sub.py", TESTS.format(marker="max_sub_latency"))
    result = gate_project.run("--strict-markers")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*test_too_slow*max_sub_latency*4.000*FAIL"])


# ---------------------------------------------------------------------------------- registry refusals


def test_duplicate_marker_is_a_usage_error_naming_both_sources(gate_project: GateProject,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    marker, args = _install(gate_project, "plugin", monkeypatch)
    gate_project.write("conftest.py", GATE_SOURCE.format(marker=marker))
    gate_project.tests(TESTS.format(marker=marker))
    result = gate_project.run(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert f"gate marker {marker!r} is registered twice: by " in err
    first, _, second = err.partition(" and by ")
    assert {f"{PLUGIN_MODULE} (", "conftest ("} == {next(p for p in (f"{PLUGIN_MODULE} (", "conftest (") if p in part)
                                                  for part in (first, second)}
    assert f"{PLUGIN_MODULE}.py)" in err and "conftest.py)" in err
    assert "Fix: give one of them another marker name" in err


def test_redefining_a_builtin_marker_names_the_builtin_family(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", GATE_SOURCE.format(marker="min_scene_coverage"))
    gate_project.tests(TESTS.format(marker="min_scene_coverage"))
    result = gate_project.run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*gate marker 'min_scene_coverage' is registered twice: by "
                                 "pytest_dnnsafety.gates.coverage (*coverage.py) and by *conftest*"])


def test_malformed_gate_definition_is_a_usage_error(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", GATE_SOURCE.format(marker="max_bad").replace('op="<="', 'op="=="'))
    gate_project.tests("def test_plain():\n    pass\n")
    result = gate_project.run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*gate 'max_bad' from *conftest* is malformed: op '==' must be '>=' or '<='*"])


def _gate(**changes: Any) -> GateDef:
    fields = dict(marker="min_thing", metric="thing", op=">=", threshold_range=(0.0, 1.0),
                  params=(Param("k", (int,), 2, None, "an int"),), fixtures={"model": "model"},
                  measure=lambda spec, fx, ctx: Measurement(1.0), doc="a thing")
    fields.update(changes)
    return GateDef(**fields)


@pytest.mark.parametrize(("changes", "problem"), [
    ({"marker": "min-thing"}, "marker 'min-thing' must be a Python identifier"),
    ({"marker": "_private"}, "marker '_private' must be a Python identifier not starting with '_'"),
    ({"op": ">"}, "op '>' must be '>=' or '<='"),
    ({"threshold_range": (1.0, 0.0)}, "threshold_range (1.0, 0.0) must be (low, high) numbers with low <= high"),
    ({"threshold_range": (0.0, float("nan"))}, "threshold_range"),
    ({"params": (Param("k", int, 2),)}, "Param 'k': types <class 'int'> must be a non-empty tuple of types"),
    ({"params": (Param("k", (int,), "two"),)}, "Param 'k': default 'two': expected int, got str 'two'"),
    ({"params": (Param("max_drop", (float,), 0.1),)}, "Param 'max_drop' clashes with"),
    ({"params": (Param("model", (str,), "x"),)}, "Param 'model' clashes with"),
    ({"params": [Param("k", (int,), 2)]}, "params must be a tuple of Param"),
    ({"fixtures": {"model": "not a name"}}, "must map role keywords to fixture names"),
    ({"measure": None}, "measure must be callable"),
    ({"optional": {"data": "data"}}, "optional role 'data' is not one of the fixtures"),
])
def test_registry_refuses_malformed_definitions(changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(GateDefinitionError, match="is malformed") as info:
        GateRegistry().add(_gate(**changes), source="here")
    assert problem in str(info.value)


def test_registry_adds_iterates_and_refuses_duplicates() -> None:
    registry = GateRegistry()
    gate = registry.add(_gate(), source="first.py")
    assert registry.add(gate, source="again") is gate  # the same definition twice is harmless
    assert list(registry) == ["min_thing"] and registry["min_thing"] is gate and "min_thing" in registry
    assert registry.source("min_thing") == "first.py" and len(registry) == 1
    with pytest.raises(GateDefinitionError, match="registered twice: by first.py and by second.py"):
        registry.add(_gate(), source="second.py")
    with pytest.raises(GateDefinitionError, match="takes a pytest_dnnsafety.GateDef"):
        registry.add("min_thing")  # type: ignore[arg-type]
    assert registry.add(_gate(marker="max_other", op="<="))  # the caller is the default source
    assert "test_custom_gates" in registry.source("max_other")


def test_required_param_and_regression_keywords_at_parse_time() -> None:
    registry = GateRegistry()
    registry.add(_gate(params=(Param("layer", (str,), REQUIRED, None, "name a layer"),)), source="t")
    with pytest.raises(MarkerError, match=r"argument layer: missing\. Fix: write @pytest.mark.min_thing"):
        parse_marker("min_thing", (0.5,), {}, "t.py::test", registry)
    spec = parse_marker("min_thing", (0.5,), {"layer": "fc", "max_drop": 0.02}, "t.py::test", registry)
    assert spec.regression_limit == 0.02 and spec.definition is registry["min_thing"]
    assert "max_drop" not in spec.options
    for bad in (-0.1, float("nan"), True, "0.1"):
        with pytest.raises(MarkerError, match="argument max_drop: expected a non-negative finite number"):
            parse_marker("min_thing", (0.5,), {"layer": "fc", "max_drop": bad}, "t.py::test", registry)
    with pytest.raises(MarkerError, match=r"argument max_rise: min_thing must reach its threshold \(>=\), so a "
                                          r"regression is a drop\. Fix: use max_drop=\.\.\. instead\."):
        parse_marker("min_thing", (0.5,), {"layer": "fc", "max_rise": 0.1}, "t.py::test", registry)
    with pytest.raises(MarkerError, match="unknown keyword. Fix: use one of batch_size, device, layer, max_seconds, model, "
                                          "sample, seed, task, max_drop"):
        parse_marker("min_thing", (0.5,), {"layer": "fc", "lyer": 1}, "t.py::test", registry)


# ---------------------------------------------------------------------------------- the result hook


def test_result_hook_that_raises_fails_the_run_but_keeps_the_evidence(gate_project: GateProject,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    marker, _ = _install(gate_project, "conftest", monkeypatch)
    gate_project.write("conftest.py", GATE_SOURCE.format(marker=marker) + '''

@hookimpl
def pytest_dnnsafety_gate_result(result, config):
    raise ConnectionError("dashboard unreachable")
''')
    gate_project.tests(f"""
        import pytest

        @pytest.mark.{marker}(5.0)
        def test_fast():
            pass
    """)
    result = gate_project.run("--dnnsafety-json=e.json")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*pytest_dnnsafety_gate_result raised for test_gates.py::test_fast "
                                 f"{marker}: ConnectionError: dashboard unreachable; the run fails*"])
    assert json.loads((gate_project.pytester.path / "e.json").read_text())["gates"][0]["status"] == "passed"


def test_result_hook_sees_lost_and_not_evaluated_gates(gate_project: GateProject,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    marker, _ = _install(gate_project, "conftest", monkeypatch)
    log = gate_project.pytester.path / "hook.log"
    monkeypatch.setenv("GATE_RESULT_LOG", str(log))
    gate_project.tests(f"""
        import os
        import pytest

        @pytest.mark.{marker}(5.0)
        def test_crash():
            os._exit(3)

        @pytest.mark.skip(reason="not today")
        @pytest.mark.{marker}(5.0)
        def test_skipped():
            pass
    """)
    gate_project.run("-n", "2", "-p", "no:faulthandler")
    calls = {c["nodeid"].split("::")[1]: c["status"] for c in _log(log)}
    assert calls == {"test_crash": "lost", "test_skipped": "not-evaluated"}
    assert len(_log(log)) == 2


# ---------------------------------------------------------------------------------- evaluate's contracts


class _BaselineSettings:
    """Real settings, plus a ``baseline`` setting (config.py's, once it lands) pointing at ``path``."""

    def __init__(self, path: Path) -> None:
        self._real = Settings(cli={}, ini=lambda name: "", env={}, invocation_dir=path.parent)
        self._baseline = Resolved("baseline", str(path), "command-line option --dnnsafety-baseline", str(path),
                                  path.parent)

    def get(self, name: str, *args: Any, **kwargs: Any) -> Resolved:
        return self._baseline if name == "baseline" else self._real.get(name, *args, **kwargs)

    def value(self, name: str) -> Any:
        return self.get(name).value

    def path(self, resolved: Resolved) -> Path:
        return self._real.path(resolved)


@pytest.fixture
def baseline_stub(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A stand-in for ``pytest_dnnsafety.report.baseline`` written to its contract."""
    calls: dict[str, Any] = {"loads": 0, "compared": []}
    module = types.ModuleType("pytest_dnnsafety.report.baseline")

    class Baseline:
        @classmethod
        def load(cls, path: Path) -> "Baseline":
            from pytest_dnnsafety.errors import ConfigError

            calls["loads"] += 1
            if not Path(path).exists():
                raise ConfigError(f"baseline file {path} does not exist")
            return cls()

        def lookup(self, nodeid: str, marker: str) -> dict[str, Any] | None:
            return {"value": 0.9} if nodeid.endswith("known") else None

    def compare(result: Any, stored: dict[str, Any] | None, limit: float | None) -> dict[str, Any]:
        calls["compared"].append((result.nodeid, result.value, stored, limit, dict(result.inputs)))
        if stored is None:
            return {"status": "missing", "baseline_value": None, "change": None, "limit": limit,
                    "message": "no stored result"}
        change = result.value - stored["value"]
        regressed = limit is not None and -change > limit
        return {"status": "regressed" if regressed else "ok", "baseline_value": stored["value"], "change": change,
                "limit": limit, "message": f"dropped by {-change:.3f} > {limit}" if regressed else "within limit"}

    module.Baseline, module.compare = Baseline, compare
    monkeypatch.setitem(sys.modules, "pytest_dnnsafety.report.baseline", module)
    return calls


def _spec(value: float, **kwargs: Any):
    registry = GateRegistry()
    registry.add(_gate(measure=lambda spec, fx, ctx: Measurement(value, detail="measured")), source="t")
    return parse_marker("min_thing", (0.5,), kwargs, "t.py::test", registry)


def test_regression_beyond_max_drop_fails_a_passing_gate(tmp_path: Path, baseline_stub: dict[str, Any]) -> None:
    stored = tmp_path / "baseline.json"
    stored.write_text("{}")
    settings = _BaselineSettings(stored)
    cache: dict[str, Any] = {}
    result = evaluate(_spec(0.8, max_drop=0.05), {}, settings, "t.py::known", cache,  # type: ignore[arg-type]
                      inputs={"model": {"digest": "sha256:1"}})
    assert result.status == "failed" and result.passed is False
    assert result.summary == "min_thing: 0.800 >= 0.500 (measured); regression: dropped by 0.100 > 0.05"
    assert result.baseline["status"] == "regressed" and result.baseline["baseline_value"] == 0.9
    assert baseline_stub["compared"][0][3] == 0.05
    assert baseline_stub["compared"][0][4] == {"model": {"digest": "sha256:1"}}  # inputs known before comparing
    within = evaluate(_spec(0.88, max_drop=0.05), {}, settings, "t.py::known", cache)  # type: ignore[arg-type]
    assert within.status == "passed" and within.baseline["status"] == "ok" and "regression" not in within.summary
    missing = evaluate(_spec(0.8), {}, settings, "t.py::new", cache)  # type: ignore[arg-type]
    assert missing.status == "passed" and missing.baseline["status"] == "missing"
    assert baseline_stub["loads"] == 1, "the baseline is loaded once per process"
    assert json.loads(missing.to_json())["baseline"]["status"] == "missing"


def test_unreadable_baseline_is_a_gate_error(tmp_path: Path, baseline_stub: dict[str, Any]) -> None:
    settings = _BaselineSettings(tmp_path / "nowhere.json")
    result = evaluate(_spec(0.8), {}, settings, "t.py::known", {})  # type: ignore[arg-type]
    assert result.status == "error" and result.passed is None and result.value == 0.8
    assert "baseline: cannot compare: baseline file" in result.summary
    assert result.details["baseline_error_type"] == "ConfigError"


def test_no_baseline_setting_leaves_the_result_alone() -> None:
    settings = Settings(cli={}, ini=lambda name: "", env={})
    result = evaluate(_spec(0.8, max_drop=0.01), {}, settings, "t.py::known", {})
    assert result.status == "passed" and result.baseline is None


def test_each_measure_runs_inside_progress_active(monkeypatch: pytest.MonkeyPatch) -> None:
    """The contract with ``pytest_dnnsafety.runtime.progress``: ``active(label=..., write=writer)`` around measure."""
    seen: list[tuple[str, Any, bool]] = []
    inside = {"now": False}
    module = types.ModuleType("pytest_dnnsafety.runtime.progress")

    @contextlib.contextmanager
    def active(label: str, write: Any, **options: Any):  # options: the gate's estimate
        inside["now"] = True
        yield
        inside["now"] = False

    def measure(spec: Any, fx: Any, ctx: Any) -> Measurement:
        seen.append((spec.marker, ctx.seed, inside["now"]))
        return Measurement(1.0)

    module.active = active
    module.writer_for = lambda config: print
    from pytest_dnnsafety.gates import evaluation
    from pytest_dnnsafety.gates.evaluation import progress_writer

    monkeypatch.setattr(evaluation, "progress", module)

    assert progress_writer(object()) is print
    registry = GateRegistry()
    registry.add(_gate(measure=measure), source="t")
    spec = parse_marker("min_thing", (0.5,), {}, "t.py::test", registry)
    evaluate(spec, {}, Settings(cli={}, ini=lambda name: "", env={}), "t.py::test", writer=print)
    assert seen == [("min_thing", 0, True)]


ESTIMATE_GATE = '''
import pytest
from pytest_dnnsafety import GateDef, Measurement, Param, hookimpl


def _measure(spec, fx, ctx):
    return Measurement(0.5, detail="a point estimate", details={"statistic": spec.options["statistic"]})


@hookimpl
def pytest_dnnsafety_register_gates(registry):
    registry.add(GateDef(
        marker="min_guess", metric="guessed margin", op=">=", threshold_range=(0.0, 1.0),
        params=(Param("statistic", (str,), "bound", None, "bound or estimate"),),
        fixtures={}, measure=_measure, doc="a gate that may report an estimate"))
'''


def test_an_estimate_is_labelled_in_every_report(gate_project: GateProject) -> None:
    """A gate whose details say ``statistic="estimate"`` is labelled so in the terminal, JSON and summary line."""
    gate_project.write("conftest.py", ESTIMATE_GATE)
    gate_project.tests("import pytest\n\n"
                       "@pytest.mark.min_guess(0.9, statistic='estimate')\ndef test_estimate():\n    pass\n\n"
                       "@pytest.mark.min_guess(0.1)\ndef test_bound():\n    pass\n")
    result = gate_project.run("--dnnsafety-json=evidence.json")
    result.stdout.fnmatch_lines(["*test_estimate*min_guess (estimate)*FAIL*",
                                 "*0.500 (estimate) < 0.900*"])
    gates = {g["nodeid"].rsplit("::", 1)[-1]: g for g in
             json.loads((gate_project.pytester.path / "evidence.json").read_text())["gates"]}
    assert gates["test_estimate"]["metric"] == "guessed margin (estimate, not a guarantee)"
    assert gates["test_bound"]["metric"] == "guessed margin"
