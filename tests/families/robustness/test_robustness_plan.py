"""The robustness gates' plans (issue #28): options resolved once, one variant per task, shared-run keys.

:class:`~pytest_dnnsafety.engines.robustness.plan.AttackPlan` holds what the gate module used to resolve
itself; these tests pin its messages, its keys (two gates naming the same model, data and perturbations
share one run) and the no-signal checks of each task variant, without running a model.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pytest_dnnsafety.engines.robustness.plan import (AttackPlan, ClassifierAttack, DetectorAttack, VerificationPlan,
                                                      at_chance, no_detection)
from pytest_dnnsafety.errors import ConfigError

OPTIONS: dict[str, Any] = {"eps": 0.1, "families": ("fgsm", "pgd"), "budgets": None, "clip": [0, 1],
                           "outputs": "auto", "steps": 10, "iou": 0.5}


def _plan(task: str = "single-label", **changes: Any) -> ClassifierAttack | DetectorAttack:
    return AttackPlan.for_task(task, "max_adversarial_confidence_loss", {**OPTIONS, **changes})


def test_the_task_picks_the_variant_and_each_family_gets_its_budget() -> None:
    assert isinstance(_plan(), ClassifierAttack) and isinstance(_plan("detection"), DetectorAttack)
    plan = _plan(eps=None, budgets={"fgsm": 0.1, "pgd": 2})
    assert plan.budget == {"fgsm": 0.1, "pgd": 2.0} and list(plan.named) == ["fgsm", "pgd"]
    assert plan.clip == (0.0, 1.0)
    assert plan.setup() == "per-family budgets; fgsm=0.1, pgd=2; clip=[0, 1]"
    assert _plan(budgets={"pgd": 0.3}).budget == {"fgsm": 0.1, "pgd": 0.3}


def test_equal_options_share_a_run_and_the_key_holds_what_changes_it() -> None:
    def family(model, x, y, eps, generator):  # a user family: its object keys the run, its name lists it
        return x

    assert _plan().key(0, 256, "cpu") == _plan().key(0, 256, "cpu")
    assert _plan().key(0, 256, "cpu") != _plan(outputs="logits").key(0, 256, "cpu")
    assert _plan().key(0, 256, "cpu") != _plan(steps=20).key(0, 256, "cpu")
    assert _plan("detection").key(0, 256, "cpu") != _plan("detection", iou=0.7).key(0, 256, "cpu")
    assert _plan().memo_name != _plan("detection").memo_name
    user = _plan(families=("fgsm", family))
    assert user.callables == (family,) and list(user.named) == ["fgsm", "family"]
    key = VerificationPlan(0.02, "crown", [0, 1], 20, None).key(0, 256, "cpu")
    assert key == VerificationPlan(0.02, "crown", (0, 1), 20, "2GiB").key(0, 256, "cpu")  # memory: same bounds


@pytest.mark.parametrize(("task", "changes", "message"), [
    ("single-label", {"families": ("fgsm", "fgsm")}, "family 'fgsm' is listed twice in families=. Fix: list it once"),
    ("single-label", {"budgets": {"rotation": 15}}, "budgets= names ['rotation'], which are not in families="),
    ("single-label", {"eps": None, "budgets": {"fgsm": 0.1}}, "no budget for ['pgd']: eps= is not set"),
    ("detection", {"outputs": "probabilities"}, "outputs='probabilities' is for classifiers"),
])
def test_bad_options_name_the_marker_and_the_fix(task: str, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _plan(task, **changes)
    assert str(info.value).startswith("max_adversarial_confidence_loss: ") and message in str(info.value)
    assert "Fix: " in str(info.value)


def test_the_loss_has_no_signal_at_chance_or_without_a_detection() -> None:
    result = SimpleNamespace(chance_accuracy=0.5, clean_accuracy=0.52, n=100)
    assert "is not above chance (0.500" in at_chance(result)
    assert at_chance(SimpleNamespace(chance_accuracy=0.1, clean_accuracy=0.9, n=100)) is None
    assert at_chance(SimpleNamespace(chance_accuracy=None, clean_accuracy=0.0, n=10)) is None
    assert "detects none of the 7 ground-truth objects" in no_detection(SimpleNamespace(clean_accuracy=0.0, n=7))
    assert no_detection(SimpleNamespace(clean_accuracy=0.2, n=7)) is None
    assert _plan().no_signal(result) == at_chance(result)
