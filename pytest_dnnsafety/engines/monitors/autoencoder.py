"""Input-based runtime monitor: the reconstruction error of an autoencoder the user trained (Ferreira et al., safety-monitor benchmark; docs: gates/monitors.md).

An autoencoder trained on ID inputs reconstructs them well and OOD inputs badly (Sakurada & Yairi 2014; as an
input monitor for DNNs e.g. Stocco et al., ICSE 2020, "Misbehaviour prediction for autonomous driving
systems": per-input reconstruction loss against a threshold fitted on the training set). The user
trains the autoencoder; the monitor only runs it. Pure torch; no pytest import.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.engines.core.guard import describe_model, eval_mode, model_dtype_device
from pytest_dnnsafety.engines.monitors.base import Monitor, MonitorView

__all__ = ["Autoencoder"]


class Autoencoder(Monitor):
    """Per-input mean squared reconstruction error: ``score(x) = mean over non-batch dims of (g(x) − x)²``.

    ``module`` is the user's trained autoencoder ``g`` (an ``nn.Module`` or any callable ``(N, ...) -> (N, ...)``);
    its output must have the input's shape (else :class:`MetricError` naming the module). It runs in eval mode
    under ``no_grad``, batch by batch through the view's runner (only the per-input errors are kept), on the module's own device (inputs are moved there); a module that
    raises becomes a :class:`MetricError` naming it and the batch. Nothing is learned at fit (the threshold is
    calibrated as for every monitor) and nothing merges; :meth:`state_bytes` counts the module's parameters and
    buffers, which is the memory the monitor adds in deployment.
    """

    kind = "autoencoder"

    def __init__(self, module: Any, **kw: Any) -> None:
        super().__init__(**kw)
        if not callable(module):
            raise ConfigError(f"Autoencoder(module=...) got a {type(module).__name__}, which is not callable. Fix: "
                              f"pass the trained autoencoder (an nn.Module mapping inputs (N, ...) to reconstructions "
                              f"of the same shape).")
        self.module = module

    def _describe(self) -> str:
        return f"autoencoder {describe_model(self.module)} of monitor {self.name!r}"

    def _config(self) -> dict[str, Any]:
        cls = type(self.module)
        return {"module": f"{cls.__module__}.{cls.__qualname__}"}

    def _fit(self, view: MonitorView, generator: torch.Generator) -> None:
        """Nothing to learn (the user trained the autoencoder)."""

    def _score(self, view: MonitorView) -> Tensor:
        _, device = model_dtype_device(self.module)
        runner = view.runner(f"monitor {self.name!r}")
        parts: list[Tensor] = []
        with eval_mode(self.module), torch.no_grad():
            for batch in view.each(runner):
                x = batch.x
                if device is not None:
                    x = x.to(device, non_blocking=device.type != "cpu")
                try:
                    rec = self.module(x)
                except Exception as exc:
                    raise MetricError(
                        f"the {self._describe()} raised {type(exc).__name__} on batch {batch.index} (inputs of shape "
                        f"{tuple(x.shape)}, {str(x.dtype).replace('torch.', '')}, on {x.device}): "
                        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}. Fix: give an autoencoder "
                        f"that takes the model's inputs as they are.") from exc
                if isinstance(rec, (tuple, list)) and rec and isinstance(rec[0], Tensor):
                    rec = rec[0]
                if not isinstance(rec, Tensor) or rec.shape != x.shape:
                    got = tuple(rec.shape) if isinstance(rec, Tensor) else type(rec).__name__
                    raise MetricError(
                        f"the {self._describe()} returned {got} for inputs of shape {tuple(x.shape)}; a reconstruction "
                        f"must have the input's shape. Fix: make the autoencoder's decoder output the input's shape "
                        f"(e.g. reshape to (N, {', '.join(str(s) for s in x.shape[1:])})).")
                err = (rec.to(torch.float32) - x.to(torch.float32)) ** 2
                parts.append(err.reshape(x.shape[0], -1).mean(dim=1))
        runner.check()
        return torch.cat(parts)

    def _state_tensors(self) -> Iterable[Tensor]:
        if isinstance(self.module, torch.nn.Module):
            return [*self.module.parameters(), *self.module.buffers()]
        return ()
