"""Output-based runtime monitors: maximum softmax probability, ODIN and energy (Ferreira et al.; docs: gates/monitors.md).

All three read only the model's class scores. MSP and energy cost no forward pass of their own: they score
the logits the session's shared pass already holds (:meth:`MonitorView.logits`); ODIN perturbs every input
along the gradient of its own confidence, so it costs one forward + one backward (input gradient only) and
one more forward per batch.

The model may return logits or probabilities (told apart once at fit, as the attacks do,
:func:`~pytest_dnnsafety.engines.perturb.adversarial.detect_outputs`). For probabilities, ``log p`` stands in
for the logits: ``log p = z − logsumexp(z)`` differs from the logits ``z`` by a per-row constant, to which
softmax (hence MSP and ODIN, at any temperature) is invariant, so both give exactly the scores they would give
on the logits. Energy is not shift-invariant and needs real logits: probabilities are a :class:`MetricError`.
Pure torch; no pytest import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.engines.core.budget import chunk_size, spans
from pytest_dnnsafety.engines.core.guard import describe_model, eval_mode
from pytest_dnnsafety.data.checks import check_positive
from pytest_dnnsafety.engines.perturb.adversarial import detect_outputs
from pytest_dnnsafety.engines.monitors.base import Monitor, MonitorView

__all__ = ["MSP", "ODIN", "Energy"]

_TINY = 1e-12


def _as_logits(out: Tensor, outputs: str) -> Tensor:
    """Logits, or ``log p`` for probabilities (equal to the logits up to a per-row shift)."""
    return out if outputs == "logits" else torch.log(out.clamp_min(_TINY))


class _OutputMonitor(Monitor):
    """Common fit of the output monitors: the number of classes and whether the model returns probabilities."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.outputs: str | None = None
        self.num_classes: int | None = None

    def _fit(self, view: MonitorView, generator: torch.Generator) -> None:
        logits = view.logits()
        self.outputs = detect_outputs(logits)
        self.num_classes = int(logits.shape[1])

    def _logits(self, view: MonitorView) -> Tensor:
        logits = view.logits()
        if self.num_classes is not None and logits.shape[1] != self.num_classes:
            raise MetricError(f"monitor {self.name!r} was fitted on a model with {self.num_classes} classes; this "
                              f"model returns {logits.shape[1]}. Fix: score with the model the monitor was fitted on.")
        return _as_logits(logits, self.outputs or "logits")

    def _config(self) -> dict[str, Any]:
        return {"outputs": self.outputs} if self.outputs is not None else {}


class MSP(_OutputMonitor):
    """Maximum softmax probability (Hendrycks & Gimpel 2017, §2): ``score = −max_k softmax(f(x))_k``.

    A confident decision scores low; the baseline every OOD detector is compared against. Nothing to fit
    beyond telling logits from probabilities; nothing to merge. No forward pass of its own.
    """

    kind = "msp"

    def _score(self, view: MonitorView) -> Tensor:
        if (self.outputs or "logits") == "logits":
            self._logits(view)  # the class-count check
            # The shared pass already holds max softmax(logits) per input (its confidence, computed batch by batch
            # from the same float32 logits): reading it saves a second softmax over all the logits.
            return -view.outputs().confidence
        return -torch.softmax(self._logits(view).float(), dim=1).amax(dim=1)


class Energy(_OutputMonitor):
    """Energy score (Liu et al. 2020, eq. (3) and §3): ``score = E(x; f) = −T·logsumexp_k(f_k(x)/T)``.

    The free energy is lower for ID inputs (the paper's negative energy is the "ID score"); here it is used
    as it is, higher = more OOD. ``temperature`` T > 0 (the paper recommends T = 1). Computed in float32 with
    ``torch.logsumexp`` (no overflow for large logits). Needs logits (not probabilities). No pass of its own.
    """

    kind = "energy"

    def __init__(self, temperature: float = 1.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.temperature = check_positive(temperature, "temperature", fix="pass temperature > 0, e.g. 1.0.")

    def _fit(self, view: MonitorView, generator: torch.Generator) -> None:
        super()._fit(view, generator)
        if self.outputs == "probabilities":
            raise MetricError(
                f"monitor {self.name!r} (energy) needs the model's logits, but the model returns probabilities "
                f"(every row is in [0, 1] and sums to 1): −T·logsumexp of probabilities carries no energy. Fix: "
                f"return logits from the model (drop the final softmax), or use MSP/ODIN, which work on either.")

    def _score(self, view: MonitorView) -> Tensor:
        t = self.temperature
        logits = self._logits(view).float()
        if t == 1.0:  # f/1 and 1·e are exact: the same scores without two passes over the logits
            return -torch.logsumexp(logits, dim=1)
        return -t * torch.logsumexp(logits / t, dim=1)

    def _config(self) -> dict[str, Any]:
        return {"temperature": self.temperature, **super()._config()}


class ODIN(_OutputMonitor):
    """ODIN (Liang et al. 2018, §3, eqs. (1)–(2)): temperature scaling plus an input perturbation.

    With ``S(x; T) = softmax(f(x)/T)`` and ``ŷ`` its arg-max, the input is moved to increase its own
    confidence, ``x̃ = x − ε·sign(−∇ₓ log S_ŷ(x; T))`` (eq. (2)), and ``score = −max_k S_k(x̃; T)``.
    Defaults T = 1000, ε = 0.0014 (the paper's CIFAR-10 choice; tune them for your data on ID data only,
    or with a small OOD validation set as the paper did).

    Batched through the view's runner (:meth:`MonitorView.each`): per batch one forward + one backward (``torch.autograd.grad`` w.r.t. the input only; the model's
    parameters and their ``.grad`` are never touched) and one forward on ``x̃``, in eval mode. Differences
    from the authors' code, on purpose: a zero gradient component is not moved (``sign(0) = 0``; their code
    moved it by +ε), and the gradient is not divided by a per-channel normalisation std (the model here
    takes its inputs as given; fold any normalisation into the model). The perturbed input is not clipped
    to the data range, as in the paper.
    """

    kind = "odin"

    def __init__(self, temperature: float = 1000.0, epsilon: float = 0.0014, **kw: Any) -> None:
        super().__init__(**kw)
        self.temperature = check_positive(temperature, "temperature", fix="pass temperature > 0, e.g. 1000.")
        self.epsilon = check_positive(epsilon, "epsilon", allow_zero=True,
                                      fix="pass the perturbation size epsilon >= 0, e.g. 0.0014.")

    def _config(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "epsilon": self.epsilon, **super()._config()}

    def _score(self, view: MonitorView) -> Tensor:
        model, eps = view.model, self.epsilon
        outputs = self.outputs or "logits"
        if not isinstance(model, torch.nn.Module) and not callable(model):
            raise ConfigError(f"monitor {self.name!r}: the model is a {type(model).__name__}. Fix: give a "
                              f"torch.nn.Module.")
        if torch.is_inference_mode_enabled():
            raise self._not_differentiable(model, "it is called under torch.inference_mode()")
        runner = view.runner(f"ODIN monitor {self.name!r}")
        first = runner.guard(f"ODIN monitor {self.name!r}: model on the inputs", num_classes=self.num_classes)
        second = runner.guard(f"ODIN monitor {self.name!r}: model on the perturbed inputs",
                              num_classes=self.num_classes)
        parts: list[Tensor] = []
        size = 0
        with eval_mode(model):
            for whole in view.each(runner):
                if not size:  # the chunks that fit the working-memory budget with a backward pass
                    held = 3 * whole.x[0].numel() * whole.x.element_size()
                    size = chunk_size(model, whole.x, grad=eps > 0, extra=held)
                parts += [self._odin(model, whole.x[a:b].detach(), first, second, outputs)
                          for a, b in spans(whole.n, size)]
        runner.check()
        return torch.cat(parts)

    def _odin(self, model: Any, x: Tensor, first: Any, second: Any, outputs: str) -> Tensor:
        """ODIN's score of one chunk: a temperature-scaled input-gradient step, then the scaled softmax maximum."""
        t, eps = self.temperature, self.epsilon
        if eps > 0:
            xg = x.clone().requires_grad_(True)
            with torch.enable_grad():
                out = first(model, xg)
                if not out.requires_grad:
                    raise self._not_differentiable(
                        model, "its output does not require grad (it runs under torch.no_grad() or "
                               "without autograd)")
                confidence = torch.log_softmax(_as_logits(out, outputs) / t, dim=1).amax(dim=1)
                (grad,) = torch.autograd.grad(confidence.sum(), [xg], allow_unused=True)
            if grad is None:
                raise self._not_differentiable(model, "its output does not depend on the input through "
                                                      "autograd")
            x = x - eps * torch.sign(-grad)
        with torch.no_grad():
            out = second(model, x)
            return -torch.softmax(_as_logits(out.float(), outputs) / t, dim=1).amax(dim=1)

    def _not_differentiable(self, model: Any, why: str) -> MetricError:
        return MetricError(
            f"monitor {self.name!r} (ODIN) perturbs inputs along the input gradient and needs a differentiable "
            f"model, but {why} (model: {describe_model(model)}). Fix: give the eager nn.Module (not a TorchScript "
            f"or torch.export program run without autograd), do not wrap its forward in torch.no_grad(), or use "
            f"ODIN(epsilon=0) (temperature scaling only) or MSP/Energy.")
