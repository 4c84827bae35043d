"""Certified robustness verdicts (verified / falsified / unknown) on the digits CNN and on models with known answers."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.runtime import progress
from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.bounds.model import UnsupportedLayerError
from pytest_dnnsafety.engines.robustness.verification import (
    FALSIFIED,
    UNKNOWN,
    VERIFIED,
    VerificationEngine,
    VerificationResult,
    verify_robustness,
)
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError

CLIP = (0.0, 1.0)


@pytest.fixture(scope="module")
def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    """200 digits the CNN was not trained on (it trains on the first 1,200)."""
    x, y = digits_images()
    return x[1200:1400], y[1200:1400]


@pytest.fixture(scope="module")
def results(held_out: tuple[torch.Tensor, torch.Tensor]) -> dict[float, VerificationResult]:
    model = digits_cnn()
    return {eps: verify_robustness(model, held_out, eps, clip=CLIP, batch_size=128) for eps in (0.01, 0.05)}


def test_digits_cnn_verdict_counts(results: dict[float, VerificationResult]) -> None:
    small, large = results[0.01], results[0.05]
    for result in (small, large):
        assert result.n == 200
        assert result.verified + result.falsified + result.unknown == result.n
        assert result.verified_share == pytest.approx(result.verified / 200)
        assert result.value == result.verified_share
        assert result.method == "auto" and result.clip == CLIP and result.attack_steps == 20
        assert sum(result.bounded_by.values()) == result.n and result.bounded_by["crown-ibp"] == 0  # small: full CROWN
    assert small.verified >= 120  # most correctly classified digits are provably robust at ε = 0.01
    assert large.verified < small.verified  # a larger ball is harder to certify …
    assert large.falsified >= small.falsified  # … and easier to attack
    assert small.margin_min <= small.margin_median
    print("digits CNN:", small.detail(), "|", large.detail())


def test_counterexamples_are_real(results: dict[float, VerificationResult],
                                  held_out: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = held_out
    model = digits_cnn()
    for eps, result in results.items():
        assert 0 < len(result.counterexamples) <= 5
        assert len(result.counterexample_inputs) == len(result.counterexamples)
        for example, point in zip(result.counterexamples, result.counterexample_inputs):
            i = example["index"]
            assert example["label"] == int(y[i]) != example["predicted"]
            assert float((point - x[i]).abs().max()) == pytest.approx(example["linf_distance"])
            assert example["linf_distance"] <= eps + 1e-6
            assert float(point.min()) >= CLIP[0] and float(point.max()) <= CLIP[1]
            with torch.no_grad():
                assert int(model(point[None]).argmax()) == example["predicted"]
            assert example["source"] in ("clean", "pgd")
            if example["source"] == "clean":
                assert example["linf_distance"] == 0.0


def test_details_and_detail_line(results: dict[float, VerificationResult]) -> None:
    result = results[0.05]
    details = json.loads(json.dumps(result.to_details()))
    assert details["metric"] == "certified_robustness"
    assert details["verified"] == result.verified and details["unknown"] == result.unknown
    assert details["eps"] == 0.05 and details["method"] == "auto" and details["clip"] == [0.0, 1.0]
    assert details["bounded_by"] == result.bounded_by
    assert details["counterexamples"] == [dict(example) for example in result.counterexamples]
    assert set(details["counterexamples"][0]) == {"index", "label", "predicted", "linf_distance", "source"}
    assert re.fullmatch(r"verified \d+/200 \(0\.\d{3}\) at ε=0\.05 by auto \(crown \d+, crown-ibp 0\); falsified \d+; "
                        r"unknown \d+",
                        result.detail())


def test_ibp_verifies_no_more_than_crown(held_out: tuple[torch.Tensor, torch.Tensor],
                                         results: dict[float, VerificationResult]) -> None:
    x, y = held_out
    ibp = verify_robustness(digits_cnn(), (x, y), 0.01, method="ibp", clip=CLIP, attack_steps=0)
    assert ibp.method == "ibp" and ibp.attack_steps == 0
    assert ibp.verified <= results[0.01].verified
    assert ibp.falsified == int((digits_cnn()(x).argmax(1) != y).sum())  # no attack: only clean errors


def test_constant_model_has_exact_verdicts() -> None:
    """Logits that ignore the input and favour class 0: verified ⇔ label 0, every other input falsified."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.arange(10, 0, -1, dtype=torch.float32))
    x, y = digits_images(150)
    result = verify_robustness(model.eval(), (x, y), 0.1, clip=CLIP)
    assert result.verified == int((y == 0).sum())
    assert result.falsified == 150 - result.verified and result.unknown == 0
    assert result.verified_share < 0.15
    assert all(example["source"] == "clean" for example in result.counterexamples)


def test_reversed_last_layer_is_not_robust(held_out: tuple[torch.Tensor, torch.Tensor]) -> None:
    model = digits_cnn()
    with torch.no_grad():
        model.classifier[2].weight.neg_()
        model.classifier[2].bias.neg_()
    result = verify_robustness(model, held_out, 0.01, clip=CLIP)
    assert result.verified_share < 0.05
    assert result.falsified > 150


def test_verdicts_are_disjoint_and_reproducible(held_out: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = held_out[0][:64], held_out[1][:64]
    first = verify_robustness(digits_cnn(), (x, y), 0.03, clip=CLIP, batch_size=20, seed=3)
    again = verify_robustness(digits_cnn(), {"x": x, "y": y}, 0.03, clip=CLIP, batch_size=20, seed=3)
    assert (first.verified, first.falsified, first.unknown) == (again.verified, again.falsified, again.unknown)
    assert first.counterexamples[0]["index"] == again.counterexamples[0]["index"]
    weaker = verify_robustness(digits_cnn(), (x, y), 0.03, clip=CLIP, batch_size=20, attack_steps=0)
    assert weaker.verified == first.verified  # the attack never touches verified inputs
    assert weaker.falsified <= first.falsified


def test_float64_model(held_out: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = held_out[0][:32], held_out[1][:32]
    single = verify_robustness(digits_cnn(), (x, y), 0.02, clip=CLIP)
    double = verify_robustness(digits_cnn().double(), (x, y), 0.02, clip=CLIP)
    assert double.n == 32
    assert abs(double.verified - single.verified) <= 1


def test_progress_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks: list[tuple[int, int, str]] = []
    monkeypatch.setattr(progress, "tick", lambda done, total, unit="": ticks.append((done, total, unit)))
    x, y = digits_images(50)
    verify_robustness(digits_cnn(), (x, y), 0.01, clip=CLIP, batch_size=20)
    assert [t for t in ticks if t[2] == "inputs"] == [(20, 50, "inputs"), (40, 50, "inputs"), (50, 50, "inputs")]
    bound = [t for t in ticks if t[2] == "bound passes"]  # CROWN's own ticks inside each batch (issue #30)
    assert bound and all(0 <= done <= total for done, total, _ in bound)


# ----------------------------------------------------------------------------- the engine


def test_engine_merge_and_payload_round_trip() -> None:
    gen = torch.Generator().manual_seed(0)
    codes_a = torch.tensor([VERIFIED, FALSIFIED, UNKNOWN, VERIFIED, VERIFIED])
    codes_b = torch.tensor([UNKNOWN, UNKNOWN, FALSIFIED])
    margins_a = torch.randn(5, generator=gen) * 3
    margins_b = torch.randn(3, generator=gen) * 3
    a, b = VerificationEngine(0.02), VerificationEngine(0.02)
    a.update(codes_a, margins_a)
    b.update(codes_b, margins_b)
    merged = a.merge(b).compute()
    assert (merged.n, merged.verified, merged.falsified, merged.unknown) == (8, 3, 2, 3)
    assert merged.verified_share == pytest.approx(3 / 8)
    everything = torch.cat([margins_a, margins_b]).double()
    assert merged.margin_min == pytest.approx(float(everything.min()))
    assert merged.margin_median == pytest.approx(float(everything.median()), rel=0.03)
    payload = json.loads(json.dumps(a.state_payload()))
    rebuilt = Engine.from_payload(payload)
    assert isinstance(rebuilt, VerificationEngine) and rebuilt.config() == {"eps": 0.02, "method": "auto"}
    assert rebuilt.compute() == merged
    with pytest.raises(ValueError, match="different 'eps'"):
        VerificationEngine(0.02).merge(VerificationEngine(0.05))
    a.reset()
    with pytest.raises(MetricError, match="no inputs"):
        a.compute()


def test_engine_rejects_bad_codes() -> None:
    engine = VerificationEngine(0.1, "ibp")
    with pytest.raises(MetricError, match="1-D integer"):
        engine.update(torch.tensor([0.5, 1.0]))
    engine.update(torch.tensor([VERIFIED, 7]))
    with pytest.raises(MetricError, match="not 0/1/2"):
        engine.compute()


@pytest.mark.parametrize("eps", [0, -0.1, math.nan, math.inf, True, "0.1"])
def test_bad_eps(eps: object) -> None:
    x, y = digits_images(4)
    with pytest.raises(ConfigError, match="eps"):
        verify_robustness(digits_cnn(), (x, y), eps)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="eps"):
        VerificationEngine(eps)  # type: ignore[arg-type]


def test_bad_options_and_data() -> None:
    x, y = digits_images(8)
    model = digits_cnn()
    with pytest.raises(ConfigError, match="method"):
        verify_robustness(model, (x, y), 0.1, method="deeppoly")
    with pytest.raises(ConfigError, match="clip"):
        verify_robustness(model, (x, y), 0.1, clip=(1.0, 0.0))
    with pytest.raises(ConfigError, match="attack_steps"):
        verify_robustness(model, (x, y), 0.1, attack_steps=-1)
    with pytest.raises(DataError, match="labelled data"):
        verify_robustness(model, x, 0.1)
    with pytest.raises(DataError, match=r"outside \[0, 10\)"):
        verify_robustness(model, (x, y + 10), 0.1)
    with pytest.raises(DataError, match="outside the valid range"):
        verify_robustness(model, (x * 2, y), 0.1, clip=CLIP)
    with pytest.raises(UnsupportedLayerError, match=r"layer '1' \(Softmax\)"):
        verify_robustness(nn.Sequential(model, nn.Softmax(dim=1)).eval(), (x, y), 0.1)


def test_bounds_that_miss_the_models_own_outputs_are_an_error() -> None:
    """A forward hook on the whole model changes what it computes behind torch.fx's back: refuse, never verify."""
    model = digits_cnn()
    model.register_forward_hook(lambda module, args, out: out + torch.arange(10.0) * 5)
    x, y = digits_images(16)
    with pytest.raises(MetricError, match="do not contain the model's own margins"):
        verify_robustness(model, (x, y), 0.01, clip=CLIP)


def test_ibp_verifies_through_the_margin_specification(held_out: tuple[torch.Tensor, torch.Tensor]) -> None:
    """method="ibp" bounds z_y − z_j with the margin spec folded into the last layer, not as lb_y − ub_j."""
    from pytest_dnnsafety.engines.bounds.model import BoundedModel
    from pytest_dnnsafety.engines.bounds.box import input_box

    model = digits_cnn()
    result = verify_robustness(model, held_out, 0.01, method="ibp", clip=CLIP, batch_size=128)
    x, y = held_out
    x_lo, x_hi = input_box(x, 0.01, CLIP)
    lo, hi = BoundedModel(model).ibp(x_lo, x_hi)
    logits = (lo.gather(1, y[:, None]) - hi).scatter(1, y[:, None], math.inf)
    old = int((logits.min(1).values > 0).sum())  # what bounding the logits and subtracting verifies
    assert result.method == "ibp" and result.verified > 2 * old
    assert result.verified + result.falsified + result.unknown == 200
