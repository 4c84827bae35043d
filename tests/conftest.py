"""Shared fixtures for pytest-dnnsafety's own tests.

The tests mirror the package (``tests/core``, ``tests/data``, ..., ``tests/engines``, ``tests/gates``,
``tests/plugin``, ``tests/families/<family>``, ``tests/acceptance``). The helper modules here (``_digits``,
``_gloo``, ...) and a few test modules whose cases other folders reuse are imported by their basename:
every test folder is put on ``sys.path`` below, so such an import does not depend on which module
pytest happened to collect first (basenames are unique; ``tests/core/test_import_graph.py`` checks it).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch  # noqa: F401  - imported once here: in-process pytester runs must not re-import torch

import pytest_dnnsafety.scenarios  # noqa: F401  - likewise kept across in-process runs
# The memory probe's dispatch mode imports torch's dispatch machinery (torch._dynamo, which registers operator
# libraries once per process) when its module is imported: imported here, before any in-process run, so that
# pytester's module snapshot keeps it instead of dropping it and re-registering those libraries.
import pytest_dnnsafety.engines.core.budget  # noqa: F401, E402
# The HTML report's plots import matplotlib lazily; a first import inside an in-process pytester run would be
# dropped by its module snapshot while classes of it stay referenced elsewhere (then Figure.add_subplot refuses
# a GridSpec of the other import): imported here once, as torch is.
try:
    import matplotlib.backends.backend_agg  # noqa: F401, E402
    import matplotlib.colors  # noqa: F401, E402
    import matplotlib.figure  # noqa: F401, E402
    import matplotlib.gridspec  # noqa: F401, E402
    import matplotlib.patches  # noqa: F401, E402
    import matplotlib.ticker  # noqa: F401, E402
except ImportError:  # the plots are an optional extra
    pass

#: The paper's Fig. 2 operating conditions (Cheng et al. 2018, §II-A).
FIG2_CONDITIONS = """\
[conditions]
weather = ["sunny", "cloudy", "rainy"]
road = ["stone", "mud", "tarmac"]
orientation = ["straight", "curvy"]
"""

#: Two rows: 6 of 21 two-way cells covered (Fig. 2).
FIG2_SCENARIOS = """\
weather,road,orientation
sunny,stone,straight
rainy,tarmac,curvy
"""

JUNIT_XSD = Path(__file__).parent / "report" / "junit.xsd"

for _folder in sorted({p.parent for p in Path(__file__).parent.rglob("*.py")} - {Path(__file__).parent}):
    if "__pycache__" not in _folder.parts and str(_folder) not in sys.path:
        sys.path.append(str(_folder))


class GateProject:
    """A throw-away user project inside pytester: ini options, data files, test modules."""

    def __init__(self, pytester: pytest.Pytester) -> None:
        self.pytester = pytester
        self.ini: dict[str, str] = {
            "dnnsafety_scenarios": "data/scenarios.csv",
            "dnnsafety_conditions": "data/conditions.toml",
            "dnnsafety_seed": "1234",
        }
        self.write("data/conditions.toml", FIG2_CONDITIONS)
        self.write("data/scenarios.csv", FIG2_SCENARIOS)

    def write(self, relpath: str, text: str) -> Path:
        path = self.pytester.path / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    def tests(self, source: str, name: str = "test_gates.py") -> Path:
        return self.write(name, source)

    def finish(self) -> None:
        lines = "\n".join(f'{key} = "{value}"' for key, value in self.ini.items())
        self.write("pyproject.toml", f"[tool.pytest.ini_options]\n{lines}\n")

    def run(self, *args: str, subprocess: bool = False) -> pytest.RunResult:
        self.finish()
        args = ("-p", "no:cacheprovider", "-p", "no:randomly", *args)
        if subprocess:
            return self.pytester.runpytest_subprocess(*args)
        return self.pytester.runpytest(*args)


@pytest.fixture
def gate_project(pytester: pytest.Pytester) -> GateProject:
    return GateProject(pytester)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The benchmarks' side-by-side ratios (``extra_info`` keys ``ratio_*``: reference time / plugin time, > 1 the
    plugin faster) in one table after pytest-benchmark's own, so CI's benchmark step prints them."""
    session = getattr(config, "_benchmarksession", None)
    rows = [(bench.name, key[len("ratio_"):], value) for bench in getattr(session, "benchmarks", None) or []
            for key, value in sorted(bench.extra_info.items())
            if key.startswith("ratio_") and isinstance(value, (int, float))]
    if not rows:
        return
    terminalreporter.section("side-by-side ratios (reference / plugin; > 1: the plugin is faster)")
    width = max(len(name) for name, _, _ in rows)
    for name, what, value in rows:
        terminalreporter.write_line(f"{name:<{width}}  {what:<40} {value:8.2f}")
