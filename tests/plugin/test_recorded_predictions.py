"""Recorded predictions through the plugin (issue #32, item 2): ``dnnsafety_predictions`` stands in for the model.

On the digits project (tests/_digits_project.py): logits recorded from the trained CNN give the output-only gates
(scenario accuracy and degradation, weighted confusion) the values of the model run, with no model configured and
no forward pass; a gate that needs the model (an attack) is refused naming its marker, the file and the fix;
given with the model (the CLI option), the attack runs the model and the others read the recording, each gate's
evidence saying which; a file with the wrong row count is an error naming both counts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from _digits import digits_cnn
from _digits_project import digits_project, gates_of, write_digits_files
from conftest import GateProject

N = 300

GATES = {
    "accuracy": 'min_scenario_accuracy(0.5, by=["lighting"])',
    "degradation": 'max_scenario_degradation(0.5, by=["lighting"])',
    "confusion": 'max_weighted_confusion(1e9, severity={"1": {"7": 10.0}, "3": {"8": 2.0}}, gate_on="value")',
    "attack": 'max_adversarial_confidence_loss(1.0, eps=0.05, families=["fgsm"], clip=(0, 1))',
}
OUTPUT_ONLY = ("accuracy", "degradation", "confusion")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits_recorded")
    x, _ = write_digits_files(root)
    with torch.no_grad():
        logits = digits_cnn().eval()(x)  # the model of models/digits.pt, run elsewhere
    np.save(root / "data" / "logits.npy", logits.numpy())
    np.save(root / "data" / "short.npy", logits[:-1].numpy())
    (root / "data" / "scenarios.csv").write_text(
        "lighting\n" + "\n".join(["day", "dusk", "night"][i % 3] for i in range(N)) + "\n")
    (root / "data" / "conditions.toml").write_text('[conditions]\nlighting = ["day", "dusk", "night"]\n')
    return root


def _run(gate_project: GateProject, files: Path, *args: str, model: bool = True) -> tuple[dict, object]:
    project = digits_project(gate_project, files, GATES)
    if not model:
        del project.ini["dnnsafety_model"], project.ini["dnnsafety_model_factory"]
    result = project.run("--dnnsafety-json=evidence.json", *args)
    return gates_of(project), result


def test_recorded_logits_give_the_model_runs_values_and_the_attack_is_refused(gate_project: GateProject,
                                                                             files: Path) -> None:
    eager, _ = _run(gate_project, files)
    for name in GATES:
        assert eager[name]["status"] in ("passed", "failed"), eager[name]["summary"]
        assert "outputs_from" not in eager[name]["details"]
    recorded, result = _run(gate_project, files, "-o", "dnnsafety_predictions=data/logits.npy", model=False)
    path = gate_project.pytester.path / "data" / "logits.npy"
    sha = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    for name in OUTPUT_ONLY:
        got, want = recorded[name], eager[name]
        assert got["status"] == want["status"], got["summary"]
        assert got["value"] == pytest.approx(want["value"], abs=1e-9), name
        assert (got["bound"] is None) == (want["bound"] is None)
        if want["bound"] is not None:
            assert got["bound"] == pytest.approx(want["bound"], abs=1e-9), name
        assert got["details"]["outputs_from"] == f"recorded predictions {path} {sha}; the model was not run"
        assert got["details"]["recorded_predictions"]["sha256"] == sha
        assert got["inputs"]["model"]["digest"] == sha  # the evidence's fingerprint of what stood in for the model
    attack = recorded["attack"]
    assert attack["status"] == "error" and attack["details"]["error_type"] == "ConfigError"
    for part in ("max_adversarial_confidence_loss", str(path), "recorded predictions only", "dnnsafety_model"):
        assert part in attack["summary"], part
    result.assert_outcomes(passed=3, failed=1)
    assert _passes(gate_project) == []  # no forward pass of any model


def _passes(gate_project: GateProject) -> list[dict]:
    import json

    return json.loads((gate_project.pytester.path / "evidence.json").read_text())["shared_passes"]


def test_with_the_model_the_attack_runs_it_and_the_others_read_the_recording(gate_project: GateProject,
                                                                            files: Path) -> None:
    both, _ = _run(gate_project, files, "--dnnsafety-predictions=data/logits.npy")
    for name in OUTPUT_ONLY:
        assert both[name]["details"]["outputs_from"].endswith("the model was not run"), name
    attack = both["attack"]
    assert attack["status"] in ("passed", "failed"), attack["summary"]
    assert attack["details"]["outputs_from"] == "model run"
    assert "logits.npy" in attack["details"]["recorded_predictions_not_read"]
    assert all(entry["marker"] == "max_adversarial_confidence_loss" for entry in _passes(gate_project))


def test_a_predictions_file_with_the_wrong_row_count_names_both_counts(gate_project: GateProject,
                                                                       files: Path) -> None:
    _, result = _run(gate_project, files, "-o", "dnnsafety_predictions=data/short.npy", model=False)
    result.assert_outcomes(errors=len(GATES))
    result.stdout.fnmatch_lines([("*fixture 'model'*short.npy*holds 299 rows but the evaluation data hold 300 "
                                  "samples*Fix: *")])
