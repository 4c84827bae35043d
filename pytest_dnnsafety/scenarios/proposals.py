"""Closing coverage holes: greedy (AETG-style) scenario proposals and the hypothesis strategy.

Part of :mod:`pytest_dnnsafety.scenarios`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.projection import ProjectionLayout
from pytest_dnnsafety.errors import ConfigError, MetricError

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from pytest_dnnsafety.scenarios.conditions import Conditions


# ---------------------------------------------------------------------- proposals
class _GreedyBuilder:
    """Vectorised AETG-style construction of candidate scenarios (one condition at a time)."""

    def __init__(self, conditions: Conditions, layout: ProjectionLayout) -> None:
        self.conditions = conditions
        self.layout = layout
        self.cards = conditions.cardinalities
        n = len(self.cards)
        self.weights = layout.weight_matrix(torch.int64)
        self.offsets = layout.offsets_tensor()
        self.per_condition: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
        for c in range(n):
            ids = [s for s, subset in enumerate(layout.subsets) if c in subset]
            others = [[x for x in layout.subsets[s] if x != c] for s in ids]
            w_others = [[layout.strides[s][layout.subsets[s].index(x)] for x in layout.subsets[s] if x != c] for s in ids]
            w_c = [layout.strides[s][layout.subsets[s].index(c)] for s in ids]
            offs = [layout.offsets[s] for s in ids]
            self.per_condition.append(
                (
                    torch.tensor(others, dtype=torch.int64).reshape(len(ids), layout.k - 1),
                    torch.tensor(w_others, dtype=torch.int64).reshape(len(ids), layout.k - 1),
                    torch.tensor(w_c, dtype=torch.int64),
                    torch.tensor(offs, dtype=torch.int64),
                )
            )
        #: per condition: (its excluded values, the restriction's other (condition, values) parts)
        self.restrictions_of: list[list[tuple[Tensor, list[tuple[int, Tensor]]]]] = [[] for _ in range(n)]
        for parts in conditions._coded:
            for cond, allowed in parts:
                others = [(o, a) for o, a in parts if o != cond]
                self.restrictions_of[cond].append((allowed, others))
        self.bonus = layout.n_subsets + 1

    def gain(self, deficit: Tensor) -> Tensor:
        """Per-cell value of hitting it: closing a hole weighs more than progress towards min_count."""
        return (deficit == 1).to(torch.int64) * self.bonus + (deficit > 0).to(torch.int64)

    def score(self, candidates: Tensor, deficit: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(score, holes closed, cells hit) of full candidates (R × n)."""
        index = candidates @ self.weights + self.offsets
        d = deficit[index]
        closes = (d == 1).sum(1)
        hits = (d > 0).sum(1)
        return closes * self.bonus + hits, closes, hits

    def build(self, seeds: Tensor, deficit: Tensor, generator: torch.Generator) -> Tensor:
        """Complete the seed cells (flat indices) into full scenarios, greedily per condition."""
        n = len(self.cards)
        r = seeds.shape[0]
        values = torch.zeros(r, n, dtype=torch.int64)
        assigned = torch.zeros(r, n, dtype=torch.bool)
        subset_ids, cell_values = self.layout.decode(seeds)
        members = self.layout.subset_tensor()[subset_ids]
        values.scatter_(1, members, cell_values)
        assigned.scatter_(1, members, True)
        gain = self.gain(deficit).to(torch.float64)
        for c in torch.randperm(n, generator=generator).tolist():
            card = self.cards[c]
            others, w_others, w_c, offs = self.per_condition[c]
            base = (values[:, others] * w_others).sum(-1) + offs  # (R, S_c)
            known = assigned[:, others].all(-1)  # (R, S_c)
            index = base[:, :, None] + w_c[None, :, None] * torch.arange(card)[None, None, :]
            score = (gain[index] * known[:, :, None]).sum(1)  # (R, card)
            for allowed_c, other_parts in self.restrictions_of[c]:
                rest = torch.ones(r, dtype=torch.bool)
                for cond, allowed in other_parts:
                    rest &= assigned[:, cond] & allowed[values[:, cond]]
                score -= (rest[:, None] & allowed_c[None, :]).to(torch.float64) * 1e9
            score += torch.rand(r, card, generator=generator, dtype=torch.float64) * 0.5
            choice = score.argmax(1)
            values[:, c] = torch.where(assigned[:, c], values[:, c], choice)
            assigned[:, c] = True
        return values


def _propose(
    conditions: Conditions, layout: ProjectionLayout, deficit: Tensor, count: int, seed: int, width: int = 64
) -> tuple[list[Tensor], list[int]]:
    """Greedy set cover: up to ``count`` feasible scenarios, each closing the most remaining holes.

    Each round builds ``width`` candidates seeded at random holes (vectorised AETG-style
    completion), scores them all at once against the remaining deficits, keeps the best feasible
    one and recounts. If no candidate is feasible, an exact feasible completion of the seeds is
    used. Deterministic for a seed.
    """
    generator = torch.Generator().manual_seed(seed)
    builder = _GreedyBuilder(conditions, layout)
    deficit = deficit.clone()
    chosen: list[Tensor] = []
    closes_list: list[int] = []
    n = len(conditions)
    for _ in range(count):
        holes = torch.nonzero(deficit > 0).reshape(-1)
        if holes.numel() == 0:
            break
        seeds = holes[torch.randperm(holes.numel(), generator=generator)[:width]]
        candidates = builder.build(seeds, deficit, generator)
        feasible = conditions.feasible_mask(candidates)
        if not bool(feasible.any()):
            partial = torch.full((seeds.numel(), n), -1, dtype=torch.int64)
            subset_ids, cell_values = layout.decode(seeds)
            partial.scatter_(1, layout.subset_tensor()[subset_ids], cell_values)
            candidates, feasible = conditions._complete(partial, generator)
            if not bool(feasible.any()):
                break
        score, closes, hits = builder.score(candidates, deficit)
        score = torch.where(feasible, score, torch.full_like(score, -1))
        best = int(score.argmax())
        if int(hits[best]) == 0:
            break
        pick = candidates[best]
        index = pick @ builder.weights + builder.offsets
        deficit[index] = (deficit[index] - 1).clamp(min=0)
        chosen.append(pick.clone())
        closes_list.append(int(closes[best]))
    return chosen, closes_list


def scenario_strategy(table: Any, k: int = 2) -> SearchStrategy[dict[str, str]]:
    """A hypothesis strategy of feasible scenario dicts, uncovered k-cells first.

    Draws an uncovered cell (``sampled_from``, so shrinking goes to the first uncovered cell)
    and fills the other conditions from their domains, skipping values that would complete a
    restriction. Should the result still be infeasible, a precomputed feasible completion of
    that cell is returned instead, so no draw is ever rejected. With no uncovered cells the
    strategy draws plain feasible scenarios. Uncovered cells that no feasible scenario extends
    (possible only when feasibility is not exact) are left out.
    """
    try:
        from hypothesis import strategies as st
    except ImportError:  # pragma: no cover - hypothesis is a test dependency
        raise ConfigError("ScenarioTable.strategy needs hypothesis; pip install hypothesis") from None
    conditions = table.conditions
    result = table.coverage(k=k, propose=0, allow_infeasible_rows=True)
    n = len(conditions)
    generator = torch.Generator().manual_seed(0)
    pool: list[tuple[dict[str, str], dict[str, str]]] = []
    if result.uncovered:
        partial = torch.full((len(result.uncovered), n), -1, dtype=torch.int64)
        for r, cell in enumerate(result.uncovered):
            for name, value in cell.items():
                partial[r, conditions.index(name)] = conditions._lookup[conditions.index(name)][value]
        completed, found = conditions._complete(partial, generator)
        pool = [
            (cell, conditions.decode(completed[r]))
            for r, cell in enumerate(result.uncovered)
            if bool(found[r])
        ]
    if not pool:
        completed, found = conditions._complete(torch.full((1, n), -1, dtype=torch.int64), generator)
        if not bool(found[0]):
            raise MetricError("no feasible scenario found for the strategy; relax the restrictions")
        pool = [({}, conditions.decode(completed[0]))]
    names, domains = conditions.names, conditions.domains
    restrictions = conditions._restrictions

    def violates(scenario: Mapping[str, str]) -> bool:
        return any(
            all(cond in scenario and scenario[cond] in values for cond, values in r.items()) for r in restrictions
        )

    @st.composite
    def scenarios(draw: Any) -> dict[str, str]:
        cell, witness = draw(st.sampled_from(pool))
        scenario = dict(cell)
        for name in names:
            if name in scenario:
                continue
            allowed = [v for v in domains[name] if not violates({**scenario, name: v})]
            if not allowed:
                return dict(witness)
            scenario[name] = draw(st.sampled_from(allowed))
        ordered = {name: scenario[name] for name in names}
        return ordered if conditions.is_feasible(ordered) else dict(witness)

    return scenarios()
