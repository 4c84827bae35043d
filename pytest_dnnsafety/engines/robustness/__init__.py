"""Robustness engines: perturbation families, adversarial confidence loss, certified bounds.

* :mod:`pytest_dnnsafety.engines.perturb.adversarial` — FGSM and PGD under L∞ and L2 (one forward and one backward per step and batch);
* :mod:`.perturbations` — the perturbation families (attacks and natural perturbations) and
  :func:`make_family`; a user family is any callable ``(model, x, y, eps, generator) -> x'``;
* :mod:`.confidence` — the adversarial confidence loss M_adv (Cheng et al. 2018, eq. 4);
* :mod:`pytest_dnnsafety.engines.bounds` (the library: :mod:`~pytest_dnnsafety.engines.bounds.ops`, :mod:`~pytest_dnnsafety.engines.bounds.crown`) — sound output bounds over an
  L∞ box by interval bound propagation and CROWN-style linear relaxation;
* :mod:`.verification` — verified / falsified / unknown per input;
* :mod:`.plan` — what the robustness gates run: the attack plan of a classifier or a detector
  (:class:`~.plan.AttackPlan`) and the verification plan.

Pure torch, no pytest import.
"""

from __future__ import annotations

from pytest_dnnsafety.engines.perturb.adversarial import detect_outputs, fgsm, input_gradient, log_probs, pgd
from pytest_dnnsafety.engines.bounds.model import BoundedModel, UnsupportedLayerError
from pytest_dnnsafety.engines.bounds.box import input_box
from pytest_dnnsafety.engines.robustness.confidence import AdversarialConfidenceEngine, AdversarialConfidenceResult, assess_adversarial_confidence
from pytest_dnnsafety.engines.robustness.perturbations import FAMILIES, Family, family_name, make_family
from pytest_dnnsafety.engines.robustness.verification import VerificationEngine, VerificationResult, verify_robustness

__all__ = [
    "fgsm", "pgd", "input_gradient", "log_probs", "detect_outputs",
    "Family", "FAMILIES", "make_family", "family_name",
    "AdversarialConfidenceEngine", "AdversarialConfidenceResult", "assess_adversarial_confidence",
    "BoundedModel", "UnsupportedLayerError", "input_box",
    "VerificationEngine", "VerificationResult", "verify_robustness",
]
