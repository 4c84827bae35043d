"""A model that answers the same input differently twice is an error, not a pass or a fail (issue #19 §6).

A model with dropout left on at inference gave 0.240 PASS, 0.233 PASS, 0.262 FAIL on
``max_adversarial_confidence_loss(0.25)`` with the same seed. Every guarded forward pass
(:class:`pytest_dnnsafety.engines.core.guard.ForwardGuard`, which every gate's engine goes through) now probes
each model once per device: two passes of a few inputs with torch's RNG running on between them; a
difference beyond float nondeterminism raises a :class:`MetricError` naming the fix (``model.eval()``,
no dropout or sampling at inference). The RNG state is restored, so seeded numbers do not change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _digits_project import digits_project, gates_of, write_digits_files
from conftest import GateProject
from pytest_dnnsafety.engines.core.capture import capture
from pytest_dnnsafety.errors import MetricError
from pytest_dnnsafety.engines.core.guard import PROBE_ROWS, ForwardGuard, check_deterministic, eval_mode


class DropoutOn(nn.Module):
    """Dropout applied with ``training=True`` in forward: stochastic even in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.head = nn.Linear(16, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head(F.dropout(torch.relu(self.body(x)), 0.3, training=True))


class Plain(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(16, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head(self.drop(torch.relu(self.body(x))))


def _x(n: int = 32) -> torch.Tensor:
    return torch.randn(n, 6, generator=torch.Generator().manual_seed(0))


def test_dropout_on_at_inference_is_an_error_naming_the_fix() -> None:
    torch.manual_seed(0)
    model = DropoutOn().eval()
    guard = ForwardGuard("adversarial confidence: model on clean inputs")
    with pytest.raises(MetricError) as info:
        guard(model, _x())
    message = str(info.value)
    assert message.startswith("adversarial confidence: model on clean inputs: the model is not deterministic")
    assert f"two forward passes of the same inputs gave different outputs ({PROBE_ROWS} input(s): a largest " \
           f"difference of" in message
    assert "DropoutOn with float32 weights on cpu" in message
    assert "Fix: call model.eval()" in message and "F.dropout(..., training=True)" in message
    # the verdict is remembered: another guard on the same model fails without probing again
    calls = model.calls
    with pytest.raises(MetricError, match="not deterministic"):
        ForwardGuard("another gate")(model, _x())
    assert model.calls == calls


def test_a_deterministic_model_is_probed_once_and_seeded_numbers_do_not_change() -> None:
    model = Plain(p=0.5)
    x = _x()
    with eval_mode(model):  # nn.Dropout is off in eval mode: deterministic
        torch.manual_seed(7)
        state = torch.get_rng_state()
        out = ForwardGuard("first gate")(model, x)
        assert torch.equal(torch.get_rng_state(), state)  # the probe restored the RNG
        assert model.calls == 3  # two probe passes of PROBE_ROWS inputs, then the batch
        again = ForwardGuard("second gate")(model, x)
        assert model.calls == 4  # probed once per model and device
    assert torch.equal(out, again)


def test_the_rng_state_is_restored_after_probing_a_stochastic_model() -> None:
    model, x = DropoutOn(), _x()
    torch.manual_seed(3)
    state = torch.get_rng_state()
    with pytest.raises(MetricError):
        check_deterministic(model, x, "probe")
    assert torch.equal(torch.get_rng_state(), state)


def test_train_mode_dropout_callables_and_labels_are_probed_too() -> None:
    # a module left in train mode where the caller does not switch it (e.g. the reliability sampler)
    with pytest.raises(MetricError, match="not deterministic"):
        ForwardGuard("max_pmi_ub: model on cell samples")(Plain(p=0.5).train(), _x())
    # a plain callable that samples
    weights = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x @ weights + 0.1 * torch.randn(x.shape[0], 3)

    with pytest.raises(MetricError, match=r"the model is not deterministic.*model: function"):
        ForwardGuard("callable")(noisy, _x())
    # a label-returning model that votes at random: compared exactly
    with pytest.raises(MetricError, match=r"labels differ"):
        ForwardGuard("labels", labels_ok=True)(lambda x: torch.randint(0, 3, (x.shape[0],)), _x(64))
    # deterministic callables and label models pass
    assert ForwardGuard("callable")(lambda x: x @ weights, _x()).shape == (32, 3)
    assert ForwardGuard("labels", labels_ok=True)(lambda x: (x[:, 0] > 0).long(), _x()).shape == (32,)


def test_float_noise_below_the_tolerance_is_not_flagged() -> None:
    """GPU kernels with atomics differ by a few ulps between runs: not a stochastic model."""
    flips = iter(range(10**6))

    def jitter(x: torch.Tensor) -> torch.Tensor:
        out = torch.stack([x.sum(1), -x.sum(1), x[:, 0] * 30.0], 1)
        return out * (1.0 + 1e-6 * (next(flips) % 2))  # ~8 ulps of float32, alternating between calls

    assert ForwardGuard("jitter")(jitter, _x()).shape == (32, 3)


def test_a_probe_the_model_refuses_is_left_to_the_guarded_pass() -> None:
    """A model that takes only its full batch (e.g. torch.export with a fixed batch) is probed on that batch."""

    def fixed(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 32:
            raise RuntimeError("expected batch 32")
        return torch.stack([x[:, 0], -x[:, 0]], 1)

    assert ForwardGuard("fixed")(fixed, _x()).shape == (32, 2)
    with pytest.raises(MetricError, match=r"the model raised RuntimeError on batch 0.*expected batch 32"):
        ForwardGuard("fixed")(fixed, _x(20))


def test_the_shared_forward_pass_ignores_the_probe_in_its_hooks() -> None:
    model = Plain().eval()
    acts = capture(model, (_x(40), torch.zeros(40, dtype=torch.long)), ["body"], batch_size=16)
    assert acts["body"].n_inputs == 40  # the probe passes recorded nothing
    with pytest.raises(MetricError, match="not deterministic"):
        capture(DropoutOn().eval(), (_x(40), None), ["body"], batch_size=16)


# ------------------------------------------------------------------ end to end: the case

DROPOUT_CONFTEST = """
import pytest
import torch.nn.functional as F
import netdef


class DropoutOn(netdef.DigitsCNN):
    def forward(self, x):
        return self.classifier(F.dropout(self.flatten(self.features(x)), 0.2, training=True))


@pytest.fixture(scope="session")
def model():
    net = DropoutOn()
    net.load_state_dict(netdef.trained().state_dict())
    return net.eval()
"""

GATES = {
    "loss": 'max_adversarial_confidence_loss(0.25, eps=0.05, families=["fgsm", "brightness"], clip=(0, 1))',
    "confusion": 'max_weighted_confusion(0.5, severity={"1": {"7": 10.0}})',
    "neurons": 'min_neuron_k_activation(0.0, layer="classifier.0", k=2)',
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    write_digits_files(root)
    return root


def test_gates_on_a_model_with_dropout_on_are_errors(gate_project: GateProject, files: Path) -> None:
    project = digits_project(gate_project, files, GATES, DROPOUT_CONFTEST)
    result = project.run("--dnnsafety-json=evidence.json")
    result.assert_outcomes(failed=3)
    gates = gates_of(project)
    for name, gate in gates.items():
        assert gate["status"] == "error", (name, gate["summary"])
        assert "the model is not deterministic" in gate["summary"] and "Fix: call model.eval()" in gate["summary"]
    assert "DropoutOn with float32 weights on cpu" in gates["loss"]["summary"]


@pytest.mark.slow
def test_the_same_gates_on_the_deterministic_model_are_verdicts(gate_project: GateProject, files: Path) -> None:
    project = digits_project(gate_project, files, GATES)
    project.run("--dnnsafety-json=evidence.json")
    gates = gates_of(project)
    assert {gate["status"] for gate in gates.values()} <= {"passed", "failed"}, \
        {name: gate["summary"] for name, gate in gates.items()}
