"""The runtime-monitor gates end to end, on real images and a conv model (scikit-learn's digits).

A user project with the digits CNN (trained on the first 1200 digits), the monitors fitted on 1000 of
those training digits and 300 held-out digits as in-distribution evaluation data. Known answers:
a dead frame is easy for the energy monitor (the gate passes); a monitor whose score is turned
upside down (it alarms on confident inputs) fails the same gate; a model with the classes 1 and 7
swapped fails the selective-risk gate; a monitor that spends many forward passes per input fails
the overhead gate. Bad configurations are errors naming the fix; ``-n 2`` equals serial; each
monitor is fitted once per session however many gates read it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from _digits import digits_images
from _digits_project import digits_project, gates_of, write_digits_files
from conftest import GateProject

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    write_digits_files(root)
    x, y = digits_images()
    np.savez(root / "data" / "fit.npz", x=x[:1000].numpy(), y=y[:1000].numpy())
    np.savez(root / "data" / "empty.npz", x=x[:0].numpy(), y=y[:0].numpy())
    np.savez(root / "data" / "novel_wrong_shape.npz", x=np.zeros((20, 1, 7, 7), np.float32))
    return root


def _project(gate_project: GateProject, files: Path, gates: dict[str, str], conftest: str = "",
             **ini: str) -> GateProject:
    ini.setdefault("monitor_data", "data/fit.npz")
    return digits_project(gate_project, files, gates, textwrap.dedent(conftest), **ini)


UPSIDE_DOWN = """
    import pytest
    import torch
    from pytest_dnnsafety import Energy


    class Confident:
        \"\"\"A broken monitor: it alarms on the inputs the model is most confident about.\"\"\"

        def fit(self, model, x, y):
            pass

        def score(self, model, x):
            return torch.softmax(model(x), dim=1).amax(dim=1)


    @pytest.fixture(scope="session")
    def monitors():
        return {"energy": Energy(), "confident": Confident()}
"""

SWAP_1_7 = """
    import pytest
    import torch
    import netdef


    @pytest.fixture(scope="session")
    def model():
        net = netdef.trained()
        with torch.no_grad():  # every 1 is read as 7 and back: confidently wrong
            last = net.classifier[2]
            last.weight[[1, 7]] = last.weight[[7, 1]].clone()
            last.bias[[1, 7]] = last.bias[[7, 1]].clone()
        return net
"""

SLOW_MONITOR = """
    import pytest
    import torch
    from pytest_dnnsafety import Energy


    class Repeating:
        \"\"\"A costly monitor: it runs the model 30 times per input (e.g. an unbatched ensemble).\"\"\"

        def fit(self, model, x, y):
            pass

        def score(self, model, x):
            with torch.no_grad():
                outs = [model(x) for _ in range(30)]
            return -torch.stack(outs).mean(0).amax(dim=1)


    @pytest.fixture(scope="session")
    def monitors():
        return {"energy": Energy(), "repeating": Repeating()}
"""

COUNTING = """
    import pytest
    from pytest_dnnsafety import Energy

    FITS = []


    class CountingEnergy(Energy):
        def _fit(self, view, generator=None):
            FITS.append(1)
            return super()._fit(view, generator)


    @pytest.fixture(scope="session")
    def monitors():
        return {"energy": CountingEnergy()}


    def pytest_sessionfinish(session):
        (session.config.rootpath / "fits.txt").write_text(str(len(FITS)))
"""


def test_dead_frames_pass_and_an_upside_down_monitor_fails(gate_project: GateProject, files: Path) -> None:
    gates = {"energy": 'min_monitor_detection(0.9, monitor="energy", faults="black_frame")',
             "confident": 'min_monitor_detection(0.9, monitor="confident", faults="black_frame")'}
    project = _project(gate_project, files, gates, UPSIDE_DOWN)
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret != 0
    got = gates_of(project)
    assert got["energy"]["status"] == "passed" and got["energy"]["value"] > 0.9, got["energy"]
    assert got["confident"]["status"] == "failed" and got["confident"]["value"] < 0.1, got["confident"]
    d = got["energy"]["details"]
    (row,) = d["faults"]
    assert row["family"] == "black_frame" and row["tp"] + row["fn"] == 300 and row["fp"] + row["tn"] == 300
    assert d["worst"] == {"family": "black_frame", "severity": None, "mcc": got["energy"]["value"]}
    # the calibrated threshold accepts about 95 % of in-distribution inputs (fit data held out, not the test data)
    assert d["id_alarms"] <= 45 and d["monitor_config"]["accept"] == 0.95
    result.stdout.fnmatch_lines(["*min_monitor_detection*confident: worst black_frame mcc *"])


def test_detection_table_covers_every_family_and_severity(gate_project: GateProject, files: Path) -> None:
    gates = {"all": 'min_monitor_detection(-1, monitor="msp", faults=["noise", "anomaly"], severity=(1, 5), '
                    'compare=["energy", "odin"])'}
    project = _project(gate_project, files, gates)
    assert project.run("--dnnsafety-json=evidence.json").ret == 0
    d = gates_of(project)["all"]["details"]
    sets = [(r["family"], r["severity"]) for r in d["faults"]]
    assert len(sets) == 8 * 2 + 1 and ("gaussian_noise", 1) in sets and ("shifted_rows", 5) in sets
    assert ("black_frame", None) in sets
    worst = min(d["faults"], key=lambda r: r["mcc"])
    assert gates_of(project)["all"]["value"] == worst["mcc"]
    assert d["worst"]["family"] == worst["family"] and d["worst"]["severity"] == worst["severity"]
    r = d["ranking"]
    assert r["monitors"] == ["msp", "energy", "odin"] and r["n_blocks"] == 17
    assert sum(r["average_ranks"]) == pytest.approx(6.0)  # 1 + 2 + 3
    assert 0 <= r["pvalue"] <= 1 and r["cd"] > 0
    assert d["fault_parameters"]["gaussian_noise"].keys() == {"1", "5"}


def test_selective_risk_passes_for_the_model_and_fails_for_a_swapped_one(gate_project: GateProject,
                                                                          files: Path) -> None:
    gates = {"risk": 'max_monitor_selective_risk(0.08, monitor="energy")'}
    healthy = _project(gate_project, files, gates)
    assert healthy.run("--dnnsafety-json=evidence.json").ret == 0
    good = gates_of(healthy)["risk"]
    s = good["details"]["system"]
    assert s["n"] == 300 and s["accepted"] + (300 - s["accepted"]) == 300
    assert good["value"] == s["accepted_errors"] / s["accepted"] and good["bound"] >= good["value"]
    assert good["value"] <= s["model_risk"] + 1e-12  # rejecting uncertain inputs removes errors, here at least
    gate_project.write("conftest.py", textwrap.dedent(SWAP_1_7))
    result = healthy.run("--dnnsafety-json=evidence.json")
    assert result.ret != 0
    bad = gates_of(healthy)["risk"]
    assert bad["status"] == "failed" and bad["value"] > 0.15, bad
    result.stdout.fnmatch_lines(["*max_monitor_selective_risk*errors among accepted inputs*model alone*"])


def test_novel_and_anomalies_count_every_decision_as_wrong(gate_project: GateProject, files: Path) -> None:
    conftest = """
        import pytest
        import torch
        from _digits_data import novel


        @pytest.fixture(scope="session")
        def ood_data():
            return novel()
    """
    gate_project.write("_digits_data.py", """
        import numpy as np
        import torch


        def novel():  # letter-like strokes: horizontal bars the digits never have
            x = torch.zeros(50, 1, 8, 8)
            x[:, :, 1::3, :] = 1.0
            return torch.utils.data.TensorDataset(x)
    """)
    gates = {"pooled": 'max_monitor_selective_risk(1.0, monitor="energy", faults=["novel", "black_frame"])'}
    project = _project(gate_project, files, gates, conftest)
    assert project.run("--dnnsafety-json=evidence.json").ret == 0
    d = gates_of(project)["pooled"]["details"]
    assert set(d["per_set"]) == {"in-distribution", "novel", "black_frame"}  # a dead frame has no severity
    assert d["per_set"]["novel"]["errors"] == 50 and d["per_set"]["black_frame"]["errors"] == 300
    assert d["system"]["n"] == 300 + 50 + 300


def test_a_costly_monitor_fails_the_overhead_gate(gate_project: GateProject, files: Path) -> None:
    gates = {"cheap": 'max_monitor_overhead(3.0, monitor="energy")',
             "costly": 'max_monitor_overhead(3.0, monitor="repeating")'}
    project = _project(gate_project, files, gates, SLOW_MONITOR)
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret != 0
    got = gates_of(project)
    assert got["cheap"]["status"] == "passed", got["cheap"]
    assert got["costly"]["status"] == "failed" and got["costly"]["value"] > 10, got["costly"]
    assert got["costly"]["details"]["model_s_per_input"] > 0 and got["costly"]["details"]["inputs"] == 300


def test_each_monitor_is_fitted_once_per_session(gate_project: GateProject, files: Path) -> None:
    gates = {"detect": 'min_monitor_detection(-1, monitor="energy", faults="black_frame")',
             "risk": 'max_monitor_selective_risk(1.0, monitor="energy")',
             "cost": 'max_monitor_overhead(100.0, monitor="energy")'}
    project = _project(gate_project, files, gates, COUNTING)
    assert project.run("--dnnsafety-json=evidence.json").ret == 0
    assert (project.pytester.path / "fits.txt").read_text() == "1"
    got = gates_of(project)
    assert len({g["details"]["monitor_threshold"] for g in got.values()}) == 1


def test_xdist_equals_serial(gate_project: GateProject, files: Path) -> None:
    gates = {"detect": 'min_monitor_detection(-1, monitor="msp", faults=["gaussian_noise", "fgsm"], severity=3)',
             "risk": 'max_monitor_selective_risk(1.0, monitor="odin", faults="rotation", severity=5)'}
    project = _project(gate_project, files, gates)
    assert project.run("--dnnsafety-json=evidence.json").ret == 0
    serial = {n: (g["value"], g["details"].get("faults"), g["details"].get("system")) for n, g in
              gates_of(project).items()}
    assert project.run("--dnnsafety-json=evidence.json", "-n", "2", subprocess=True).ret == 0
    parallel = {n: (g["value"], g["details"].get("faults"), g["details"].get("system")) for n, g in
                gates_of(project).items()}
    assert parallel == serial


@pytest.mark.parametrize(("case", "expected"), [
    ("no_novel", "*faults= includes 'novel', but no novel-class data is configured. Fix: set dnnsafety_ood_data*"),
    ("novel_shape", "*has inputs of shape (1, 7, 7), but 'dataset' has (1, 8, 8). Fix: *"),
    ("unknown_monitor", "*monitor='mahalanobis' is not in fixture 'monitors' (it has 'msp', 'odin', 'energy', 'detection_score'). "
                        "Fix: *"),
    ("empty_fit", "*Fix: *"),
    ("nan_scores", "*NaN*Fix: *"),
    ("no_fit_data", "*dnnsafety_monitor_data*"),
])
def test_bad_configurations_are_errors_naming_the_fix(gate_project: GateProject, files: Path, case: str,
                                                      expected: str) -> None:
    marker = {"no_novel": 'min_monitor_detection(0.5, monitor="energy", faults="novel")',
              "novel_shape": 'min_monitor_detection(0.5, monitor="energy", faults="novel")',
              "unknown_monitor": 'min_monitor_detection(0.5, monitor="mahalanobis", faults="black_frame")',
              "empty_fit": 'min_monitor_detection(0.5, monitor="energy", faults="black_frame")',
              "nan_scores": 'min_monitor_detection(0.5, monitor="nan", faults="black_frame")',
              "no_fit_data": 'min_monitor_detection(0.5, monitor="energy", faults="black_frame")'}[case]
    ini = {"novel_shape": {"ood_data": "data/novel_wrong_shape.npz"}, "empty_fit": {"monitor_data": "data/empty.npz"},
           }.get(case, {})
    conftest = ""
    if case == "nan_scores":
        conftest = """
            import pytest
            import torch


            class Broken:
                def fit(self, model, x, y):
                    pass

                def score(self, model, x):
                    return torch.full((x.shape[0],), float("nan"))


            @pytest.fixture(scope="session")
            def monitors():
                return {"nan": Broken()}
        """
    project = _project(gate_project, files, {"bad": marker}, conftest, **ini)
    if case == "no_fit_data":
        del project.ini["dnnsafety_monitor_data"]
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret != 0
    assert gates_of(project)["bad"]["status"] in ("error", "not-evaluated")
    result.stdout.fnmatch_lines([expected])


BAD_MARKERS = [
    ("min_monitor_detection(0.5)", "argument monitor*missing*"),
    ("min_monitor_detection(1.5, monitor='energy')", "argument threshold*outside*"),
    ("min_monitor_detection(0.5, monitor='energy', severity=6)", "argument severity*6 is not a severity in 1..5*"),
    ("min_monitor_detection(0.5, monitor='energy', severity=0)", "argument severity*not a severity in 1..5*"),
    ("min_monitor_detection(0.5, monitor='energy', faults='snow')", "argument faults*unknown fault(s) ?'snow'?*"),
    ("min_monitor_detection(0.5, monitor='energy', metric='fpr')", "argument metric*'fpr' is not one of*"),
    ("min_monitor_detection(0.5, monitor='energy', aggregate='max')", "argument aggregate*not one of*"),
    ("min_monitor_detection(0.5, monitor='energy', compare='msp')", "argument compare*expected*"),
    ("min_monitor_detection(0.5, monitor='energy', clip=(1, 0))", "argument clip*low < high*"),
    ("max_monitor_selective_risk(0.5, monitor='energy', confidence=1.5)", "argument confidence*outside*"),
    ("max_monitor_selective_risk(0.5, monitor='energy', gate_on='mean')", "argument gate_on*not one of*"),
    ("max_monitor_overhead(-1, monitor='energy')", "argument threshold*outside*"),
    ("max_monitor_overhead(1.0, monitor='energy', repeats=0)", "argument repeats*outside*"),
]


@pytest.mark.parametrize(("marker", "expected"), BAD_MARKERS, ids=[m for m, _ in BAD_MARKERS])
def test_bad_markers_are_collection_errors(gate_project: GateProject, marker: str, expected: str) -> None:
    gate_project.tests(f"import pytest\n\n@pytest.mark.{marker}\ndef test_x():\n    pass\n")
    result = gate_project.run()
    assert result.ret != 0
    result.stdout.fnmatch_lines([f"*@pytest.mark.{marker.split('(')[0]}: {expected}Fix: *"])


def test_fault_names_match_the_engine() -> None:
    from pytest_dnnsafety.engines.monitors.faults import FAULT_GROUPS
    from pytest_dnnsafety.gates.monitors import FAULT_GROUP_NAMES

    assert FAULT_GROUP_NAMES == FAULT_GROUPS


def test_fault_data_fixture_gives_the_gates_fault_sets(gate_project: GateProject, files: Path) -> None:
    """A plain test reads the same seeded fault set a gate evaluates (one object, shared through the session)."""
    project = _project(gate_project, files, {"noise": 'min_monitor_detection(-1, monitor="msp", '
                                                      'faults="gaussian_noise", severity=3)'})
    gate_project.tests(textwrap.dedent("""
        import pytest
        import torch


        @pytest.mark.min_monitor_detection(-1, monitor="msp", faults="gaussian_noise", severity=3)
        def test_noise(model, dataset):
            pass


        def test_plain(fault_data, dataset):
            noisy = fault_data("gaussian_noise", 3)
            x, y = dataset.tensors
            assert noisy.tensors[0].shape == x.shape and torch.equal(noisy.tensors[1], y)
            assert 0.02 < float((noisy.tensors[0] - x).abs().mean()) < 0.2
            assert fault_data("gaussian_noise", 3) is noisy
            assert float(noisy.tensors[0].min()) >= 0.0 and float(noisy.tensors[0].max()) <= 1.0
            with pytest.raises(pytest.fail.Exception, match="severity"):
                fault_data("gaussian_noise", 7)
    """))
    result = project.run("--dnnsafety-json=evidence.json")
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=2)
