"""Conformance of every built-in gate marker (issue #20, item 6).

* Bad marker arguments, generated from each gate's ``Param`` definitions (``tests/_gate_cases.py``):
  a wrong type for every Param, values outside every Param check, and bad thresholds, settings,
  regression limits and fixture roles. ``parse_marker`` must raise a ``MarkerError`` naming the
  marker and the argument, never another exception. One pytester run with a bad marker per gate
  must end as a collection error (never an INTERNALERROR).
* Known answers: a plainly wrong model (labels shifted by one, a constant model, a model that reads
  one corner pixel, ...) fails one gate of every built-in family, in one pytester run.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _digits import DigitsCNN, digits_images
from _digits_project import NETDEF, digits_project, gates_of
from _gate_cases import GATES, bad_arguments, cases_by_param, checked_params, marker_source, out_of_range, wrong_types

from conftest import GateProject
from pytest_dnnsafety.errors import MarkerError
from pytest_dnnsafety.gates import BUILTIN_FAMILIES, parse_marker

GROUPS = cases_by_param()


def test_every_builtin_gate_and_param_gets_bad_arguments() -> None:
    params = sum(len(gate.params) for gate in GATES.values())
    cases = sum(len(group) for group in GROUPS.values())
    print(f"{len(GATES)} gates, {params} params, {cases} bad arguments")
    assert len(GATES) >= 19
    for gate in GATES.values():
        for param in gate.params:
            assert wrong_types(param), f"{gate.marker}.{param.name}: no value of a wrong type"
            assert f"{gate.marker}.{param.name}" in GROUPS


@pytest.mark.parametrize(("marker", "param"), [(g.marker, p.name) for g, p in checked_params()],
                         ids=[f"{g.marker}.{p.name}" for g, p in checked_params()])
def test_every_checked_param_gets_an_out_of_range_value(marker: str, param: str) -> None:
    (definition,) = [p for p in GATES[marker].params if p.name == param]
    assert out_of_range(definition), (f"{marker}.{param}: no probe in tests/_gate_cases.PROBES is refused by its "
                                      "check; add one that is")


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_bad_argument_is_a_marker_error_naming_marker_and_argument(group: str) -> None:
    problems = []
    for marker, argument, args, kwargs in GROUPS[group]:
        shown = f"{marker}(*{args!r}, **{kwargs!r})"
        try:
            spec = parse_marker(marker, args, kwargs, "test_x.py::test_bad", GATES)
        except MarkerError as exc:
            text = str(exc)
            if not text.startswith(f"test_x.py::test_bad: @pytest.mark.{marker}: argument {argument}: ") \
                    or "Fix: " not in text:
                problems.append(f"{shown}: message does not name the marker, argument and fix: {text}")
        except Exception as exc:  # noqa: BLE001 - any other exception is the bug this test looks for
            problems.append(f"{shown}: {type(exc).__name__} instead of MarkerError: {exc}")
        else:
            problems.append(f"{shown}: accepted as {spec.options if argument != 'threshold' else spec.threshold}")
    assert not problems, "\n".join(problems)


def _render(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    return repr(value)


def test_bad_markers_in_a_test_file_are_collection_errors_not_internal_errors(gate_project: GateProject) -> None:
    """One test per gate with its first bad Param value (type or range, alternating): one run."""
    chosen = []
    for i, gate in enumerate(GATES.values()):
        cases = [c for c in bad_arguments(gate) if c[1] in {p.name for p in gate.params}]
        ranged = [c for c in cases if c[3][c[1]] in out_of_range(next(p for p in gate.params if p.name == c[1]))]
        chosen.append((ranged or cases)[0] if i % 2 else cases[0])
    chosen.append(next(c for c in bad_arguments(next(iter(GATES.values()))) if c[1] == "threshold"))
    lines = ["import pytest", ""]
    for i, case in enumerate(chosen):
        lines += [marker_source(case, _render), f"def test_bad_{i}():", "    pass", ""]
    gate_project.tests("\n".join(lines))
    result = gate_project.run()
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out, out[-3000:]
    assert result.ret in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.USAGE_ERROR), (result.ret, out[-3000:])
    for i, (marker, argument, _, _) in enumerate(chosen):
        assert f"test_bad_{i}: @pytest.mark.{marker}: argument {argument}: " in out, (i, marker, argument)


# ------------------------------------------------------------------------------------------- known answers

#: Rows of the digits evaluation data used for the known-answer run (three lighting groups of 40).
N = 120

WRONG_MODELS = """
    from pathlib import Path

    import numpy as np
    import pytest
    import torch
    from torch import nn
    import netdef
    from pytest_dnnsafety import Energy


    class Shifted(nn.Module):
        \"\"\"A fitted linear digits classifier with its logits rolled by one: it answers c + 1 where it saw c.\"\"\"

        def __init__(self):
            super().__init__()
            self.flatten = nn.Flatten()
            self.linear = nn.Linear(64, 10)
            self.linear.load_state_dict(torch.load(Path(__file__).parent / "models" / "linear.pt", weights_only=True))
            self.shift = nn.Linear(10, 10, bias=False)  # a permutation matrix: certified bounds cover it
            with torch.no_grad():
                self.shift.weight.copy_(torch.roll(torch.eye(10), 1, dims=0))

        def forward(self, x):
            return self.shift(self.linear(self.flatten(x)))


    class Scrambled(nn.Module):
        \"\"\"The digits CNN's hidden layers, but a decision that is a hash of the pixels.\"\"\"

        def __init__(self):
            super().__init__()
            self.net = netdef.trained()
            self.w = nn.Parameter(torch.randn(64, 10, generator=torch.Generator().manual_seed(0)))

        def forward(self, x):
            self.net(x)
            return 3 * torch.sin(1000 * x.flatten(1) @ self.w)


    class Constant(nn.Module):
        \"\"\"The same logits whatever the input (a head on zeroed features).\"\"\"

        def __init__(self):
            super().__init__()
            self.head = nn.Linear(64, 10)
            with torch.no_grad():
                self.head.weight.zero_()
                self.head.bias.copy_(torch.linspace(0, 5, 10))

        def forward(self, x):
            return self.head(0 * x.flatten(1))


    class Corner(nn.Module):
        \"\"\"A shortcut classifier: it reads only the top-left pixel (always background in digits).\"\"\"

        def forward(self, x):
            logits = torch.zeros(x.shape[0], 10)
            logits[:, 0] = 5 - 20 * x[:, 0, 0, 0]
            return logits


    class Flipped(nn.Module):
        \"\"\"On 2-d points labelled x0 > 0.5: it answers the opposite class.\"\"\"

        def forward(self, x):
            return torch.stack([x[:, 0] - 0.55, 0.55 - x[:, 0]], dim=1)


    @pytest.fixture(scope="session")
    def model():
        return Shifted().eval()


    @pytest.fixture(scope="session")
    def scrambled():
        return Scrambled().eval()


    @pytest.fixture(scope="session")
    def constant():
        return Constant().eval()


    @pytest.fixture(scope="session")
    def corner():
        return Corner()


    @pytest.fixture(scope="session")
    def flipped():
        return Flipped()


    @pytest.fixture(scope="session")
    def points():
        data = np.load(Path(__file__).parent / "data" / "points.npz")
        return torch.as_tensor(data["x"]), torch.as_tensor(data["y"])


    @pytest.fixture(scope="session")
    def few():
        data = np.load(Path(__file__).parent / "data" / "small.npz")
        return torch.as_tensor(data["x"][:12]), torch.as_tensor(data["y"][:12])


    @pytest.fixture(scope="session")
    def monitors():
        return {"energy": Energy()}


    class Misplaced(nn.Module):
        \"\"\"A detector whose one box per image is in the wrong corner: every detection a false positive.\"\"\"

        def forward(self, x):
            return [{"boxes": torch.tensor([[5.0, 5.0, 8.0, 8.0]]), "labels": torch.tensor([1]),
                     "scores": torch.tensor([0.9])} for _ in range(x.shape[0])]


    @pytest.fixture(scope="session")
    def misplaced():
        return Misplaced()


    @pytest.fixture(scope="session")
    def boxes():
        from pytest_dnnsafety.data.tasks import DetectionData

        x = torch.as_tensor(np.load(Path(__file__).parent / "data" / "small.npz")["x"][:40])
        return DetectionData.from_offsets(x, torch.tensor([[0.0, 0.0, 3.0, 3.0]]).repeat(40, 1),
                                          torch.ones(40, dtype=torch.int64), torch.arange(41))
"""

#: One gate of each built-in family, each given a plainly wrong model (or requirement it cannot meet).
WRONG = {
    "coverage": "min_scene_coverage(0.9)",  # 3 of the 9 lighting x weather pairs occur
    "neurons": 'min_neuron_k_activation(0.9, layer="head", model="constant")',  # one pattern per pair: 1/4
    "reliability": ('max_pmi_ub(0.2, eps=0.05, box=[[0, 0], [1, 1]], samples_per_cell=100, bootstrap=5, '
                    'accept_violated_assumptions=True, empty_cell_label="nearest", model="flipped", data="points")'),
    "robustness": 'min_robust_accuracy(0.5, eps=0.05, families=["fgsm"], clip=(0, 1))',
    "performance": 'min_scenario_accuracy(0.5, by=["lighting"], min_samples=10)',
    "confusion": 'max_weighted_confusion(0.5, severity={"1": {"7": 10.0}}, default=1.0, gate_on="value")',
    "interpretability": 'min_occlusion_sensitivity(0.05, size=2, fill=0.5, model="corner")',
    "monitors": 'max_monitor_selective_risk(0.2, monitor="energy")',
    "inspection": 'max_class_confusion(0.8, layer="net.classifier.0", unpredicted="exclude", model="scrambled")',
    "quantification": 'min_safe_radius(0.3, d=0.05, iterations=5, starts=1, data="few")',
    "detection": 'min_detection_map(0.5, model="misplaced", data="boxes", min_images=10, bootstrap=100)',
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits project's files without the CNN's training (seconds on a busy machine): its weights are a
    seeded initialisation (only its hidden layers are used), and the wrong models' base classifier is a
    ridge least-squares linear fit (about 94 % accurate on the held-out digits before its logits are shifted)."""
    root = tmp_path_factory.mktemp("digits_wrong")
    data, models = root / "data", root / "models"
    data.mkdir()
    models.mkdir()
    (root / "netdef.py").write_text(NETDEF)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        torch.save(DigitsCNN().state_dict(), models / "digits.pt")
    x, y = digits_images()
    train = torch.cat([x[:1200].flatten(1), torch.ones(1200, 1)], dim=1)
    train, target = train.double(), torch.nn.functional.one_hot(y[:1200], 10).double()
    solution = torch.linalg.solve(train.T @ train + 1e-3 * torch.eye(65, dtype=torch.float64), train.T @ target)
    linear = {"weight": solution[:64].T.float().contiguous(), "bias": solution[64].float().contiguous()}
    torch.save(linear, models / "linear.pt")
    x, y = x[1200:], y[1200:]
    accuracy = ((x[:N].flatten(1) @ linear["weight"].T + linear["bias"]).argmax(1) == y[:N]).double().mean()
    assert accuracy > 0.85, float(accuracy)
    np.savez(data / "small.npz", x=x[:N].numpy(), y=y[:N].numpy())
    np.savez(data / "masks.npz", masks=x[:N, 0].numpy() > 0.3)
    np.savez(data / "fit.npz", x=x[N:N + 150].numpy(), y=y[N:N + 150].numpy())
    lighting = ["day", "dusk", "night"]
    (data / "scenarios.csv").write_text("lighting,weather\n" + "".join(f"{lighting[i % 3]},sun\n" for i in range(N)))
    (data / "conditions.toml").write_text('[conditions]\nlighting = ["day", "dusk", "night"]\n'
                                          'weather = ["sun", "rain", "fog"]\n')
    gen = np.random.default_rng(0)
    np.savez(data / "operation.npz", x=gen.random((400, 2)).astype(np.float32))
    points = gen.random((300, 2)).astype(np.float32)
    np.savez(data / "points.npz", x=points, y=(points[:, 0] > 0.5).astype(np.int64))
    return root


@pytest.mark.slow
def test_plainly_wrong_models_fail_one_gate_of_every_family(gate_project: GateProject, files: Path) -> None:
    families = {name.rsplit(".", 1)[1] for name in BUILTIN_FAMILIES}
    assert set(WRONG) == families, "give every built-in family a known-answer case"
    for family, marker in WRONG.items():
        name = marker.split("(")[0]
        assert GATES[name] is not None and f"gates.{family}" in _family_of(name), (family, name)
    project = digits_project(gate_project, files, WRONG, textwrap.dedent(WRONG_MODELS), data="data/small.npz",
                             masks="data/masks.npz", monitor_data="data/fit.npz", scenarios="data/scenarios.csv",
                             conditions="data/conditions.toml", operational_data="data/operation.npz")
    result = project.run("--dnnsafety-json=evidence.json")
    out = result.stdout.str()
    assert "INTERNALERROR" not in out, out[-3000:]
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    gates = gates_of(project)
    statuses = {family: (gates[family]["status"], gates[family]["value"], gates[family]["summary"][:300])
                for family in WRONG}
    print(json.dumps(statuses, indent=1))
    # the relative gates' wrong models (always wrong, hashed decisions, one class) are not better than chance: no
    # signal, their shared precondition makes them inconclusive before they measure (issue #29 §2); never a pass
    relative = {"confusion", "interpretability", "monitors", "inspection"}
    want = {family: "inconclusive" if family in relative else "failed" for family in WRONG}
    assert {family: s[0] for family, s in statuses.items()} == want, statuses
    assert all("inconclusive: no signal: the model's accuracy" in statuses[family][2] for family in relative), statuses


def _family_of(marker: str) -> str:
    """The module that registers ``marker`` among the built-in families."""
    import importlib

    from pytest_dnnsafety.gates import GateRegistry

    for module in BUILTIN_FAMILIES:
        registry = GateRegistry()
        importlib.import_module(module).pytest_dnnsafety_register_gates(registry=registry)
        if marker in registry:
            return module
    return ""
