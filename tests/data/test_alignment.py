"""Issue #7, no false pass: scenario rows must line up with data rows, one for one and in order.

Row i of the scenario CSV describes sample i of the evaluation data. A CSV with rows that describe
no sample, a CSV short of rows, or data read in a random order must stop the gate with an error
naming both sides and the fix, never let it pass.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch  # noqa: F401  - kept across in-process pytester runs

from conftest import GateProject

FIG2 = {"weather": ["sunny", "cloudy", "rainy"], "road": ["stone", "mud", "tarmac"],
        "orientation": ["straight", "curvy"]}
ALL = [dict(zip(FIG2, combo)) for combo in itertools.product(*FIG2.values())]
#: The four rows that close the last two k=2 holes (cloudy × mud, sunny × tarmac).
CLOSING = [r for r in ALL if (r["weather"], r["road"]) in {("cloudy", "mud"), ("sunny", "tarmac")}]
#: 14 real rows: 19 of 21 pairs covered (0.905).
REAL = [r for r in ALL if r not in CLOSING]


def _csv(rows: list[dict]) -> str:
    return "weather,road,orientation\n" + "".join(f"{r['weather']},{r['road']},{r['orientation']}\n" for r in rows)


def _images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    return gen.random((n, 1, 8, 8), dtype=np.float32), gen.integers(0, 3, n)


def _with_data(project: GateProject, n: int) -> GateProject:
    x, y = _images(n)
    (project.pytester.path / "data").mkdir(exist_ok=True)
    np.savez(project.pytester.path / "data" / "eval.npz", x=x, y=y)
    project.ini["dnnsafety_data"] = "data/eval.npz"
    return project


COVERAGE_GATE = """
import pytest

@pytest.mark.min_scene_coverage(0.95, k=2)
def test_pairs_covered():
    pass
"""


def _error_of_the_only_gate(project: GateProject) -> str:
    result = project.run("--dnnsafety-json=e.json")
    assert result.parseoutcomes().get("passed", 0) == 0, result.stdout.str()
    gates = json.loads((project.pytester.path / "e.json").read_text())["gates"]
    assert len(gates) == 1 and gates[0]["status"] == "error" and not gates[0]["passed"]
    return gates[0]["details"]["error"]


def test_csv_with_rows_that_describe_no_sample_fails_the_coverage_gate(gate_project: GateProject) -> None:
    """14 samples, 18 CSV rows: the 4 extra rows would raise coverage from 0.905 to 1.000 and pass 0.95."""
    project = _with_data(gate_project, len(REAL))
    project.write("data/scenarios.csv", _csv(REAL + CLOSING))
    project.tests(COVERAGE_GATE)
    error = _error_of_the_only_gate(project)
    assert error.splitlines()[0].startswith(
        "the scenario table has 18 rows but the data has 14 samples (fixtures 'scenario_table' and 'dataset'): "
        "4 row(s) describe no sample; row i of the scenario table must describe sample i of the data. Fix: ")


def test_csv_shorter_than_the_data_fails_the_coverage_gate(gate_project: GateProject) -> None:
    project = _with_data(gate_project, 20)
    project.write("data/scenarios.csv", _csv(ALL))
    project.tests(COVERAGE_GATE.replace("0.95", "0.5"))
    error = _error_of_the_only_gate(project)
    assert error.startswith("the scenario table has 18 rows but the data has 20 samples")
    assert "2 sample(s) have no scenario row" in error


def test_matching_row_counts_measure_coverage_as_before(gate_project: GateProject) -> None:
    project = _with_data(gate_project, len(REAL))
    project.write("data/scenarios.csv", _csv(REAL))
    project.tests(COVERAGE_GATE.replace("0.95", "0.9"))
    result = project.run("--dnnsafety-json=e.json")
    result.assert_outcomes(passed=1)
    gate = json.loads((project.pytester.path / "e.json").read_text())["gates"][0]
    assert gate["value"] == pytest.approx(19 / 21)


def test_coverage_gate_without_configured_data_still_runs_on_the_table_alone(gate_project: GateProject) -> None:
    gate_project.tests(COVERAGE_GATE.replace("0.95", "0.2"))
    gate_project.run().assert_outcomes(passed=1)  # FIG2: 6/21, no data set anywhere


def test_dataset_fixture_in_conftest_is_checked_against_the_csv(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", """
        import pytest
        import torch

        @pytest.fixture(scope="session")
        def dataset():
            return torch.utils.data.TensorDataset(torch.rand(14, 1, 8, 8))
    """)
    gate_project.write("data/scenarios.csv", _csv(REAL + CLOSING))
    gate_project.tests(COVERAGE_GATE)
    assert _error_of_the_only_gate(gate_project).startswith(
        "the scenario table has 18 rows but the data has 14 samples")


def test_data_keyword_naming_a_loader_fixture_is_checked_against_the_csv(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", """
        import pytest
        import torch

        @pytest.fixture(scope="session")
        def eval_loader():
            ds = torch.utils.data.TensorDataset(torch.rand(14, 1, 8, 8), torch.zeros(14, dtype=torch.long))
            return torch.utils.data.DataLoader(ds, batch_size=4)
    """)
    gate_project.write("data/scenarios.csv", _csv(REAL + CLOSING))
    gate_project.tests(COVERAGE_GATE.replace("k=2)", "k=2, data='eval_loader')"))
    assert _error_of_the_only_gate(gate_project).startswith(
        "the scenario table has 18 rows but the data has 14 samples (fixtures 'scenario_table' and 'eval_loader')")


def test_row_breaking_a_restriction_fails_the_coverage_gate_naming_row_and_line(gate_project: GateProject) -> None:
    gate_project.write("data/conditions.toml", """
        [conditions]
        weather = ["sunny", "cloudy", "rainy"]
        road = ["stone", "mud", "tarmac"]
        orientation = ["straight", "curvy"]

        [[restrictions]]
        weather = "sunny"
        road = "mud"
    """)
    gate_project.write("data/scenarios.csv", _csv([ALL[0], ALL[2], ALL[0], ALL[3]]))  # rows 1 and 3: sunny × mud
    gate_project.tests(COVERAGE_GATE.replace("0.95", "0.1"))
    error = _error_of_the_only_gate(gate_project)
    assert error.splitlines()[0].startswith(
        "2 scenario row(s) break a declared restriction: row 1 (CSV line 3): weather=sunny × road=mud "
        "(restriction #1); row 3 (CSV line 5): weather=sunny × road=mud (restriction #1).")


# ---------------------------------------------------------------------- data read in a random order
CONV_CONFTEST = """
import pytest
import torch
from torch import nn


class Conv8(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x):
        return self.classifier(self.features(x))


@pytest.fixture(scope="session")
def model():
    torch.manual_seed(0)
    return Conv8()
"""

LOADERS = """
import torch


def images():  # unlabelled: the untrained net shows no accuracy above chance (issue #29: no signal, inconclusive)
    gen = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.rand(36, 1, 8, 8, generator=gen))


def shuffled():
    return torch.utils.data.DataLoader(images(), batch_size=8, shuffle=True)


def in_order():
    return torch.utils.data.DataLoader(images(), batch_size=8)
"""

WHERE_GATE = """
import pytest

@pytest.mark.max_neuron_pattern_deviation(1.0, layer="classifier.2", groups=3, where={"weather": "rainy"})
def test_rainy_patterns():
    pass
"""


def _where_project(project: GateProject) -> GateProject:
    project.write("conftest.py", CONV_CONFTEST)
    project.write("loaders.py", LOADERS)
    project.write("data/scenarios.csv", _csv(ALL * 2))  # 36 rows for 36 images
    project.tests(WHERE_GATE)
    return project


def test_data_factory_returning_a_shuffling_loader_fails_a_where_gate(gate_project: GateProject) -> None:
    """A threshold of 1.0 passes whatever the order: only the refusal keeps this gate from passing."""
    project = _where_project(gate_project)
    project.ini["dnnsafety_data"] = "loaders:shuffled"
    result = project.run()
    assert result.parseoutcomes().get("passed", 0) == 0
    result.stdout.fnmatch_lines(["*fixture 'dataset': *the DataLoader shuffles (RandomSampler): gates link data rows "
                                 "to scenario rows by position*Fix: use shuffle=False*"])


def test_dataset_fixture_returning_a_shuffling_loader_fails_a_where_gate(gate_project: GateProject) -> None:
    project = _where_project(gate_project)
    project.write("conftest.py", CONV_CONFTEST + """

from loaders import shuffled


@pytest.fixture(scope="session")
def dataset():
    return shuffled()
""")
    error = _error_of_the_only_gate(project)
    assert error.startswith("data: the DataLoader shuffles (RandomSampler): gates link data rows to scenario rows")


def test_data_factory_returning_an_ordered_loader_runs_the_where_gate(gate_project: GateProject) -> None:
    project = _where_project(gate_project)
    project.ini["dnnsafety_data"] = "loaders:in_order"
    project.run().assert_outcomes(passed=1)
