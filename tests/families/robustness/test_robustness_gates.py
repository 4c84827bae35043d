"""The robustness gates end to end, on real images and a conv model (scikit-learn's digits).

A user project with the example's digits CNN (trained here in seconds), 300 held-out digits as
``(N, 1, 8, 8)`` images in ``[0, 1]`` and the three markers. Each gate passes on the healthy model
with sensible thresholds and fails on a model that is plainly wrong for it; the two empirical
gates share one run of the perturbation families; ``-n 2`` gives the same numbers; bad marker
arguments are collection errors naming the argument and the fix.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from _digits_project import COUNTING_CONFTEST, digits_project, forward_rows, gates_of, write_digits_files
from conftest import GateProject


HEALTHY = {
    "loss": 'max_adversarial_confidence_loss(0.5, eps=0.05, families=["fgsm", "pgd", "brightness"], clip=(0, 1))',
    "robust": 'min_robust_accuracy(0.5, eps=0.05, families=["fgsm", "pgd", "brightness"], clip=(0, 1))',
    "verified": "min_verified_robustness(0.3, eps=0.005, clip=(0, 1))",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    write_digits_files(root)
    return root


def _project(gate_project: GateProject, files: Path, gates: dict[str, str], conftest: str = "") -> GateProject:
    return digits_project(gate_project, files, gates, conftest)


def _gates(project: GateProject) -> dict[str, dict]:
    return gates_of(project)


def test_healthy_digits_cnn_passes_every_robustness_gate(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, HEALTHY)
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret == 0, result.stdout.str()
    gates = _gates(project)
    assert {name: g["status"] for name, g in gates.items()} == dict.fromkeys(HEALTHY, "passed")
    loss, robust, verified = gates["loss"], gates["robust"], gates["verified"]
    assert 0 < loss["value"] <= 0.5
    details = robust["details"]
    # the worst case per input is no better than any single family, and no better than clean
    assert robust["value"] <= min(details["robust_accuracy"].values()) + 1e-12
    assert robust["value"] <= details["clean_accuracy"]
    assert details["robust_accuracy"]["pgd"] <= details["robust_accuracy"]["fgsm"] + 0.02
    assert loss["details"]["n"] == 300
    v = verified["details"]
    assert v["verified"] + v["falsified"] + v["unknown"] == 300
    assert verified["value"] == pytest.approx(v["verified"] / 300)
    result.stdout.fnmatch_lines(["*max_adversarial_confidence_loss*", "*min_verified_robustness*"])


def test_the_two_empirical_gates_share_one_run_of_the_families(gate_project: GateProject, files: Path) -> None:
    runs = {}
    for gates in ({"loss": HEALTHY["loss"]}, {"loss": HEALTHY["loss"], "robust": HEALTHY["robust"]}):
        project = _project(gate_project, files, gates, COUNTING_CONFTEST)
        assert project.run("--dnnsafety-json=evidence.json").ret == 0
        runs[len(gates)] = forward_rows(project)
    assert runs[1] > 0 and runs[2] == runs[1]


def test_same_seed_same_numbers_and_xdist_agrees(gate_project: GateProject, files: Path) -> None:
    project = _project(gate_project, files, {k: HEALTHY[k] for k in ("loss", "robust")})
    assert project.run("--dnnsafety-json=evidence.json").ret == 0
    serial = {name: g["value"] for name, g in _gates(project).items()}
    assert project.run("--dnnsafety-json=evidence.json", "-n", "2", subprocess=True).ret == 0
    parallel = {name: g["value"] for name, g in _gates(project).items()}
    assert parallel == serial


WRONG = {
    # logits negated: the model ranks the true class last; nothing is robust, nothing verified
    "reversed": "net.classifier[2].weight.mul_(-1); net.classifier[2].bias.mul_(-1)",
}


@pytest.mark.parametrize("gate", ["robust", "verified"])
def test_a_plainly_wrong_model_fails(gate_project: GateProject, files: Path, gate: str) -> None:
    conftest = f"""
        import pytest
        import torch
        import netdef


        @pytest.fixture(scope="session")
        def model():
            net = netdef.trained()
            with torch.no_grad():
                {WRONG["reversed"]}
            return net
    """
    project = _project(gate_project, files, {gate: HEALTHY[gate]}, textwrap.dedent(conftest))
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret != 0
    (only,) = _gates(project).values()
    assert only["status"] == "failed" and only["value"] < 0.05, only


def test_a_fragile_model_fails_the_confidence_loss_gate(gate_project: GateProject, files: Path) -> None:
    """The healthy model under a large budget loses most of its confidence: the gate must fail."""
    marker = 'max_adversarial_confidence_loss(0.2, eps=0.3, families=["pgd"], clip=(0, 1))'
    project = _project(gate_project, files, {"loss": marker})
    assert project.run("--dnnsafety-json=evidence.json").ret != 0
    gate = _gates(project)["loss"]
    assert gate["status"] == "failed" and gate["value"] > 0.5


def test_a_user_family_callable_is_a_family(gate_project: GateProject, files: Path) -> None:
    conftest = """
        import torch

        def invert(model, x, y, eps, generator):
            return 1.0 - x
    """
    project = _project(gate_project, files, {}, textwrap.dedent(conftest))
    project.tests(textwrap.dedent("""
        import pytest
        from conftest import invert

        @pytest.mark.max_adversarial_confidence_loss(0.05, eps=0.1, families=["brightness", invert], clip=(0, 1))
        def test_loss(model, dataset):
            pass
    """))
    result = project.run("--dnnsafety-json=evidence.json")
    gate = _gates(project)["loss"]
    assert gate["status"] == "failed", gate  # an inverted digit is not a digit: a large loss
    assert "invert" in gate["details"]["per_family_loss"]
    assert result.ret != 0


BAD_MARKERS = [
    ("max_adversarial_confidence_loss(0.1, eps=0)", "argument eps*positive*"),
    ("max_adversarial_confidence_loss(0.1, eps=float('nan'))", "argument eps*NaN*"),
    ("max_adversarial_confidence_loss(0.1)", "argument eps*missing*"),
    ("max_adversarial_confidence_loss(0.1, eps=0.1, families=['fog'])", "argument families*unknown family 'fog'*"),
    ("max_adversarial_confidence_loss(0.1, eps=0.1, families=[])", "argument families*empty*"),
    ("min_robust_accuracy(0.5, eps=0.1, budgets={'rotation': -1})", "argument budgets*rotation*positive*"),
    ("min_robust_accuracy(0.5, eps=0.1, clip=(1, 0))", "argument clip*low < high*"),
    ("min_verified_robustness(0.5, eps=0.1, method='exact')", "argument method*'exact' is not one of*"),
    ("min_verified_robustness(1.5, eps=0.1)", "argument threshold*outside*"),
]


@pytest.mark.parametrize(("marker", "expected"), BAD_MARKERS, ids=[m for m, _ in BAD_MARKERS])
def test_bad_marker_arguments_are_collection_errors(gate_project: GateProject, marker: str, expected: str) -> None:
    gate_project.tests(f"import pytest\n\n@pytest.mark.{marker}\ndef test_x(model, dataset):\n    pass\n")
    result = gate_project.run()
    assert result.ret != 0
    result.stdout.fnmatch_lines([f"*@pytest.mark.{marker.split('(')[0]}: {expected}Fix: *"])


def test_budget_for_an_unlisted_family_is_an_error(gate_project: GateProject, files: Path) -> None:
    marker = 'min_robust_accuracy(0.5, eps=0.05, families=["fgsm"], budgets={"rotation": 10})'
    project = _project(gate_project, files, {"robust": marker})
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret != 0
    assert _gates(project)["robust"]["status"] == "error"
    result.stdout.fnmatch_lines(["*budgets= names ?'rotation'?, which are not in families=?'fgsm'?*"])


def test_an_unsupported_layer_fails_the_verified_gate_naming_it(gate_project: GateProject, files: Path) -> None:
    conftest = """
        import pytest
        from torch import nn
        import netdef


        @pytest.fixture(scope="session")
        def model():
            net = netdef.trained()
            net.classifier.append(nn.Softmax(dim=1))
            return net
    """
    project = _project(gate_project, files, {"verified": HEALTHY["verified"]}, textwrap.dedent(conftest))
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret != 0
    assert _gates(project)["verified"]["status"] == "error"
    result.stdout.fnmatch_lines(["*classifier.3*Softmax*"])


def test_the_marker_knows_every_built_in_family_without_importing_torch() -> None:
    from pytest_dnnsafety.engines.robustness import FAMILIES
    from pytest_dnnsafety.gates.robustness import FAMILY_NAMES

    assert sorted(FAMILY_NAMES) == sorted(FAMILIES)
