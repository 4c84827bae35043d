"""Declared properties of a gate definition (issue #20 item 3): ``layers``, ``timed``, ``shards``.

Only the layers a gate declares (``GateDef.layers(options) -> names``) are planned into the session's
shared forward pass: a user gate whose option merely happens to be called ``layer`` (an int, a list)
is not guessed at (it used to crash collection with an INTERNALERROR). A declared-layers function
that raises or gives no names is a collection error naming the gate. A gate declared ``timed`` takes
rank 0's verdict under torchrun.
"""

from __future__ import annotations

import json
import types
from typing import Any

import pytest

from conftest import GateProject
from pytest_dnnsafety import GateDef, GateRegistry, Measurement, Param
from pytest_dnnsafety.runtime import torchrun as ranks
from pytest_dnnsafety.errors import MarkerError
from pytest_dnnsafety.gates import GATES, parse_marker
from pytest_dnnsafety.results import GateResult
from pytest_dnnsafety.plugin.session import TorchrunRank

USER_GATES = '''
import json

import pytest
from pytest_dnnsafety import GateDef, Measurement, Param, hookimpl


def _measure(spec, fx, ctx):
    return Measurement(1.0, details={"layer": spec.options["layer"]})


def _gate(marker, types, default, **more):
    return GateDef(marker=marker, metric="a number", op=">=", threshold_range=(0.0, 1.0),
                   params=(Param("layer", types, default),), fixtures={"model": "model", "data": "dataset"},
                   measure=_measure, doc="a user gate whose option is called layer", **more)


@hookimpl
def pytest_dnnsafety_register_gates(registry):
    registry.add(_gate("min_int_layer", (int,), 0))
    registry.add(_gate("min_list_layer", (list,), []))
    registry.add(_gate("min_named_layer", (str,), "body.0", layers=lambda options: (options["layer"],)))
    registry.add(_gate("min_raising_layers", (str,), "x", layers=lambda options: options["nothing"]))
    registry.add(_gate("min_numbered_layers", (int,), 3, layers=lambda options: [options["layer"]]))


@pytest.fixture(scope="session")
def model():
    return object()


@pytest.fixture(scope="session")
def dataset():
    return object()


def pytest_sessionfinish(session):
    plugin = session.config.pluginmanager.get_plugin("dnnsafety-session")
    plan = {" ".join(pair): list(layers) for pair, layers in plugin.cache.get("layer_plan", {}).items()}
    (session.config.rootpath / "plan.json").write_text(json.dumps(plan))
'''


def test_a_user_option_called_layer_is_not_guessed_at(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", USER_GATES)
    gate_project.tests('''
        import pytest


        @pytest.mark.min_int_layer(0.5, layer=3)
        def test_int():
            pass


        @pytest.mark.min_list_layer(0.5, layer=["a", "b"])
        def test_list():
            pass


        @pytest.mark.min_named_layer(0.5, layer="head")
        def test_declared():
            pass
    ''')
    result = gate_project.run("--dnnsafety-json=evidence.json")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    gates = json.loads((gate_project.pytester.path / "evidence.json").read_text())["gates"]
    assert [(g["marker"], g["status"], g["details"]["layer"]) for g in gates] == [
        ("min_int_layer", "passed", 3), ("min_list_layer", "passed", ["a", "b"]),
        ("min_named_layer", "passed", "head")]
    # only the declared layer is planned into the shared forward pass
    assert json.loads((gate_project.pytester.path / "plan.json").read_text()) == {"model dataset": ["head"]}


@pytest.mark.parametrize(("marker", "problem"), [
    ("min_raising_layers", "its layers(options) raised KeyError"),
    ("min_numbered_layers", "its layers(options) gave 3, not a layer name"),
])
def test_a_broken_layers_declaration_is_a_collection_error_naming_the_gate(gate_project: GateProject, marker: str,
                                                                          problem: str) -> None:
    gate_project.write("conftest.py", USER_GATES)
    gate_project.tests(f"import pytest\n\n\n@pytest.mark.{marker}(0.5)\ndef test_gate():\n    pass\n")
    result = gate_project.run()
    assert result.ret == pytest.ExitCode.INTERRUPTED, result.stdout.str()
    output = result.stdout.str()
    assert "INTERNALERROR" not in output + result.stderr.str()
    result.stdout.fnmatch_lines([f"*test_gates.py::test_gate: @pytest.mark.{marker}: gate {marker!r}: {problem}*"
                                 "Fix the GateDef: layers(options) must return the names of the layers*"])


def _gate(**more: Any) -> GateDef:
    return GateDef(marker="min_thing", metric="a number", op=">=", threshold_range=(0.0, 1.0),
                   params=(Param("layer", (str,), "a"),), fixtures={}, measure=lambda spec, fx, ctx: Measurement(1.0),
                   doc="a gate", **more)


def test_declared_layers_are_read_at_parse_time() -> None:
    registry = GateRegistry()
    registry.add(_gate(layers=lambda options: (options["layer"], options["layer"], "b")), source="t")
    assert parse_marker("min_thing", (0.5,), {"layer": "x"}, "t.py::t", registry).layers == ("x", "b")
    registry = GateRegistry()
    registry.add(_gate(layers=lambda options: options["layer"]), source="t")  # one name as a str
    assert parse_marker("min_thing", (0.5,), {}, "t.py::t", registry).layers == ("a",)
    registry = GateRegistry()
    registry.add(_gate(layers=lambda options: [None]), source="t")
    with pytest.raises(MarkerError, match=r"t.py::t: @pytest.mark.min_thing: gate 'min_thing': its layers\(options\) "
                                          r"gave None, not a layer name"):
        parse_marker("min_thing", (0.5,), {}, "t.py::t", registry)
    assert parse_marker("min_thing", (0.5,), {}, "t", _registry(_gate())).layers == ()


def _registry(gate: GateDef) -> GateRegistry:
    registry = GateRegistry()
    registry.add(gate, source="t")
    return registry


@pytest.mark.parametrize(("changes", "problem"), [
    ({"layers": "features.3"}, "layers must be None or callable"),
    ({"timed": "yes"}, "timed must be True or False"),
    ({"shards": 1}, "shards must be True or False"),
])
def test_malformed_declarations_are_refused(changes: dict[str, Any], problem: str) -> None:
    assert any(problem in p for p in _gate(**changes).problems())


def test_builtin_gates_declare_their_layers_timing_and_shards() -> None:
    for marker in ("min_neuron_k_activation", "max_neuron_pattern_deviation", "max_class_confusion",
                   "max_class_bias"):
        assert GATES[marker].read_layers({"layer": "features.3"}) == ("features.3",), marker
    assert GATES["min_scene_coverage"].read_layers({}) == ()
    assert [m for m, g in GATES.items() if g.timed] == ["max_monitor_overhead"]
    assert {"min_neuron_k_activation", "max_neuron_pattern_deviation", "min_scenario_accuracy",
            "max_scenario_degradation", "max_pmi_ub"} <= {m for m, g in GATES.items() if g.shards}


def _fake_ranks(monkeypatch: pytest.MonkeyPatch, rank: int, others: list[Any]) -> list[Any]:
    """This process is ``rank`` of a 2-rank run; ``gather`` answers ``others`` with this rank's value put in."""
    seen: list[Any] = []

    def gather(obj: Any) -> list[Any]:
        seen.append(obj)
        out = list(others)
        out[rank] = obj
        return out

    monkeypatch.setattr(ranks, "active", lambda: True)
    monkeypatch.setattr(ranks, "is_main", lambda: rank == 0)
    monkeypatch.setattr(ranks, "gather", gather)
    return seen


def _result(value: float, status: str) -> GateResult:
    return GateResult(nodeid="t.py::t", marker="min_thing", metric="a number", threshold=0.5, op=">=",
                      status=status, value=value, summary=f"min_thing: {value}")


def test_a_user_gate_declared_timed_takes_rank_0s_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_marker("min_thing", (0.5,), {}, "t", _registry(_gate(timed=True)))
    rank0 = _result(0.9, "passed")
    _fake_ranks(monkeypatch, 1, [rank0.to_dict(), None])
    mine = _result(0.1, "failed")  # a wall-clock number differs on every rank
    TorchrunRank.settle(types.SimpleNamespace(), spec, mine)  # type: ignore[arg-type]
    assert (mine.status, mine.value, mine.summary) == ("passed", 0.9, "min_thing: 0.9")


def test_an_untimed_gate_whose_ranks_disagree_is_an_error_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_marker("min_thing", (0.5,), {}, "t", _registry(_gate()))
    _fake_ranks(monkeypatch, 1, [("min_thing", "passed", 0.9, None), None])
    mine = _result(0.1, "failed")
    TorchrunRank.settle(types.SimpleNamespace(), spec, mine)  # type: ignore[arg-type]
    assert mine.status == "error" and "torchrun ranks disagree" in mine.summary


def test_keywords_checked_together_at_parse_time() -> None:
    """``GateDef.together``: a combination of keywords that cannot work is a marker error naming the keyword and the
    fix; a raising check names the gate (never INTERNALERROR)."""
    def together(options: Any) -> tuple[str, str, str] | None:
        return ("layer", "'b' needs another layer", "use layer='a'") if options["layer"] == "b" else None

    registry = _registry(_gate(together=together))
    assert parse_marker("min_thing", (0.5,), {}, "t", registry).options["layer"] == "a"
    with pytest.raises(MarkerError, match=r"t: @pytest.mark.min_thing: argument layer: 'b' needs another layer\. "
                                          r"Fix: use layer='a'\."):
        parse_marker("min_thing", (0.5,), {"layer": "b"}, "t", registry)
    registry = _registry(_gate(together=lambda options: 1 / 0))
    with pytest.raises(MarkerError, match=r"gate 'min_thing': its together\(options\) raised ZeroDivisionError"):
        parse_marker("min_thing", (0.5,), {}, "t", registry)
