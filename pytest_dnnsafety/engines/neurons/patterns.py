"""The neuron activation-pattern metric M_neu-pattern (Cheng et al. 2018, §II-C, eq. (3)).

A neuron is *on* for an input iff its activation is strictly greater than ``activation_threshold``
(as in :mod:`.kactivation`); :class:`NeuronPatternEngine` groups inputs by how many neurons of the layer
they switch on and measures the share of inputs outside the dominant group and its neighbours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.neurons.checks import _check_activations, _check_threshold, _fmt_int
from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.errors import MetricError

__all__ = ["NeuronPatternEngine", "PatternResult", "scope"]


def scope(where: Mapping[str, Any] | None) -> str:
    """The inputs a gate measured, for its detail text: ``all inputs`` or the scenario, ``weather=rain, road=wet``."""
    return "all inputs" if where is None else ", ".join(f"{k}={v}" for k, v in where.items())


@dataclass(frozen=True)
class PatternResult:
    """Neuron activation-pattern metric of one layer (Cheng et al. 2018, §II-C, eq. (3)); lower is better.

    Groups are 0-based (``group_sizes[i]`` is the paper's ``|G_{i+1}|``); ``group_ranges[i]`` the
    inclusive range of active-neuron counts that falls into group i. ``dominant_group`` is j, the
    largest group (ties: the lowest index); ``deviating`` counts the inputs outside groups
    j-1, j, j+1, and ``value = deviating / n_inputs``.
    """

    value: float
    group_sizes: tuple[int, ...]
    group_ranges: tuple[tuple[int, int], ...]
    dominant_group: int
    deviating: int
    n_inputs: int
    n_neurons: int
    groups: int
    activation_threshold: float

    def detail(self) -> str:
        """``γ=10 over 256 neurons, 1,000 inputs; dominant group 3 (77–102 on): 412; 37 outside groups 2–4``."""
        j = self.dominant_group
        lo, hi = self.group_ranges[j]
        near = f"groups {max(0, j - 1)}–{min(self.groups - 1, j + 1)}" if self.groups > 1 else f"group {j}"
        text = (
            f"γ={self.groups} over {_fmt_int(self.n_neurons)} neurons, {_fmt_int(self.n_inputs)} "
            f"input{'s' if self.n_inputs != 1 else ''}; dominant group {j} ({lo}–{hi} on): "
            f"{_fmt_int(self.group_sizes[j])}; {_fmt_int(self.deviating)} outside {near}"
        )
        if self.activation_threshold != 0.0:
            text += f"; on > {self.activation_threshold:g}"
        return text

    def summary(self) -> str:
        """One line: ``0.037 (γ=10 over 256 neurons, …)``."""
        return f"{self.value:.3f} ({self.detail()})"

    def to_details(self) -> dict[str, object]:
        """JSON-able details (plain str/int/float/bool/list/dict only)."""
        return {
            "metric": "neuron_pattern",
            "value": float(self.value),
            "group_sizes": [int(v) for v in self.group_sizes],
            "group_ranges": [[int(lo), int(hi)] for lo, hi in self.group_ranges],
            "dominant_group": int(self.dominant_group),
            "deviating": int(self.deviating),
            "n_inputs": int(self.n_inputs),
            "n_neurons": int(self.n_neurons),
            "groups": int(self.groups),
            "activation_threshold": float(self.activation_threshold),
        }


class NeuronPatternEngine(Engine):
    """Neuron activation-pattern metric M_neu-pattern (Cheng et al. 2018, §II-C, eq. (3)).

    For each input of one scenario, count its active neurons ``a ∈ 0..c``. The γ groups have
    equal width c/γ; the paper's closed ranges ``[c/γ·(i-1), c/γ·i]`` overlap at the edges, so the
    boundary rule here is half-open with the top count folded into the last group::

        group(a) = min(γ - 1, ⌊a·γ / c⌋)        (0-based; exact integer arithmetic)

    i.e. group i holds the counts in ``[i·c/γ, (i+1)·c/γ)`` and group γ-1 also holds ``a = c``.
    With j the largest group (ties → the lowest index)::

        M_neu-pattern = Σ_{i ∉ {j-1, j, j+1}} |G_i| / |In|        (lower is better)

    Args:
        n_neurons: c, the layer's number of neurons (channels).
        groups: γ, with 1 ≤ γ ≤ c.
        activation_threshold: a neuron is on iff its activation is > this (default 0.0).
        device: where the state lives.

    State: ``histogram`` (int64, length c+1: inputs per active-neuron count, reduce ``sum``).
    """

    def __init__(
        self,
        n_neurons: int,
        groups: int = 10,
        activation_threshold: float = 0.0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(device)
        c = check_count(n_neurons, "n_neurons", 1, maximum=None, fix="pass the layer's number of neurons (channels)")
        gamma = check_count(groups, "groups", 1, maximum=c, fix=f"use between 1 and n_neurons={c} groups (the paper's γ)")
        self.n_neurons = c
        self.groups = gamma
        self.activation_threshold = _check_threshold(activation_threshold)
        self.add_state("histogram", torch.zeros(c + 1, dtype=torch.int64), reduce="sum")

    def config(self) -> dict[str, Any]:
        return {"n_neurons": self.n_neurons, "groups": self.groups, "activation_threshold": self.activation_threshold}

    @classmethod
    def from_config(cls, config: Mapping[str, Any], device: torch.device | str | None = None) -> NeuronPatternEngine:
        return cls(
            int(config["n_neurons"]),
            groups=int(config.get("groups", 10)),
            activation_threshold=float(config.get("activation_threshold", 0.0)),
            device=device,
        )

    @classmethod
    def of(cls, activations: Tensor, *, groups: int = 10, activation_threshold: float = 0.0, rows: Tensor | None = None,
           shard: Any = None) -> NeuronPatternEngine:
        """An engine sized for ``activations`` ``(N, c)``, on their device, with them folded in: one torchrun rank's
        rows of a layer (``shard``: its :class:`~pytest_dnnsafety.runtime.torchrun.Shard`, None for the whole data),
        ready to be merged with the other ranks' (the histogram is a ``sum``). ``rows``: a boolean mask over the
        whole data's rows (one scenario's inputs) — only the selected rows of this rank's are counted."""
        if rows is not None:
            if shard is not None:  # the mask's rows of this rank's data rows
                rows = rows[shard.row_slice]
            activations = activations[rows.to(activations.device)]
        engine = cls(activations.shape[1], groups=groups, activation_threshold=activation_threshold,
                     device=activations.device)
        engine.update(activations)
        return engine

    def group_of(self, counts: Tensor) -> Tensor:
        """Group index of each active-neuron count: ``min(γ-1, ⌊count·γ/c⌋)``."""
        return torch.clamp((counts.to(torch.int64) * self.groups) // self.n_neurons, max=self.groups - 1)

    def update(self, activations: Tensor, *, validate: bool = True) -> None:
        """Add a batch ``(N, c)`` to the histogram of active-neuron counts (see ``validate`` there)."""
        acts = _check_activations(activations, self.n_neurons, validate, "neuron activation pattern")
        if acts.shape[0] == 0:
            return
        acts = acts.to(self.device, non_blocking=self.device.type != "cpu")  # a D2H copy must block
        counts = (acts > self.activation_threshold).sum(1)
        self.histogram.index_add_(0, counts, torch.ones_like(counts))

    def compute(self, *, where: Mapping[str, Any] | None = None) -> PatternResult:
        """Group sizes, the dominant group and M_neu-pattern; :class:`MetricError` without inputs (naming ``where``,
        the scenario selection the inputs came from, when one was given)."""
        hist = self.histogram.cpu()
        n_inputs = int(hist.sum())
        if n_inputs == 0 and where is not None:
            raise MetricError(f"no inputs match where={where!r}; the metric needs at least one")
        if n_inputs == 0:
            raise MetricError(
                "neuron activation pattern metric is undefined: no inputs were measured (|In| = 0); "
                "pass at least one input of the scenario"
            )
        c, gamma = self.n_neurons, self.groups
        group_ids = self.group_of(torch.arange(c + 1))
        sizes = torch.zeros(gamma, dtype=torch.int64).index_add_(0, group_ids, hist).tolist()
        j = max(range(gamma), key=lambda i: (sizes[i], -i))  # largest; ties → lowest index
        near = sum(sizes[i] for i in (j - 1, j, j + 1) if 0 <= i < gamma)
        deviating = n_inputs - near
        ranges = []
        for g in range(gamma):
            members = torch.nonzero(group_ids == g).reshape(-1)
            ranges.append((int(members[0]), int(members[-1])) if members.numel() else (-1, -1))
        return PatternResult(
            value=deviating / n_inputs,
            group_sizes=tuple(int(v) for v in sizes),
            group_ranges=tuple(ranges),
            dominant_group=j,
            deviating=deviating,
            n_inputs=n_inputs,
            n_neurons=c,
            groups=gamma,
            activation_threshold=self.activation_threshold,
        )
