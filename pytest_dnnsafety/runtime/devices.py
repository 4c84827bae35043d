"""The device a run measures on: ``dnnsafety_device`` (auto, cpu, cuda[:n], mps) checked against this machine."""

from __future__ import annotations

import torch

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.settings import Resolved

__all__ = ["resolve_device"]


def resolve_device(resolved: Resolved | str) -> torch.device:
    """Turn ``auto``/``cpu``/``cuda[:n]``/``mps`` into a usable :class:`torch.device`."""
    text = resolved.value if isinstance(resolved, Resolved) else str(resolved)
    source = resolved.source if isinstance(resolved, Resolved) else "argument"
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"dnnsafety_device={text!r} (from {source}): CUDA is not available on this machine "
                "(torch.cuda.is_available() is False). Fix: use dnnsafety_device=auto or cpu."
            )
        index = int(text.split(":", 1)[1]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"dnnsafety_device={text!r} (from {source}): only {torch.cuda.device_count()} CUDA "
                "device(s) present. Fix: pick an existing index or use auto."
            )
    if text == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ConfigError(
            f"dnnsafety_device='mps' (from {source}): MPS is not available. Fix: use auto or cpu."
        )
    return torch.device(text)
