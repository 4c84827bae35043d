"""A gate marker on one ``pytest.param`` with a role keyword sets up that fixture for that parameter alone: the
parametrized items of one function share pytest's fixture-name list, so the plugin gives each marked item its own."""

from __future__ import annotations

from conftest import GateProject

CONFTEST = """
import pytest
import torch
from torch import nn


@pytest.fixture(scope="session")
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 3)).eval()


@pytest.fixture(scope="session")
def dataset():
    gen = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(16, 1, 6, 6, generator=gen))


@pytest.fixture(scope="session")
def unavailable_model():
    pytest.skip("this artifact is not here")
"""

TESTS = """
import pytest


@pytest.mark.parametrize("way", [
    pytest.param("eager", marks=pytest.mark.min_neuron_k_activation(0.0, layer="1", k=1)),
    pytest.param("other", marks=pytest.mark.min_neuron_k_activation(0.0, layer="1", k=1,
                                                                       model="unavailable_model")),
])
def test_way(way):
    pass
"""


def test_a_role_fixture_of_one_param_is_not_set_up_for_its_siblings(pytester) -> None:
    project = GateProject(pytester)
    project.write("conftest.py", CONFTEST)
    project.tests(TESTS)
    result = project.run("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *this artifact is not here*"])


OWN_MODEL = """
@pytest.mark.min_neuron_k_activation(0.0, layer="1", k=1)
def test_gate(model, dataset):
    pass
"""


def test_predictions_set_beside_a_project_model_fixture_warn(pytester) -> None:
    project = GateProject(pytester)
    project.write("conftest.py", CONFTEST)
    project.tests("import pytest\n" + OWN_MODEL)
    project.ini["dnnsafety_predictions"] = "recorded.npy"
    result = project.run()
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*dnnsafety_predictions='recorded.npy' is set, but the project's own `model` fixture*"])
