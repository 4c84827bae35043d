"""The published JSON Schema of the evidence file (``pytest_dnnsafety/report/schemas/evidence.schema.json``).

Real evidence validates: the example project's (its full run under two xdist workers in
``test_neuron_gates.py::test_example_project_gates_pass`` validates with :func:`validate_file`) and the
canvas example's detection, multi-label and coverage gates (when its trained files exist). A synthetic evidence built with ``build_evidence`` that
holds every status (an error with a traceback, not-evaluated, lost, inconclusive, NaN values)
validates; broken documents (a missing key, an unknown status, NaN as a float, ...) do not. The
schema's lists (statuses, a gate's fields, the summary's counts) are checked against the code.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

jsonschema = pytest.importorskip("jsonschema")

from pytest_dnnsafety.report.evidence import SCHEMA, build_evidence  # noqa: E402
from pytest_dnnsafety.results import STATUSES, GateResult  # noqa: E402
from pytest_dnnsafety.report.schemas import evidence_schema  # noqa: E402
from pytest_dnnsafety.plugin.session.base import unmeasured  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def validator() -> Any:
    schema = evidence_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def _errors(validator: Any, evidence: dict[str, Any]) -> list[str]:
    return [f"{e.json_path}: {e.message[:300]}" for e in validator.iter_errors(evidence)]


def _strict_load(path: Path) -> dict[str, Any]:
    """The file as a strict JSON parser reads it (a NaN or Infinity token is an error)."""
    def refuse(token: str) -> Any:
        raise ValueError(f"{path}: non-strict JSON token {token}")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


# ------------------------------------------------------------------------------ the schema and the code


def test_schema_ships_in_the_package_and_matches_the_code() -> None:
    schema = evidence_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["schema"]["const"] == SCHEMA
    gate = schema["$defs"]["gate"]
    assert gate["properties"]["status"]["enum"] == list(STATUSES)
    fields = [f.name for f in dataclasses.fields(GateResult)]
    assert sorted(gate["required"]) == sorted(fields) == sorted(gate["properties"])
    summary = schema["properties"]["summary"]
    assert summary["required"] == [*STATUSES, "total"]


# ------------------------------------------------------------------------------------- real evidence


def validate_file(path: Path) -> list[str]:
    """The schema errors of an evidence file read strictly (used by the example project's run in test_neuron_gates)."""
    schema = evidence_schema()
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return _errors(validator, _strict_load(path))


def _run(project: Path, report: Path, *args: str) -> dict[str, Any]:
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--dnnsafety-json={report}",
                          *args], cwd=project, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return _strict_load(report)


def test_canvas_example_evidence_validates(tmp_path: Path, validator: Any) -> None:
    """The canvas example (detection, multi-label), run in a copy with its trained files (about 25 s)."""
    source = ROOT / "example_canvas"
    needed = [source / "models" / "detector.pt", source / "models" / "reader.pt", source / "data" / "scenarios.csv"]
    if not all(p.is_file() for p in needed):
        pytest.skip("example_canvas is not trained (run `python -m canvas_demo.train` in example_canvas/)")
    project = tmp_path / "example_canvas"
    shutil.copytree(source, project, ignore=shutil.ignore_patterns("reports", "__pycache__", ".pytest_cache"))
    # its detection, multi-label and coverage gates (the occlusion and monitor gates take most of its time)
    evidence = _run(project, tmp_path / "evidence.json", "tests/test_detection.py", "tests/test_reader.py",
                    "tests/test_coverage.py")
    assert {g["details"].get("task") for g in evidence["gates"]} >= {"detection"}
    assert _errors(validator, evidence) == []


# -------------------------------------------------------------------------------- synthetic evidence

ENTRY = {"marker": "dummy_gate", "metric": "dummy metric", "op": ">=", "threshold": 0.5}

MODEL_INPUT = {
    "fixture": "model",
    "origin": {"kind": "plugin fixture", "scope": "session",
               "settings": {"model": {"setting": "dnnsafety_model", "spec": "models/m.pt", "source": "default",
                                      "path": "/p/models/m.pt", "sha256": "sha256:" + "a" * 64}}},
    "type": "torch.nn.Sequential", "digest": "sha256:" + "b" * 64, "tensors": 4, "values": 100,
    "digest_of": "parameters and buffers (state_dict order: name, dtype, shape, bytes)", "taken": "at fixture setup",
}
DATA_INPUT = {
    "fixture": "my_loader",
    "origin": {"kind": "user fixture", "scope": "function", "file": "tests/conftest.py", "line": 12,
               "function": "conftest.my_loader"},
    "type": "torch.utils.data.dataloader.DataLoader", "digest": None,
    "not_fingerprinted": "a DataLoader over Folder: materialising its batches is not done for the evidence",
    "taken": "at fixture setup",
}

ENVIRONMENT = {
    "pytest_dnnsafety": "0.1.0", "torch": "2.4.0", "numpy": "2.0.0", "pytest": "8.3.0", "python": "3.11.7",
    "platform": "Linux", "device": "cpu", "seed": 0, "workers": 2,
    "threads": {"threads": 1, "source": "auto", "applied": False, "busy": None},
    "world_size": 1, "backend": None,
    "inputs": {"model": {"spec": "models/m.pt", "source": "default", "path": "/p/models/m.pt",
                         "digest": "sha256:" + "a" * 64},
               "data": {"spec": "data/missing.npz", "source": "default", "path": "/p/data/missing.npz", "digest": None},
               "operational_data": {"spec": "pkg.mod:profile", "source": "default"},
               "scenarios": {"error": "dnnsafety_scenarios: no such file"}},
    "inputs_note": "what each gate actually evaluated is in gates[].inputs", "cwd": "/p",
}


def _results() -> list[GateResult]:
    nan, inf = float("nan"), float("inf")
    common = dict(metric="dummy metric", threshold=0.5, op=">=", device="cpu")
    return [
        GateResult(nodeid="t.py::test_pass", marker="dummy_gate", status="passed", value=0.9, bound=0.8, passed=True,
                   summary="dummy_gate: 0.800 (bound) >= 0.500", seconds=0.25, startup_seconds=0.5,
                   details={"task": "single-label", "statistic": "accuracy", "bound_kind": "exact",
                            "per_group": [{"group": "night", "value": 0.8}], "no_signal": None},
                   inputs={"model": MODEL_INPUT, "data": DATA_INPUT},
                   baseline={"status": "regressed", "baseline_value": 0.95, "value": 0.8, "change": -0.15,
                             "limit": 0.1, "message": "0.950 → 0.800 (-0.150, max_drop 0.1): regressed"},
                   **common),
        GateResult(nodeid="t.py::test_fail", marker="dummy_gate", status="failed", value=0.9, bound=0.8, passed=False,
                   summary="dummy_gate: contradiction: the bound is below the estimate",
                   details={"task": "multi-label", "contradiction": "the upper bound 0.8 is below the estimate 0.9"},
                   baseline={"status": "inputs-changed", "baseline_value": 0.9, "value": 0.8, "change": -0.1,
                             "limit": None, "message": "inputs changed",
                             "changed": [{"role": "model", "baseline": "sha256:" + "c" * 64,
                                          "current": "sha256:" + "b" * 64}]},
                   **common),
        GateResult(nodeid="t.py::test_error", marker="dummy_gate", status="error", passed=None,
                   summary="dummy_gate: error while computing dummy metric: ValueError: the model exploded",
                   details={"error": "the model exploded on batch 0", "error_type": "ValueError",
                            "traceback": ["conftest.py:9 in _measure: raise ValueError('the model exploded')"],
                            "warnings": ["eps >= r-hat"]},
                   inputs={"model": MODEL_INPUT}, baseline={"status": "missing", "baseline_value": 0.9, "value": None,
                                                            "change": None, "limit": 0.05, "message": "no number"},
                   **common),
        GateResult(nodeid="t.py::test_ranks", marker="dummy_gate", status="error", passed=False,
                   summary="dummy_gate: error: the 2 torchrun ranks disagree",
                   details={"reason": "ranks disagree",
                            "ranks": [{"rank": 0, "status": "passed", "value": 0.9, "bound": None},
                                      {"rank": 1, "status": "passed", "value": nan, "bound": None}]},
                   **common),
        unmeasured(ENTRY, "t.py::test_skipped", "not-evaluated", "the test was skipped"),
        unmeasured(ENTRY, "t.py::test_lost", "lost", "worker gw1 crashed"),
        GateResult(nodeid="t.py::test_inconclusive", marker="dummy_gate", status="inconclusive", value=nan, bound=inf,
                   passed=False, summary="dummy_gate: inconclusive: fewer than 30 samples per cell",
                   details={"task": "detection", "inconclusive": "fewer than 30 samples per cell",
                            "E": nan, "Ub": inf, "cells": {"a": -inf, "b": [nan, 1.0]}},
                   **common),
    ]


def _synthetic() -> dict[str, Any]:
    evidence = build_evidence(_results(), copy.deepcopy(ENVIRONMENT), lost=["t.py::test_lost"])
    json.loads(json.dumps(evidence, allow_nan=False))  # strict JSON, as write_evidence writes it
    return evidence


def test_synthetic_evidence_with_every_status_validates(validator: Any) -> None:
    evidence = _synthetic()
    assert {g["status"] for g in evidence["gates"]} == set(STATUSES)
    inconclusive = evidence["gates"][-1]
    details = inconclusive["details"]
    shown = (inconclusive["value"], inconclusive["bound"], details["cells"]["a"], details["E"])
    assert shown == ("nan", "inf", "-inf", "nan")
    assert _errors(validator, evidence) == []


def _parent(evidence: dict[str, Any], path: str) -> tuple[Any, str]:
    """The container of the last key of ``path`` (``/``-separated; ``t.py::...`` picks a gate by node id)."""
    keys = path.split("/")
    target: Any = evidence
    for key in keys[:-1]:
        target = next(g for g in target if g["nodeid"] == key) if key.startswith("t.py::") else target[key]
    return target, keys[-1]


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Sets ``value`` at ``path`` (see :func:`_parent`)."""
    def change(evidence: dict[str, Any]) -> None:
        target, key = _parent(evidence, path)
        target[key] = value
    return change


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    """Deletes the key at ``path`` (see :func:`_parent`)."""
    def change(evidence: dict[str, Any]) -> None:
        target, key = _parent(evidence, path)
        del target[key]
    return change


BROKEN = {
    "missing top-level key": _delete("summary"),
    "missing environment key": _delete("environment/seed"),
    "missing gate key": _delete("gates/t.py::test_pass/threshold"),
    "unknown top-level key": _set("extra", 1),
    "other schema": _set("schema", "pytest-dnnsafety/2"),
    "wrong status": _set("gates/t.py::test_pass/status", "ok"),
    "wrong op": _set("gates/t.py::test_pass/op", ">"),
    "NaN as a float value": _set("gates/t.py::test_pass/value", math.nan),
    "Infinity as a float bound": _set("gates/t.py::test_pass/bound", math.inf),
    "NaN as a float inside details": _set("gates/t.py::test_pass/details/per_group", [{"value": math.nan}]),
    "NaN spelled otherwise": _set("gates/t.py::test_pass/value", "NaN"),
    "threshold NaN": _set("gates/t.py::test_pass/threshold", "nan"),
    "value as text": _set("gates/t.py::test_pass/value", "0.9"),
    "passed status that did not pass": _set("gates/t.py::test_pass/passed", False),
    "lost gate with a verdict": _set("gates/t.py::test_lost/passed", True),
    "error without a cause": _set("gates/t.py::test_error/details", {}),
    "inconclusive without why": _delete("gates/t.py::test_inconclusive/details/inconclusive"),
    "negative count": _set("summary/failed", -1),
    "summary count missing": _delete("summary/lost"),
    "unknown task": _set("gates/t.py::test_pass/details/task", "regression"),
    "bad digest": _set("gates/t.py::test_pass/inputs/model/digest", "md5:abc"),
    "no digest and no reason": _delete("gates/t.py::test_pass/inputs/data/not_fingerprinted"),
    "unknown baseline status": _set("gates/t.py::test_pass/baseline/status", "worse"),
    "created not a time": _set("created", "yesterday"),
    "lost not a list of node ids": _set("lost", [1]),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_evidence_does_not_validate(validator: Any, name: str) -> None:
    evidence = _synthetic()
    BROKEN[name](evidence)
    assert _errors(validator, evidence), f"{name}: the schema accepted a broken document"
