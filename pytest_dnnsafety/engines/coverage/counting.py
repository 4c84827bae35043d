"""Counting the cells of every k-projection table on the CPU: condition groups, shared key prefixes, few bincounts.

The direct way (one cell index per row and k-subset, one ``bincount`` over ``rows × S`` indices)
touches every row once per subset: 120 passes over the rows for 10 conditions at k = 3. Here the
conditions are first gathered into *groups* whose joint domain stays small (at most ``cap`` value
combinations, see :func:`plan_groups`) and every k-subset lies inside some group; each group costs
one pass over the rows (its joint key by mixed radix, then one ``bincount`` into its joint table),
and the k-subsets inside it are then summed out of that small table. For 10 conditions of 2–12
values at k = 3 that is about 15 passes instead of 120.

The groups are visited in lexicographic order so consecutive groups share key prefixes (the key of
``(a, b, c)`` is the key of ``(a, b)`` times ``|C_c|`` plus ``c``): the prefix keys stay on a stack,
one buffer per depth, and each step is one fused ``add(c, prefix, alpha=|C_c|)``. Keys are int16
whenever the joint tables have at most 2**15 cells (most conditions have few values), which halves
the memory traffic of int32 and quarters that of int64; the columns are read as contiguous 1-D
rows of a column-major ``(conditions, rows)`` tensor (the scenario table caches its codes so, see
:func:`column_major`).

Exact integer counting, identical to the direct way (``tests/families/coverage/test_counting.py``).
Meant for one thread (:func:`pytest_dnnsafety.runtime.threads.host_bound`): ``bincount`` is a serial
loop on the CPU and the key steps are a millisecond each, so a second thread only adds OpenMP barriers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.projection import ProjectionLayout

__all__ = ["MAX_GROUP_CELLS", "GroupPlan", "add_marginals", "column_major", "count_groups", "count_projections",
           "default_cap", "key_dtype", "plan_for", "plan_groups"]

#: The largest joint table of a group: int16 keys, and a histogram (int64) that stays in the L2 cache.
MAX_GROUP_CELLS = 1 << 15
#: Beyond this many k-subsets the greedy grouping (quadratic-ish in Python) is skipped: each subset is
#: its own group (still one pass per subset, with shared key prefixes).
_GREEDY_MAX_SUBSETS = 4096


def key_dtype(cells: int) -> torch.dtype:
    """The narrowest signed integer dtype holding every key ``0 .. cells - 1``."""
    if cells <= 1 << 15:
        return torch.int16
    if cells <= 1 << 31:
        return torch.int32
    return torch.int64


def default_cap(rows: int) -> int:
    """The joint-table cap for ``rows`` rows: small joint tables for few rows (a group's table costs its
    size in zeroing and summing, which must stay well below the rows' pass), up to :data:`MAX_GROUP_CELLS`."""
    cap = 1 << max(8, (max(rows, 1) // 8).bit_length() - 1)
    return min(cap, MAX_GROUP_CELLS)


@dataclass(frozen=True)
class GroupPlan:
    """Condition groups covering every k-subset, in lexicographic order (for shared key prefixes).

    ``groups[g]`` are sorted condition indices, ``sizes[g]`` the cells of their joint table,
    ``parts[g]`` the k-subsets counted from that table: ``(subset index in the layout, the group's
    dimensions summed out)``. Every k-subset appears in exactly one group's parts.
    """

    groups: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    parts: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]
    dtype: torch.dtype


@lru_cache(maxsize=64)
def plan_groups(cardinalities: tuple[int, ...], k: int, cap: int) -> GroupPlan:
    """Greedy cover of the k-subsets by groups whose joint table has at most ``cap`` cells.

    Each group starts at the first k-subset not covered yet and repeatedly takes the condition that
    brings the most uncovered k-subsets into it (fewer values first on ties) while the joint size
    stays within ``cap``. A k-subset whose own table exceeds ``cap`` is a group alone.
    """
    cards = cardinalities
    n = len(cards)
    subsets = list(itertools.combinations(range(n), k))
    index = {subset: s for s, subset in enumerate(subsets)}
    chosen: list[tuple[tuple[int, ...], list[int]]] = []
    if len(subsets) > _GREEDY_MAX_SUBSETS:
        chosen = [(subset, [s]) for s, subset in enumerate(subsets)]
    else:
        uncovered = set(subsets)
        for seed in subsets:
            if seed not in uncovered:
                continue
            group = list(seed)
            size = math.prod(cards[c] for c in seed)
            while True:
                best, best_gain = -1, 0
                for c in range(n):
                    if c in group or size * cards[c] > cap:
                        continue
                    gain = sum(1 for rest in itertools.combinations(group, k - 1)
                               if tuple(sorted((*rest, c))) in uncovered)
                    if gain > best_gain or (gain == best_gain and gain and cards[c] < cards[best]):
                        best, best_gain = c, gain
                if best_gain == 0:
                    break
                group.append(best)
                size *= cards[best]
            members = tuple(sorted(group))
            inside = [subset for subset in itertools.combinations(members, k) if subset in uncovered]
            uncovered.difference_update(inside)
            chosen.append((members, [index[subset] for subset in inside]))
    chosen.sort(key=lambda item: item[0])
    groups, sizes, parts = [], [], []
    for members, ids in chosen:
        groups.append(members)
        sizes.append(math.prod(cards[c] for c in members))
        parts.append(tuple(
            (s, tuple(d for d, c in enumerate(members) if c not in subsets[s])) for s in sorted(ids)
        ))
    return GroupPlan(tuple(groups), tuple(sizes), tuple(parts), key_dtype(max(sizes)))


#: Rows per block when :func:`column_major` transposes (a block's int64 rows fit the L2 cache; one copy of the
#: whole table is 4x slower, measured on 2 CPU cores) and when :func:`count_projections` walks the rows.
_BLOCK_ROWS = 1 << 14


def column_major(codes: Tensor, dtype: torch.dtype) -> Tensor:
    """The codes (rows × conditions) as a contiguous ``(conditions, rows)`` tensor of ``dtype`` (one copy).

    Returned as is when already so laid out (the ``.t()`` of a contiguous tensor) in ``dtype`` (mixed
    dtypes would cost more: torch's integer kernels are vectorised for one dtype only, measured 2–3x).
    The codes must lie in ``dtype``'s range (narrowing wraps).
    """
    t = codes.t()
    if t.is_contiguous() and codes.dtype == dtype:
        return t
    out = torch.empty(t.shape, dtype=dtype, device=codes.device)
    if codes.device.type != "cpu":
        return out.copy_(t)
    for start in range(0, t.shape[1], _BLOCK_ROWS):
        out[:, start : start + _BLOCK_ROWS].copy_(t[:, start : start + _BLOCK_ROWS])
    return out


def count_groups(columns: Tensor, layout: ProjectionLayout, plan: GroupPlan, joints: list[Tensor]) -> None:
    """Add the rows' counts to each group's joint table (``joints[g]``, int64, ``plan.sizes[g]`` cells).

    ``columns`` is ``(conditions, rows)``, contiguous, with valid codes, of dtype ``plan.dtype``
    (:func:`column_major`).
    """
    rows = columns.shape[1]
    if rows == 0:
        return
    cards = layout.cardinalities
    dtype = plan.dtype
    depth = max(len(group) for group in plan.groups)
    buffers: list[Tensor | None] = [None] * depth
    prefix: list[int] = []
    keys: list[Tensor] = []
    for g, members in enumerate(plan.groups):
        shared = 0
        while shared < min(len(prefix), len(members)) and prefix[shared] == members[shared]:
            shared += 1
        del prefix[shared:], keys[shared:]
        for d in range(shared, len(members)):
            c = members[d]
            if d == 0:
                key = columns[c]
            else:
                buffer = buffers[d]
                if buffer is None:
                    buffer = buffers[d] = torch.empty(rows, dtype=dtype, device=columns.device)
                key = torch.add(columns[c], keys[d - 1], alpha=cards[c], out=buffer)
            prefix.append(c)
            keys.append(key)
        joints[g] += torch.bincount(keys[-1], minlength=plan.sizes[g])


def add_marginals(joints: list[Tensor], layout: ProjectionLayout, plan: GroupPlan, counts: Tensor) -> None:
    """Sum each group's joint table down to its k-subsets and add them to ``counts`` (flat layout)."""
    cards = layout.cardinalities
    for joint, members, parts in zip(joints, plan.groups, plan.parts):
        shape = [cards[c] for c in members]
        for s, summed in parts:
            table = joint.view(shape).sum(summed) if summed else joint
            counts[layout.offsets[s] : layout.offsets[s + 1]] += table.reshape(-1)


def count_projections(columns: Tensor, layout: ProjectionLayout, plan: GroupPlan, counts: Tensor,
                      block_rows: int | None = None) -> None:
    """Add the rows' k-projection cell counts to ``counts`` (flat layout of ``layout``, int64).

    ``columns`` as for :func:`count_groups`; walked in blocks of ``block_rows`` rows (all at once by default).
    """
    if columns.dtype != plan.dtype:
        columns = columns.to(plan.dtype)
    joints = [torch.zeros(size, dtype=torch.int64, device=columns.device) for size in plan.sizes]
    step = block_rows or max(columns.shape[1], 1)
    for start in range(0, columns.shape[1], step):
        count_groups(columns[:, start : start + step], layout, plan, joints)
    add_marginals(joints, layout, plan, counts)


def plan_for(cardinalities: Sequence[int], k: int, rows: int) -> GroupPlan:
    """:func:`plan_groups` at :func:`default_cap` for ``rows`` (the cap never splits a single k-subset:
    such a subset is a group alone)."""
    return plan_groups(tuple(int(c) for c in cardinalities), k, default_cap(rows))
