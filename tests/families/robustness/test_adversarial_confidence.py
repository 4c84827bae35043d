"""Adversarial confidence loss M_adv (Cheng et al. 2018, §II-D, eq. 4): engine and runner."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.robustness.confidence import (
    AdversarialConfidenceEngine,
    AdversarialConfidenceResult,
    assess_adversarial_confidence,
)
from pytest_dnnsafety.engines.robustness.perturbations import make_family
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError


class FirstFeatureIsP0(nn.Module):
    """A two-class 'model' returning probabilities: p(class 0) = x[:, 0], p(class 1) = 1 − x[:, 0]."""

    def forward(self, x):
        return torch.stack([x[:, 0], 1 - x[:, 0]], dim=1)


def darken(model, x, y, eps, generator):
    return x - eps


def brighten(model, x, y, eps, generator):
    return x + eps


def hand_data():
    x = torch.tensor([[0.91, 0.5], [0.6, 0.5], [0.2, 0.5]], dtype=torch.float64)
    return x, torch.tensor([0, 0, 1])


def test_hand_computed_m_adv():
    """Every probability by hand (clip (0, 1) clamps the families' outputs).

    clean p_true          = 0.91, 0.60, 0.80 (all correct)
    darken   (ε = 0.22): x0 = 0.69, 0.38, 0.00 → p_true 0.69, 0.38, 1.00 → drops 0.22, 0.22, −0.20
    brighten (ε = 0.25): x0 = 1.00, 0.85, 0.45 → p_true 1.00, 0.85, 0.55 → drops −0.09, −0.25, 0.25
    worst drops 0.22 (darken), 0.22 (darken), 0.25 (brighten) → M_adv = −0.69/3 = −0.23.
    """
    result = assess_adversarial_confidence(
        FirstFeatureIsP0(), hand_data(), {"darken": darken, "brighten": brighten},
        {"darken": 0.22, "brighten": 0.25}, clip=(0.0, 1.0), batch_size=2)
    assert result.n == 3
    assert result.m_adv == pytest.approx(-0.23, abs=1e-12)
    assert result.loss == pytest.approx(0.23, abs=1e-12)
    assert result.per_family_loss == pytest.approx((0.08, -0.03), abs=1e-12)
    assert result.robust_accuracy == pytest.approx((2 / 3, 1.0))
    assert result.robust_accuracy_all == pytest.approx(2 / 3)
    assert result.clean_accuracy == 1.0
    assert result.argworst_counts == (2, 1)
    assert result.family_names == ("darken", "brighten") and result.eps == (0.22, 0.25)
    assert [w["index"] for w in result.worst_inputs] == [2, 0, 1] or [w["index"] for w in result.worst_inputs] == [
        2, 1, 0]
    first = result.worst_inputs[0]
    assert first["family"] == "brighten" and first["p_clean"] == pytest.approx(0.8)
    assert first["p_perturbed"] == pytest.approx(0.55) and first["drop"] == pytest.approx(0.25)
    assert result.worst_family == "darken"
    assert result.detail() == "loss 0.230 (worst darken on 67% of inputs); robust accuracy all 0.67; clean 1.00, n=3"
    details = json.loads(json.dumps(result.to_details()))
    assert details["families"][1] == {"name": "brighten", "eps": 0.25, "loss": pytest.approx(-0.03),
                                      "robust_accuracy": 1.0, "argworst_count": 1}
    assert details["robust_accuracy"] == {"darken": pytest.approx(2 / 3), "brighten": 1.0}
    assert details["argworst_counts"] == {"darken": 2, "brighten": 1}
    assert details["eps"] == {"darken": 0.22, "brighten": 0.25}
    assert details["per_family_loss"] == {"darken": pytest.approx(0.08), "brighten": pytest.approx(-0.03)}


def test_paper_car_example_through_the_engine():
    """Fig. 3a: FGSM moves p(car) from 0.91 to 0.69, the worst of three transformers: −0.22."""
    engine = AdversarialConfidenceEngine(3)
    engine.update(torch.tensor([0.91]), torch.tensor([[0.69], [0.85], [0.90]]),
                  torch.tensor([True]), torch.tensor([[True], [True], [True]]))
    result = engine.compute()
    assert result.m_adv == pytest.approx(-0.22, abs=1e-6)
    assert result.argworst_counts == (1, 0, 0)
    assert result.robust_accuracy_all == 1.0
    assert "family 0" in result.detail()


def _random_batches(seed: int, batches: int = 4, n: int = 7, f: int = 3):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(batches):
        yield (torch.rand(n, generator=gen), torch.rand(f, n, generator=gen),
               torch.rand(n, generator=gen) > 0.3, torch.rand(f, n, generator=gen) > 0.5)


def test_merge_equals_one_engine_on_all_data():
    whole, a, b = AdversarialConfidenceEngine(3), AdversarialConfidenceEngine(3), AdversarialConfidenceEngine(3)
    for i, batch in enumerate(_random_batches(0)):
        rows = torch.arange(7 * i, 7 * i + 7)  # the inputs' indices in the data: the worst inputs' rows
        whole.update(*batch, rows=rows)
        (a if i % 2 else b).update(*batch, rows=rows)
    a.merge(b)
    for name, state in whole.states().items():
        if name != "drops":  # per-input rows, in the order merged (compute sums them in index order)
            torch.testing.assert_close(getattr(a, name), state, rtol=1e-12, atol=1e-12)
    assert a.compute() == whole.compute()  # bit for bit
    with pytest.raises(ValueError, match="n_families"):
        a.merge(AdversarialConfidenceEngine(2))


def test_state_payload_round_trip():
    engine = AdversarialConfidenceEngine(3)
    for batch in _random_batches(1):
        engine.update(*batch)
    payload = json.loads(json.dumps(engine.state_payload()))
    back = Engine.from_payload(payload)
    assert isinstance(back, AdversarialConfidenceEngine) and back.n_families == 3
    assert back.compute() == engine.compute()
    back.reset()
    with pytest.raises(MetricError, match="no inputs"):
        back.compute()


def test_update_checks_shapes():
    engine = AdversarialConfidenceEngine(2)
    with pytest.raises(ValueError, match=r"\(2, N\)"):
        engine.update(torch.rand(4), torch.rand(3, 4), torch.ones(4, dtype=torch.bool), torch.ones(3, 4, dtype=bool))
    with pytest.raises(ValueError, match="at least one"):
        AdversarialConfidenceEngine(0)


def test_result_is_frozen_and_json_able():
    result = AdversarialConfidenceResult(n=1, m_adv=float("nan"), loss=float("nan"), per_family_loss=(0.1,),
                                         robust_accuracy=(1.0,), robust_accuracy_all=1.0, clean_accuracy=1.0,
                                         argworst_counts=(1,))
    assert json.loads(json.dumps(result.to_details()))["loss"] == "nan"
    with pytest.raises(AttributeError):
        result.n = 2  # type: ignore[misc]


# ----------------------------------------------------------------------------- runner errors


def test_user_family_changing_shape_returning_nan_or_raising_is_named():
    model, data = FirstFeatureIsP0(), hand_data()

    def shrink(model, x, y, eps, generator):
        return x[:, :1]

    def nan_family(model, x, y, eps, generator):
        return x * float("nan")

    def broken(model, x, y, eps, generator):
        raise ZeroDivisionError("oops")

    with pytest.raises(MetricError, match=r"'shrink'.*\(3, 1\).*\(3, 2\)"):
        assess_adversarial_confidence(model, data, {"darken": darken, "shrink": shrink}, 0.1)
    with pytest.raises(MetricError, match="'nan_family'.*NaN"):
        assess_adversarial_confidence(model, data, {"nan_family": nan_family}, 0.1)
    with pytest.raises(MetricError, match="'broken'.*ZeroDivisionError: oops"):
        assess_adversarial_confidence(model, data, {"broken": broken}, 0.1)
    with pytest.raises(MetricError, match="'list'.*not a tensor"):
        assess_adversarial_confidence(model, data, {"list": lambda m, x, y, e, g: [x]}, 0.1)


@pytest.mark.parametrize("eps", [0.0, -0.1, float("nan"), float("inf"), "big", {"darken": 0.1}, {"darken": 0.1,
                                 "brighten": 0.1, "blur": 1.0}])
def test_bad_eps_is_a_config_error(eps):
    with pytest.raises(ConfigError, match="eps"):
        assess_adversarial_confidence(FirstFeatureIsP0(), hand_data(), {"darken": darken, "brighten": brighten}, eps)


def test_unlabelled_data_empty_data_and_no_families():
    x, _ = hand_data()
    with pytest.raises(DataError, match="no labels"):
        assess_adversarial_confidence(FirstFeatureIsP0(), x, {"darken": darken}, 0.1)
    with pytest.raises(DataError, match="empty"):
        assess_adversarial_confidence(FirstFeatureIsP0(), (x[:0], torch.zeros(0, dtype=torch.int64)),
                                      {"darken": darken}, 0.1)
    with pytest.raises(ConfigError, match="no perturbation families"):
        assess_adversarial_confidence(FirstFeatureIsP0(), hand_data(), {}, 0.1)


def test_data_outside_clip_and_bad_labels():
    x, y = hand_data()
    with pytest.raises(DataError, match=r"\[0.2, 1.5\].*clip=\(0, 1\).*Fix"):
        assess_adversarial_confidence(FirstFeatureIsP0(), (x * 0 + torch.tensor([0.2, 1.5]), y), {"darken": darken},
                                      0.1, clip=(0, 1))
    with pytest.raises(DataError, match="labels range over"):
        assess_adversarial_confidence(FirstFeatureIsP0(), (x, torch.tensor([0, 1, 5])), {"darken": darken}, 0.1)


def test_model_nan_on_perturbed_inputs_names_the_family():
    class NaNAboveOne(nn.Module):
        def forward(self, x):
            p = x[:, 0]
            p = torch.where(p > 0.95, torch.full_like(p, float("nan")), p)
            return torch.stack([p, 1 - p], dim=1)

    with pytest.raises(MetricError, match="'brighten'.*NaN/inf"):
        assess_adversarial_confidence(NaNAboveOne(), hand_data(), {"darken": darken, "brighten": brighten}, 0.1)


# ----------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits_setup():
    x, y = digits_images(300)
    return digits_cnn(), x, y


def test_digits_cnn_under_fgsm_pgd_brightness(digits_setup):
    model, x, y = digits_setup
    families = {name: make_family(name, clip=(0, 1)) for name in ("fgsm", "pgd", "brightness")}
    result = assess_adversarial_confidence(model, (x, y), families, 0.1, clip=(0, 1), batch_size=128, seed=7)
    assert result.n == 300
    assert result.loss > 0 and result.m_adv == -result.loss
    assert result.clean_accuracy > 0.9
    assert result.robust_accuracy_all < result.clean_accuracy
    assert all(acc < result.clean_accuracy for acc in result.robust_accuracy[:2])
    assert result.per_family_loss[1] >= result.per_family_loss[2]  # pgd hurts more than a brightness shift
    assert sum(result.argworst_counts) == 300
    assert len(result.worst_inputs) == 5
    drops = [w["drop"] for w in result.worst_inputs]
    assert drops == sorted(drops, reverse=True) and drops[0] <= 1.0
    assert result.loss >= max(result.per_family_loss) - 1e-12  # the worst family per input
    again = assess_adversarial_confidence(model, (x, y), families, 0.1, clip=(0, 1), batch_size=128, seed=7)
    assert again == result
    assert not model.training


def test_seed_changes_random_families(digits_setup):
    model, x, y = digits_setup
    x, y = x[:64], y[:64]
    fams = {"gaussian_noise": make_family("gaussian_noise", clip=(0, 1))}
    a = assess_adversarial_confidence(model, (x, y), fams, 0.3, clip=(0, 1), seed=1)
    b = assess_adversarial_confidence(model, (x, y), fams, 0.3, clip=(0, 1), seed=1)
    c = assess_adversarial_confidence(model, (x, y), fams, 0.3, clip=(0, 1), seed=2)
    assert a == b and a.loss != c.loss


class Constant(nn.Module):
    """A plainly wrong model: always class 3 (the input enters with weight 0, so gradients exist and are 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.arange(10, dtype=torch.float32) * 0 + torch.eye(10)[3] * 5)

    def forward(self, x):
        return self.bias + 0 * x.flatten(1).sum(1, keepdim=True)


def test_plainly_wrong_model(digits_setup):
    _, x, y = digits_setup
    families = {name: make_family(name, clip=(0, 1)) for name in ("fgsm", "pgd", "brightness")}
    result = assess_adversarial_confidence(Constant(), (x, y), families, 0.1, clip=(0, 1))
    assert result.clean_accuracy == pytest.approx(0.1, abs=0.03)
    assert result.robust_accuracy == pytest.approx((result.clean_accuracy,) * 3)
    assert result.loss == pytest.approx(0.0, abs=1e-7)


def test_probability_model_detected(digits_setup):
    model, x, y = digits_setup
    x, y = x[:64], y[:64]
    fams = {"pgd": make_family("pgd", clip=(0, 1)), "contrast": make_family("contrast", clip=(0, 1))}
    logits = assess_adversarial_confidence(model, (x, y), fams, 0.1, clip=(0, 1))
    probs = assess_adversarial_confidence(nn.Sequential(model, nn.Softmax(dim=1)), (x, y), fams, 0.1, clip=(0, 1))
    assert probs.loss == pytest.approx(logits.loss, abs=1e-4)
    assert probs.robust_accuracy == pytest.approx(logits.robust_accuracy)


def test_non_differentiable_model_with_gradient_family(digits_setup):
    _, x, y = digits_setup

    class NoGrad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def forward(self, x):
            with torch.no_grad():
                return self.lin(x.flatten(1))

    with pytest.raises(MetricError, match="differentiable"):
        assess_adversarial_confidence(NoGrad(), (x[:16], y[:16]), {"fgsm": make_family("fgsm")}, 0.1)
    result = assess_adversarial_confidence(NoGrad(), (x[:16], y[:16]), {"blur": make_family("blur")}, 1.0)
    assert result.n == 16
