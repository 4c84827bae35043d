"""Scenario groups: the rows (images) of the evaluation data grouped by the values of ``by=`` conditions.

The performance gates (``min_scenario_accuracy``, ``max_scenario_degradation``) and the detection gates
(``min_detection_map``, ``min_detection_recall``) both group the data by the values of one or more
conditions of the scenario table: every value combination of the conditions' *declared* domains is a
group, also one the data never reaches, numbered in mixed radix with the first condition most
significant; a group the declared restrictions rule out is *infeasible* (never required). The layout —
the mixed radix, the feasibility from the restrictions, each row's group — is
:class:`~pytest_dnnsafety.engines.performance.scenario.ScenarioPerformanceEngine`'s (one implementation,
as :class:`~pytest_dnnsafety.scenarios.table.ScenarioTable` counts its coverage with the coverage engine);
:class:`ScenarioGroups` takes it from a table once, checks the table against the data, and hands the
engines plain tensors and labels. Without ``by`` (the detection gates) all rows are one group, ``all``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.performance.scenario import (
    MAX_GROUPS,
    ScenarioPerformanceEngine,
    resolve_by,
)
from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.scenarios.table import (
    ScenarioTable,
    check_rows_match,
    count_samples,
)

__all__ = ["ScenarioGroups", "by_names", "check_group_count"]


def check_group_count(by: Sequence[str], domains: Sequence[Sequence[str]]) -> int:
    """The number of groups of ``by`` (the product of the domain sizes), or :class:`ConfigError` over
    :data:`~pytest_dnnsafety.engines.performance.scenario.MAX_GROUPS`, before anything per group is allocated.

    Every gate with ``by=`` (performance, detection, ...) groups through :meth:`ScenarioGroups.of`, which checks here.
    """
    sizes = [len(domain) for domain in domains]
    count = math.prod(sizes)
    if count <= MAX_GROUPS:
        return count
    shown = " × ".join(f"{name} {size}" for name, size in zip(by, sizes))
    keep = len(by)
    while keep > 1 and math.prod(sizes[:keep]) > MAX_GROUPS:
        keep -= 1
    fewer = (f"fewer by conditions (by={list(by)[:keep]} gives {math.prod(sizes[:keep]):,} groups), "
             if math.prod(sizes[:keep]) <= MAX_GROUPS else "")
    raise ConfigError(
        f"by={list(by)} gives {count:,} groups (the product of the domain sizes: {shown}), more than the cap of "
        f"{MAX_GROUPS:,} groups; refused before allocating them. Fix: {fewer}coarser domains (merge the values of "
        "the largest conditions in the conditions file)"
    )


def by_names(options: Mapping[str, Any]) -> list[str]:
    """A grouping gate's ``by=`` as a list of condition names: one name may be given as a string, and a gate
    whose ``by`` is optional (None) groups by nothing (``[]``)."""
    by = options["by"]
    return [] if by is None else [by] if isinstance(by, str) else list(by)


@dataclass(frozen=True)
class ScenarioGroups:
    """The groups of ``by`` and each row's group (see the module docstring).

    ``domains``: each ``by`` condition's declared values; ``strides``: the mixed-radix place values;
    ``feasible``: ``(n_groups,)`` bool, the groups the declared restrictions allow; ``index``: ``(rows,)``
    int64 on the CPU, each row's group. ``fixtures``: the gate's fixture names (roles ``scenarios`` and
    ``data``) that the errors name.
    """

    by: tuple[str, ...]
    domains: tuple[tuple[str, ...], ...]
    strides: tuple[int, ...]
    feasible: Tensor
    index: Tensor
    table: ScenarioTable | None = field(default=None, repr=False, compare=False)
    fixtures: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, table: ScenarioTable | None, by: Sequence[str], *, data: Any = None, n_rows: int | None = None,
           fixtures: Mapping[str, str]) -> ScenarioGroups:
        """The groups of ``table``'s conditions ``by``, its rows checked against the data's: ``n_rows`` or, given
        ``data``, its sample count (read after ``by`` is resolved, so an unknown condition is the error before
        any data is read). Without ``by``: one group of ``n_rows`` rows, and ``table`` is not read."""
        if not by:
            return cls.whole(int(n_rows or 0), fixtures=fixtures)
        columns, domains = cls.check(table, by)
        if n_rows is None:
            n_rows = count_samples(data)
        check_rows_match(table, n_rows, table_fixture=fixtures["scenarios"], data_fixture=fixtures["data"])
        # The engine's layout (domains, strides) with the feasibility of the by subset alone.
        layout = ScenarioPerformanceEngine(by, domains, feasible=table.conditions.subset_feasibility(columns))
        return cls(by=layout.by, domains=layout.domains, strides=layout.strides, feasible=layout.feasible,
                   index=layout.group_index(table).cpu(), table=table, fixtures=fixtures)

    @staticmethod
    def check(table: ScenarioTable | None, by: Sequence[str]) -> tuple[Any, list[Any]]:
        """``by``'s columns and domains in ``table``, checked without reading any data: an unknown condition and a
        group count over the cap are the gate's errors (call it before a forward pass whose rows :meth:`of` then
        groups)."""
        if table is None:
            raise ValueError(f"grouping by {list(by)} needs the scenario table")
        columns = resolve_by(table, by)  # an unknown condition is the gate's error, before any forward pass
        domains = [table.conditions.domains[name] for name in by]
        check_group_count(by, domains)  # before anything per group is allocated
        return columns, domains

    @classmethod
    def whole(cls, n_rows: int, *, fixtures: Mapping[str, str] | None = None) -> ScenarioGroups:
        """All ``n_rows`` rows as one feasible group, labelled ``all``."""
        return cls(by=(), domains=(), strides=(), feasible=torch.ones(1, dtype=torch.bool),
                   index=torch.zeros(n_rows, dtype=torch.int64), fixtures=fixtures or {})

    @property
    def n_groups(self) -> int:
        return int(self.feasible.numel())

    def key(self, group: int) -> dict[str, str]:
        """The condition values of group ``group`` (mixed radix, first condition most significant)."""
        return {name: domain[(group // stride) % len(domain)]
                for name, domain, stride in zip(self.by, self.domains, self.strides)}

    def label(self, group: int) -> str:
        """``lighting=night × noise=high`` (``all`` without ``by``)."""
        if not self.by:
            return "all"
        return " × ".join(f"{name}={value}" for name, value in self.key(group).items())

    def masks(self) -> Iterator[tuple[str, Tensor, bool]]:
        """``(label, row mask, feasible)`` of every group, in group order."""
        for group in range(self.n_groups):
            yield self.label(group), self.index == group, bool(self.feasible[group])

    def check_rows(self, n_rows: int) -> None:
        """Refuse data of ``n_rows`` rows when the table describes another number (a torchrun rank checks the
        whole data's rows: ``Shard.n_rows`` (:class:`~pytest_dnnsafety.runtime.torchrun.Shard`))."""
        if self.table is not None:
            check_rows_match(self.table, n_rows, table_fixture=self.fixtures["scenarios"],
                             data_fixture=self.fixtures["data"])
