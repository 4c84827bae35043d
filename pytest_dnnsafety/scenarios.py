"""Operating conditions, scenario tables and scenario k-projection coverage (user-facing).

Scenario coverage M_scene follows Cheng et al. 2018, §II-A, eq. (1): for every k-subset of
operating conditions, the share of value combinations (cells) that the evaluation data
reaches. This module adds what users need around the ratio:

* :class:`Conditions` — each condition's full value domain (unseen values still count) and
  *restrictions*, conjunctions of values that cannot occur together (e.g. bright light with
  high noise). Cells that no possible scenario reaches leave the denominator and are reported
  separately; the paper's reference kit ignores them in its printed coverage.
* :class:`ScenarioTable` — one row per evaluation sample, read from CSV or built in code.
* :class:`CoverageResult` — the value, per-subset ratios, *all* uncovered cells, the
  infeasible cells and a few proposed new scenarios (greedy, AETG-style) that close the most
  holes.
* :meth:`ScenarioTable.strategy` — a hypothesis strategy drawing feasible scenarios,
  uncovered cells first.

Counting is done by :class:`~pytest_dnnsafety.engines.scenario.ScenarioCoverageEngine`.
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import Tensor

from pytest_dnnsafety.engines.scenario import ProjectionLayout, ScenarioCoverageEngine
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = [
    "EXACT_FEASIBILITY_LIMIT",
    "Conditions",
    "CoverageResult",
    "ScenarioTable",
    "SubsetCoverage",
    "check_rows_match",
    "count_samples",
]

#: Largest number of joint assignments of one group of restricted conditions that is
#: enumerated to decide cell feasibility exactly; larger groups fall back to a sufficient check.
EXACT_FEASIBILITY_LIMIT = 20_000_000

#: Assignments enumerated per chunk (bounds memory of the exact feasibility computation).
_ENUM_CHUNK = 1 << 20

Where = Mapping[str, Union[str, int, float, Sequence[Union[str, int, float]]]]


def _toml_module() -> ModuleType:
    """``tomllib`` (Python 3.11+) or the ``tomli`` backport."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:  # pragma: no cover - Python 3.10 only
        import tomli
    except ImportError:  # pragma: no cover - Python 3.10 only
        raise ConfigError("reading the conditions file on Python 3.10 needs tomli; pip install tomli") from None
    return tomli  # pragma: no cover


def _prefix(source: str | None) -> str:
    return f"{source}: " if source else ""


def _coerce_value(value: object, what: str) -> str:
    """A domain value as a string: str as is (stripped), int/float via ``str``; others refused."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{what}: value {value!r} must be a string (or a number); quote it")
    text = value.strip() if isinstance(value, str) else str(value)
    if not text:
        raise DataError(f"{what}: empty value; give every value a non-empty name")
    return text


def _as_value_list(values: object, what: str) -> list[str]:
    if isinstance(values, (str, int, float)) and not isinstance(values, bool):
        return [_coerce_value(values, what)]
    if isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
        return [_coerce_value(v, what) for v in values]
    raise DataError(f"{what}: expected a value or a list of values, got {values!r}")


def _product_codes(cards: Sequence[int], start: int, stop: int) -> Tensor:
    """Rows ``start..stop-1`` of the mixed-radix enumeration of ``∏ cards`` (first most significant)."""
    index = torch.arange(start, stop, dtype=torch.int64)
    columns = []
    for card in reversed(cards):
        columns.append(index % card)
        index = index // card
    return torch.stack(columns[::-1], dim=1) if columns else torch.zeros(stop - start, 0, dtype=torch.int64)


class Conditions:
    """Ordered operating conditions, their value domains and their restrictions.

    Args:
        domains: condition name → its values (non-empty, distinct; numbers become strings).
        restrictions: each a conjunction ``{condition: value or [values], ...}``; a scenario
            matching every listed ``condition ∈ values`` is impossible, e.g.
            ``{"lighting": ["bright", "normal"], "noise": "high"}``.
        source: where the definition came from (used in error messages).
    """

    def __init__(
        self,
        domains: Mapping[str, Sequence[str]],
        restrictions: Sequence[Mapping[str, str | Sequence[str]]] = (),
        *,
        source: str | None = None,
    ) -> None:
        pre = _prefix(source)
        if not isinstance(domains, Mapping) or not domains:
            raise DataError(f"{pre}no operating conditions declared; give each condition its list of values")
        names: list[str] = []
        values: dict[str, tuple[str, ...]] = {}
        for name, domain in domains.items():
            if not isinstance(name, str) or not name.strip():
                raise DataError(f"{pre}condition name {name!r} must be a non-empty string")
            what = f"{pre}condition {name!r}"
            if isinstance(domain, (str, bytes)) or not isinstance(domain, Sequence):
                raise DataError(f"{what} must list its values as an array, e.g. {name} = [\"a\", \"b\"]; got {domain!r}")
            if len(domain) == 0:
                raise DataError(f"{what} has an empty domain; list at least one value")
            seen: list[str] = []
            for raw in domain:
                value = _coerce_value(raw, what)
                if value in seen:
                    raise DataError(f"{what} lists value {value!r} twice; list each value once")
                seen.append(value)
            names.append(name)
            values[name] = tuple(seen)
        self._source = source
        self._names: tuple[str, ...] = tuple(names)
        self._domains: Mapping[str, tuple[str, ...]] = MappingProxyType(values)
        self._position = {name: i for i, name in enumerate(names)}
        self._lookup = [{value: code for code, value in enumerate(values[name])} for name in names]
        if isinstance(restrictions, Mapping) or isinstance(restrictions, (str, bytes)):
            raise DataError(f"{pre}restrictions must be a list of tables, got {restrictions!r}")
        normalised: list[dict[str, tuple[str, ...]]] = []
        coded: list[tuple[tuple[int, Tensor], ...]] = []
        for number, restriction in enumerate(restrictions, start=1):
            what = f"{pre}restriction #{number}"
            if not isinstance(restriction, Mapping) or not restriction:
                raise DataError(f"{what} must be a non-empty table of condition = value(s), got {restriction!r}")
            entry: dict[str, tuple[str, ...]] = {}
            parts: list[tuple[int, Tensor]] = []
            for cond, raw_values in restriction.items():
                if cond not in self._position:
                    raise DataError(
                        f"{what} names unknown condition {cond!r}; declare it under [conditions] "
                        f"(known: {', '.join(names)})"
                    )
                listed = _as_value_list(raw_values, f"{what}, condition {cond!r}")
                if not listed:
                    raise DataError(f"{what}, condition {cond!r}: empty value list; list the excluded values")
                allowed = torch.zeros(len(values[cond]), dtype=torch.bool)
                for value in listed:
                    if value not in self._lookup[self._position[cond]]:
                        raise DataError(
                            f"{what}, condition {cond!r}: value {value!r} is not in its domain "
                            f"{list(values[cond])}; use one of those values or add it to the domain"
                        )
                    allowed[self._lookup[self._position[cond]][value]] = True
                entry[cond] = tuple(v for v in values[cond] if allowed[self._lookup[self._position[cond]][v]])
                parts.append((self._position[cond], allowed))
            normalised.append(entry)
            coded.append(tuple(sorted(parts, key=lambda part: part[0])))
        self._restrictions = tuple(normalised)
        self._coded = tuple(coded)
        self._feasibility_cache: dict[int, tuple[Tensor, bool]] = {}
        self._components = self._restriction_components()
        self._component_cache: dict[tuple[int, ...], list[Tensor]] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_toml(cls, path: str | Path) -> Conditions:
        """Read ``[conditions]`` (name = [values]) and optional ``[[restrictions]]`` tables."""
        path = Path(path)
        where = f"conditions file {str(path)!r}"
        tomllib = _toml_module()
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DataError(f"{where} does not exist; check the dnnsafety_conditions path") from None
        except UnicodeDecodeError as exc:
            raise DataError(f"{where} is not UTF-8 text ({exc}); save it as UTF-8") from None
        except tomllib.TOMLDecodeError as exc:
            raise DataError(f"{where} is not valid TOML: {exc}; fix the syntax") from None
        if "conditions" not in data:
            raise DataError(
                f"{where} has no [conditions] table; declare each condition's domain, e.g. "
                f'[conditions] weather = ["sunny", "rainy"]'
            )
        unknown = sorted(set(data) - {"conditions", "restrictions"})
        if unknown:
            raise DataError(
                f"{where}: unknown top-level key(s) {unknown}; only [conditions] and [[restrictions]] are read"
            )
        domains = data["conditions"]
        if not isinstance(domains, dict):
            raise DataError(f"{where}: 'conditions' must be a table [conditions], got {type(domains).__name__}")
        restrictions = data.get("restrictions", [])
        if not isinstance(restrictions, list) or not all(isinstance(r, dict) for r in restrictions):
            raise DataError(
                f"{where}: 'restrictions' must be an array of tables written [[restrictions]], "
                f"got {restrictions!r}"
            )
        return cls(domains, restrictions, source=where)

    # ------------------------------------------------------------------ accessors
    @property
    def names(self) -> tuple[str, ...]:
        """Condition names, in order."""
        return self._names

    @property
    def domains(self) -> Mapping[str, tuple[str, ...]]:
        """Condition name → its values (read-only)."""
        return self._domains

    @property
    def cardinalities(self) -> tuple[int, ...]:
        return tuple(len(self._domains[name]) for name in self._names)

    @property
    def restrictions(self) -> tuple[Mapping[str, tuple[str, ...]], ...]:
        """The restrictions, values normalised to tuples in domain order."""
        return tuple(MappingProxyType(dict(r)) for r in self._restrictions)

    @property
    def source(self) -> str | None:
        return self._source

    def __len__(self) -> int:
        return len(self._names)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Conditions):
            return NotImplemented
        mine = {frozenset((c, frozenset(v)) for c, v in r.items()) for r in self._restrictions}
        theirs = {frozenset((c, frozenset(v)) for c, v in r.items()) for r in other._restrictions}
        return self._names == other._names and dict(self._domains) == dict(other._domains) and mine == theirs

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        domains = ", ".join(f"{name}={list(self._domains[name])}" for name in self._names)
        extra = f", {len(self._restrictions)} restriction(s)" if self._restrictions else ""
        return f"Conditions({domains}{extra})"

    def index(self, name: str) -> int:
        """Position of condition ``name``."""
        try:
            return self._position[name]
        except KeyError:
            raise DataError(
                f"{_prefix(self._source)}unknown condition {name!r} (known: {', '.join(self._names)})"
            ) from None

    def encode(self, scenario: Mapping[str, object], what: str = "scenario") -> list[int]:
        """A full scenario dict → its codes (positions in the domains), with clear errors."""
        if not isinstance(scenario, Mapping):
            raise DataError(f"{what} must be a mapping condition → value, got {type(scenario).__name__}")
        unknown = [key for key in scenario if key not in self._position]
        if unknown:
            raise DataError(
                f"{what}: unknown condition {unknown[0]!r}; declare its domain in the conditions file "
                f"(known: {', '.join(self._names)})"
            )
        codes = []
        for i, name in enumerate(self._names):
            if name not in scenario:
                raise DataError(f"{what}: missing condition {name!r}; give one value per condition")
            value = _coerce_value(scenario[name], f"{what}, condition {name!r}")
            if value not in self._lookup[i]:
                raise DataError(
                    f"{what}: condition {name!r} has value {value!r} outside its domain "
                    f"{list(self._domains[name])}; use a declared value or add it to the conditions file"
                )
            codes.append(self._lookup[i][value])
        return codes

    def decode(self, codes: Sequence[int] | Tensor) -> dict[str, str]:
        """Codes of one full scenario → its dict."""
        values = codes.tolist() if isinstance(codes, Tensor) else list(codes)
        return {name: self._domains[name][int(code)] for name, code in zip(self._names, values)}

    # ------------------------------------------------------------------ feasibility
    def is_feasible(self, scenario: Mapping[str, object]) -> bool:
        """Whether a full scenario violates no restriction."""
        codes = self.encode(scenario)
        return not any(all(bool(allowed[codes[c]]) for c, allowed in parts) for parts in self._coded)

    def feasible_mask(self, codes: Tensor) -> Tensor:
        """Vectorised :meth:`is_feasible` over the rows of ``codes`` (N × n) → bool (N,)."""
        if codes.ndim != 2 or codes.shape[1] != len(self._names):
            raise DataError(f"codes must have shape (rows, {len(self._names)}), got {tuple(codes.shape)}")
        return ~self._violations(codes, tuple(range(len(self._names))), self._coded)

    def _violations(
        self, codes: Tensor, columns: Sequence[int], coded: Sequence[tuple[tuple[int, Tensor], ...]]
    ) -> Tensor:
        """Rows of ``codes`` (whose j-th column is condition ``columns[j]``) matching some restriction."""
        where = {cond: j for j, cond in enumerate(columns)}
        violated = torch.zeros(codes.shape[0], dtype=torch.bool, device=codes.device)
        for parts in coded:
            match = torch.ones(codes.shape[0], dtype=torch.bool, device=codes.device)
            for cond, allowed in parts:
                match &= allowed.to(codes.device)[codes[:, where[cond]]]
            violated |= match
        return violated

    def _restriction_components(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """Groups of conditions linked by restrictions: (conditions, restriction indices)."""
        parent = list(range(len(self._names)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for parts in self._coded:
            first = find(parts[0][0])
            for cond, _ in parts[1:]:
                parent[find(cond)] = first
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for r, parts in enumerate(self._coded):
            root = find(parts[0][0])
            groups.setdefault(root, ([], []))[1].append(r)
        for cond in range(len(self._names)):
            root = find(cond)
            if root in groups:
                groups[root][0].append(cond)
        return tuple((tuple(sorted(conds)), tuple(rs)) for conds, rs in groups.values())

    def _component_size(self, conds: Sequence[int]) -> int:
        return math.prod(len(self._domains[self._names[c]]) for c in conds)

    def _component_feasible(self, conds: tuple[int, ...], rs: tuple[int, ...]) -> Iterator[Tensor]:
        """Chunks of the feasible joint assignments of a restriction group (columns = ``conds``)."""
        if conds in self._component_cache:
            yield from self._component_cache[conds]
            return
        cards = [len(self._domains[self._names[c]]) for c in conds]
        size = math.prod(cards)
        coded = [self._coded[r] for r in rs]
        keep: list[Tensor] = []
        kept = 0
        for start in range(0, size, _ENUM_CHUNK):
            chunk = _product_codes(cards, start, min(size, start + _ENUM_CHUNK))
            feasible = chunk[~self._violations(chunk, conds, coded)]
            kept += feasible.numel()
            keep.append(feasible)
            yield feasible
        if kept <= _ENUM_CHUNK * 4:
            self._component_cache[conds] = keep

    def cell_feasibility(self, k: int) -> tuple[Tensor, bool]:
        """Feasibility of every k-projection cell (flat layout of the engine) and whether it is exact.

        A k-cell is feasible iff some full scenario extending it violates no restriction. It is
        computed exactly by enumerating the joint assignments of each group of conditions linked
        by restrictions (free conditions never matter), projecting the feasible ones onto each
        subset. A group with more than :data:`EXACT_FEASIBILITY_LIMIT` assignments falls back to
        the sufficient check (a restriction whose conditions all lie in the subset and match the
        cell), which may leave some infeasible cells in the denominator; ``exact`` is then False.
        """
        if k in self._feasibility_cache:
            mask, exact = self._feasibility_cache[k]
            return mask.clone(), exact
        layout = ProjectionLayout(self.cardinalities, k)
        feasible = torch.ones(layout.total, dtype=torch.bool)
        exact = True
        for conds, rs in self._components:
            cond_set = set(conds)
            if self._component_size(conds) <= EXACT_FEASIBILITY_LIMIT:
                needed = {tuple(c for c in subset if c in cond_set) for subset in layout.subsets} - {()}
                tables = self._projection_tables(conds, rs, needed)
                if tables is None:  # this group admits no assignment at all: nothing is feasible
                    feasible.zero_()
                    break
                for s, subset in enumerate(layout.subsets):
                    inside = [j for j, c in enumerate(subset) if c in cond_set]
                    if not inside:
                        continue
                    part = tuple(subset[j] for j in inside)
                    table, strides = tables[part]
                    cells = layout.subset_cells(s)[:, inside]
                    index = (cells * torch.tensor(strides, dtype=torch.int64)).sum(1)
                    block = slice(layout.offsets[s], layout.offsets[s + 1])
                    feasible[block] &= table[index]
            else:
                exact = False
                for s, subset in enumerate(layout.subsets):
                    cells = None
                    block = slice(layout.offsets[s], layout.offsets[s + 1])
                    for r in rs:
                        parts = self._coded[r]
                        if not all(cond in subset for cond, _ in parts):
                            continue
                        if cells is None:
                            cells = layout.subset_cells(s)
                        match = torch.ones(cells.shape[0], dtype=torch.bool)
                        for cond, allowed in parts:
                            match &= allowed[cells[:, subset.index(cond)]]
                        feasible[block] &= ~match
        self._feasibility_cache[k] = (feasible, exact)
        return feasible.clone(), exact

    def _projection_tables(
        self, conds: tuple[int, ...], rs: tuple[int, ...], needed: set[tuple[int, ...]]
    ) -> dict[tuple[int, ...], tuple[Tensor, tuple[int, ...]]] | None:
        """For each needed sub-tuple of ``conds``: which of its value combinations some feasible
        assignment of the group reaches (mixed-radix table, with its strides). None if none is feasible."""
        position = {c: j for j, c in enumerate(conds)}
        tables: dict[tuple[int, ...], tuple[Tensor, tuple[int, ...]]] = {}
        for part in needed:
            stride, strides = 1, []
            for c in reversed(part):
                strides.append(stride)
                stride *= len(self._domains[self._names[c]])
            tables[part] = (torch.zeros(stride, dtype=torch.bool), tuple(reversed(strides)))
        any_feasible = False
        for chunk in self._component_feasible(conds, rs):
            if chunk.shape[0] == 0:
                continue
            any_feasible = True
            for part, (table, strides) in tables.items():
                cols = chunk[:, [position[c] for c in part]]
                table[(cols * torch.tensor(strides, dtype=torch.int64)).sum(1)] = True
        return tables if any_feasible else None

    def _sampled_feasible(
        self, conds: tuple[int, ...], rs: tuple[int, ...], generator: torch.Generator, rounds: int = 16
    ) -> Iterator[Tensor]:
        """Chunks of random feasible joint assignments of a group too big to enumerate."""
        cards = torch.tensor([len(self._domains[self._names[c]]) for c in conds], dtype=torch.float64)
        coded = [self._coded[r] for r in rs]
        for _ in range(rounds):
            draw = (torch.rand(4096, len(conds), generator=generator, dtype=torch.float64) * cards).long()
            yield draw[~self._violations(draw, conds, coded)]

    def _complete(self, partial: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Feasible full scenarios extending partial ones (M × n, -1 = free); returns (codes, found).

        Exact for restriction groups up to :data:`EXACT_FEASIBILITY_LIMIT` assignments (the first
        matching feasible assignment is taken); larger groups are sampled at random.
        Unrestricted free conditions take their first value.
        """
        out = partial.clone()
        found = torch.ones(partial.shape[0], dtype=torch.bool)
        for conds, rs in self._components:
            sub = partial[:, list(conds)]
            resolved = torch.zeros(partial.shape[0], dtype=torch.bool)
            choice = torch.zeros(partial.shape[0], len(conds), dtype=torch.int64)
            if self._component_size(conds) <= EXACT_FEASIBILITY_LIMIT:
                candidates: Iterator[Tensor] = self._component_feasible(conds, rs)
            else:
                candidates = self._sampled_feasible(conds, rs, generator)
            cards_list = [len(self._domains[self._names[c]]) for c in conds]
            # Partials grouped by which of the group's conditions they fix; each group is matched
            # against a chunk of feasible assignments by a hash join on those conditions' values.
            patterns, pattern_of = torch.unique(sub >= 0, dim=0, return_inverse=True)
            for chunk in candidates:
                if bool(resolved.all()):
                    break
                if chunk.shape[0] == 0:
                    continue
                for p, pattern in enumerate(patterns.tolist()):
                    rows = torch.nonzero((pattern_of == p) & ~resolved).reshape(-1)
                    if rows.numel() == 0:
                        continue
                    fixed = [j for j, is_fixed in enumerate(pattern) if is_fixed]
                    stride, strides = 1, []
                    for j in reversed(fixed):
                        strides.append(stride)
                        stride *= cards_list[j]
                    weights = torch.tensor(strides[::-1], dtype=torch.int64)
                    chunk_keys = (chunk[:, fixed] * weights).sum(1)
                    first = torch.full((stride,), chunk.shape[0], dtype=torch.int64)
                    first.scatter_reduce_(0, chunk_keys, torch.arange(chunk.shape[0]), reduce="amin")
                    position = first[(sub[rows][:, fixed] * weights).sum(1)]
                    hit = position < chunk.shape[0]
                    choice[rows[hit]] = chunk[position[hit]]
                    resolved[rows[hit]] = True
            out[:, list(conds)] = torch.where(resolved[:, None], choice, sub)
            found &= resolved
        out = torch.where(out < 0, torch.zeros_like(out), out)
        if partial.shape[0]:
            found &= self.feasible_mask(out)
        return out, found

    def _narrowed(self, selected: Mapping[int, tuple[int, ...]]) -> Conditions:
        """These conditions with some domains narrowed to the selected codes (restrictions intersected;
        a restriction that can no longer match is dropped)."""
        domains = {
            name: (
                tuple(self._domains[name][c] for c in selected[i]) if i in selected else self._domains[name]
            )
            for i, name in enumerate(self._names)
        }
        restrictions = []
        for entry in self._restrictions:
            narrowed = {cond: tuple(v for v in values if v in domains[cond]) for cond, values in entry.items()}
            if all(narrowed.values()):
                restrictions.append(narrowed)
        return Conditions(domains, restrictions, source=self._source)


def _check_code_tensor(codes: Tensor, conditions: Conditions, source: str | None) -> Tensor:
    pre = _prefix(source)
    n = len(conditions)
    if codes.dtype == torch.bool or codes.dtype.is_floating_point or codes.dtype.is_complex:
        raise DataError(f"{pre}scenario codes must be an integer tensor, got {codes.dtype}")
    if codes.ndim != 2 or codes.shape[1] != n:
        raise DataError(f"{pre}scenario codes must have shape (rows, {n}), got {tuple(codes.shape)}")
    codes = codes.detach().to("cpu", torch.int64).clone()
    if codes.shape[0]:
        cards = torch.tensor(conditions.cardinalities, dtype=torch.int64)
        bad = (codes < 0) | (codes >= cards)
        if bool(bad.any()):
            row, col = (int(v) for v in torch.nonzero(bad)[0])
            name = conditions.names[col]
            raise DataError(
                f"{pre}scenario codes row {row}, condition {name!r}: code {int(codes[row, col])} is outside "
                f"0..{cards[col] - 1} (domain {list(conditions.domains[name])})"
            )
    return codes


class ScenarioTable:
    """The evaluation data's scenarios: one row per sample (row i ↔ sample i), one column per condition.

    Args:
        conditions: the operating conditions.
        rows: a sequence of ``{condition: value}`` dicts, or an integer tensor of codes (N × n,
            code = position of the value in the condition's domain).
    """

    def __init__(
        self,
        conditions: Conditions,
        rows: Sequence[Mapping[str, object]] | Tensor,
        *,
        source: str | None = None,
    ) -> None:
        if not isinstance(conditions, Conditions):
            raise DataError(f"conditions must be a Conditions object, got {type(conditions).__name__}")
        self.conditions = conditions
        self._source = source
        #: CSV line of each row (set by :meth:`from_csv`; ``None`` for tables built in code)
        self._lines: tuple[int, ...] | None = None
        if isinstance(rows, Tensor):
            self.codes = _check_code_tensor(rows, conditions, source)
        else:
            if isinstance(rows, Mapping) or isinstance(rows, (str, bytes)):
                raise DataError(f"{_prefix(source)}rows must be a sequence of scenario dicts, got {type(rows).__name__}")
            encoded = [conditions.encode(row, f"{_prefix(source)}row {i}") for i, row in enumerate(rows)]
            self.codes = torch.tensor(encoded, dtype=torch.int64).reshape(len(encoded), len(conditions))

    @classmethod
    def from_csv(cls, path: str | Path, conditions: Conditions) -> ScenarioTable:
        """Read a CSV file: header = condition names (any order), one row per evaluation sample."""
        path = Path(path)
        where = f"scenario file {str(path)!r}"
        try:
            handle = path.open(newline="", encoding="utf-8-sig")
        except FileNotFoundError:
            raise DataError(f"{where} does not exist; check the dnnsafety_scenarios path") from None
        with handle:
            reader = csv.reader(handle)
            try:
                header: list[str] | None = None
                header_line = 0
                columns: list[list[str]] = []
                lines: list[int] = []
                for row in reader:
                    if not row or all(not cell.strip() for cell in row):
                        continue
                    if header is None:
                        header = [cell.strip() for cell in row]
                        header_line = reader.line_num
                        columns = [[] for _ in header]
                        continue
                    if len(row) != len(header):
                        raise DataError(
                            f"{where}, line {reader.line_num}: {len(row)} field(s) but the header has "
                            f"{len(header)}; give every row one value per column"
                        )
                    for column, cell in zip(columns, row):
                        column.append(cell.strip())
                    lines.append(reader.line_num)
            except csv.Error as exc:
                raise DataError(f"{where}, line {reader.line_num}: malformed CSV ({exc})") from None
            except UnicodeDecodeError as exc:
                raise DataError(f"{where} is not UTF-8 text ({exc}); save it as UTF-8") from None
        if header is None:
            raise DataError(
                f"{where} is empty; expected a header line with the condition names "
                f"({','.join(conditions.names)}) and one row per evaluation sample"
            )
        seen: dict[str, int] = {}
        for j, name in enumerate(header):
            if name in seen:
                raise DataError(
                    f"{where}, line {header_line}, column {j + 1}: condition {name!r} appears twice in the header "
                    f"(also column {seen[name] + 1}); keep one column per condition"
                )
            if name not in conditions.domains:
                raise DataError(
                    f"{where}, line {header_line}, column {j + 1}: unknown condition {name!r}; declare its domain "
                    f"in the conditions file (known: {', '.join(conditions.names)})"
                )
            seen[name] = j
        missing = [name for name in conditions.names if name not in seen]
        if missing:
            raise DataError(
                f"{where}, line {header_line}: missing column(s) for condition(s) {', '.join(map(repr, missing))}; "
                f"add one column per condition"
            )
        n_rows = len(lines)
        codes = torch.empty(n_rows, len(conditions), dtype=torch.int64)
        for i, name in enumerate(conditions.names):
            j = seen[name]
            lookup = conditions._lookup[i]
            column = columns[j]
            try:
                codes[:, i] = torch.tensor([lookup[value] for value in column], dtype=torch.int64)
            except KeyError:
                row = next(r for r, value in enumerate(column) if value not in lookup)
                raise DataError(
                    f"{where}, line {lines[row]}, column {j + 1} ({name!r}): value {column[row]!r} is not in the "
                    f"domain {list(conditions.domains[name])}; fix the value or add it to the conditions file"
                ) from None
        table = cls(conditions, codes, source=where)
        table._lines = tuple(lines)
        return table

    # ------------------------------------------------------------------ table basics
    def __len__(self) -> int:
        return int(self.codes.shape[0])

    def __repr__(self) -> str:
        return f"ScenarioTable({len(self)} rows, {self.conditions!r})"

    def rows(self) -> Iterator[dict[str, str]]:
        """The rows as ``{condition: value}`` dicts."""
        names, domains = self.conditions.names, self.conditions.domains
        for row in self.codes.tolist():
            yield {name: domains[name][code] for name, code in zip(names, row)}

    def with_rows(self, rows: Sequence[Mapping[str, object]] | Tensor | ScenarioTable) -> ScenarioTable:
        """A copy with ``rows`` appended (dicts, codes, or another table over equal conditions)."""
        if isinstance(rows, ScenarioTable):
            if rows.conditions != self.conditions:
                raise DataError("with_rows: the other table has different conditions; build both from the same ones")
            extra = rows.codes
        else:
            extra = ScenarioTable(self.conditions, rows, source="with_rows").codes
        return ScenarioTable(self.conditions, torch.cat([self.codes, extra]), source=self._source)

    def _resolve_where(self, where: Where) -> dict[int, tuple[int, ...]]:
        if not isinstance(where, Mapping) or not where:
            raise DataError(f"where must be a non-empty mapping condition → value(s), got {where!r}")
        conditions = self.conditions
        selected: dict[int, tuple[int, ...]] = {}
        for name, raw in where.items():
            if name not in conditions.domains:
                raise DataError(
                    f"where: unknown condition {name!r}; use one of {', '.join(conditions.names)}"
                )
            i = conditions.index(name)
            listed = _as_value_list(raw, f"where, condition {name!r}")
            if not listed:
                raise DataError(f"where, condition {name!r}: empty value list; select at least one value")
            codes = set()
            for value in listed:
                if value not in conditions._lookup[i]:
                    raise DataError(
                        f"where, condition {name!r}: value {value!r} is not in its domain "
                        f"{list(conditions.domains[name])}"
                    )
                codes.add(conditions._lookup[i][value])
            selected[i] = tuple(sorted(codes))
        return selected

    def row_mask(self, where: Where) -> Tensor:
        """A boolean mask over the rows matching ``where``: row *i* is sample *i* of the dataset."""
        keep = torch.ones(len(self), dtype=torch.bool)
        for i, chosen in self._resolve_where(where).items():
            keep &= torch.isin(self.codes[:, i], torch.tensor(chosen, dtype=self.codes.dtype))
        return keep

    def select(self, where: Where) -> ScenarioTable:
        """The rows matching ``where`` (condition → value or values), over narrowed conditions.

        The selected conditions' domains shrink to the selected values, so cells with other
        values are out of scope (``table.select(w).coverage()`` equals ``table.coverage(where=w)``).
        """
        selected = self._resolve_where(where)
        keep = torch.ones(len(self), dtype=torch.bool)
        codes = self.codes.clone()
        for i, chosen in selected.items():
            remap = torch.full((self.conditions.cardinalities[i],), -1, dtype=torch.int64)
            remap[list(chosen)] = torch.arange(len(chosen), dtype=torch.int64)
            codes[:, i] = remap[codes[:, i]]
            keep &= codes[:, i] >= 0
        narrowed = self.conditions._narrowed(selected)
        return ScenarioTable(narrowed, codes[keep], source=self._source)

    def restriction_violations(self, where: Where | None = None, limit: int = 5) -> tuple[int, list[dict[str, Any]]]:
        """Rows that break a declared restriction: ``(total, the first `limit` of them)``.

        Each listed row is ``{"row": i, "line": CSV line or None, "restriction": r, "values": {...}}``:
        ``row`` is the 0-based row index (= the index of the sample it describes), ``line`` the
        1-based line of the CSV file it came from, ``restriction`` the 1-based number of the first
        restriction it matches (in the conditions file's order) and ``values`` the row's values of
        that restriction's conditions. With ``where``, only rows matching it count.
        """
        if not len(self):
            return 0, []
        bad = ~self.conditions.feasible_mask(self.codes)
        if where is not None:
            bad &= self.row_mask(where)
        total = int(bad.sum())
        examples: list[dict[str, Any]] = []
        names, domains = self.conditions.names, self.conditions.domains
        for i in torch.nonzero(bad).reshape(-1)[: max(limit, 0)].tolist():
            codes = self.codes[i].tolist()
            number, parts = next(
                (n, parts)
                for n, parts in enumerate(self.conditions._coded, start=1)
                if all(bool(allowed[codes[c]]) for c, allowed in parts)
            )
            examples.append({
                "row": i,
                "line": None if self._lines is None else self._lines[i],
                "restriction": number,
                "values": {names[c]: domains[names[c]][codes[c]] for c, _ in parts},
            })
        return total, examples

    def _refuse_violations(self, where: Where | None) -> None:
        total, examples = self.restriction_violations(where)
        if not total:
            return
        shown = "; ".join(_format_violation(e) for e in examples)
        more = f" (first {len(examples)} of {total} shown)" if total > len(examples) else ""
        in_scope = "" if where is None else " (among the rows selected by where)"
        error = DataError(
            f"{total} scenario row(s){in_scope} break a declared restriction: {shown}{more}. Rows are 0-based sample "
            f"indices (row i describes sample i of the data). A scenario the restrictions call impossible cannot "
            f"describe an evaluation sample, and counting it would inflate coverage. Fix: correct those rows in "
            f"{self._source or 'the scenario table'}, or the restriction in the conditions file if the combination "
            f"can occur"
        )
        error.details = {"infeasible_rows": total, "infeasible_row_examples": examples}  # type: ignore[attr-defined]
        raise error

    # ------------------------------------------------------------------ coverage
    def coverage(
        self,
        k: int = 2,
        min_count: int = 1,
        where: Where | None = None,
        propose: int = 5,
        seed: int = 0,
        allow_infeasible_rows: bool = False,
    ) -> CoverageResult:
        """Scenario k-projection coverage (Cheng et al. 2018, §II-A, eq. (1)) with holes and proposals.

        Args:
            k: size of the condition subsets (paper: 2).
            min_count: rows a cell needs to count as covered.
            where: restrict to rows with these values (their domains narrow to them too).
            propose: how many new scenarios to propose (greedy, AETG-style); 0 for none.
            seed: seed of the proposals' random tie-breaking.
            allow_infeasible_rows: count rows that break a restriction instead of refusing them
                (they are listed in ``infeasible_row_examples``).

        No rows give coverage 0 with every cell uncovered. Raises :class:`MetricError` when no
        cell is feasible, and :class:`DataError` listing the rows (0-based index, CSV line and
        values) when rows in scope break a declared restriction, unless ``allow_infeasible_rows``.
        """
        if isinstance(propose, bool) or not isinstance(propose, int) or propose < 0:
            raise ConfigError(f"propose must be a non-negative int, got {propose!r}")
        table = self if where is None else self.select(where)
        where_values = (
            None
            if where is None
            else {
                self.conditions.names[i]: tuple(self.conditions.domains[self.conditions.names[i]][c] for c in chosen)
                for i, chosen in sorted(self._resolve_where(where).items())
            }
        )
        conditions = table.conditions
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(conditions):
            raise ConfigError(f"k must be an int between 1 and the number of conditions ({len(conditions)}), got {k!r}")
        feasible, exact = conditions.cell_feasibility(k)
        if not bool(feasible.any()):
            scope = f" where {_format_where(where_values)}" if where_values else ""
            raise MetricError(
                f"scenario coverage{scope} is undefined: the restrictions make every k={k} cell infeasible; "
                f"relax the restrictions{' or widen where' if scope else ''}"
            )
        if not allow_infeasible_rows:
            self._refuse_violations(where)
        engine = ScenarioCoverageEngine(
            conditions.cardinalities, k=k, min_count=min_count, feasible=feasible, names=conditions.names
        )
        engine.update(table.codes)
        out = engine.compute()
        layout = out.layout
        names, domains = conditions.names, conditions.domains

        def cells(mask: Tensor) -> list[dict[str, str]]:
            flat = torch.nonzero(mask).reshape(-1)
            subset_ids, values = layout.decode(flat)
            result = []
            for s, vals in zip(subset_ids.tolist(), values.tolist()):
                subset = layout.subsets[s]
                result.append({names[c]: domains[names[c]][v] for c, v in zip(subset, vals)})
            return result

        per_subset = [
            SubsetCoverage(
                conditions=tuple(names[c] for c in subset),
                covered=cov,
                total=tot,
                infeasible=inf,
                value=cov / tot if tot else 0.0,
            )
            for subset, cov, tot, inf in zip(
                layout.subsets,
                out.covered_per_subset.tolist(),
                out.total_per_subset.tolist(),
                out.infeasible_per_subset.tolist(),
            )
        ]
        deficit = torch.where(out.feasible, (min_count - out.counts).clamp(min=0), torch.zeros_like(out.counts))
        proposals, closes = _propose(conditions, layout, deficit, propose, seed) if propose else ([], [])
        infeasible_rows, infeasible_examples = self.restriction_violations(where)
        return CoverageResult(
            value=float(out.value),
            covered=int(out.covered),
            total=int(out.total),
            infeasible=int(out.infeasible_per_subset.sum()),
            k=k,
            min_count=min_count,
            n_rows=len(table),
            where=where_values,
            feasibility_exact=exact,
            per_subset=per_subset,
            uncovered=cells(out.uncovered),
            infeasible_cells=cells(~out.feasible),
            proposals=[conditions.decode(p) for p in proposals],
            proposal_closes=closes,
            infeasible_rows=infeasible_rows,
            infeasible_row_examples=infeasible_examples,
        )

    def strategy(self, k: int = 2) -> SearchStrategy[dict[str, str]]:
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
        conditions = self.conditions
        result = self.coverage(k=k, propose=0, allow_infeasible_rows=True)
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


def _format_violation(example: Mapping[str, Any]) -> str:
    line = "" if example["line"] is None else f" (CSV line {example['line']})"
    values = " × ".join(f"{c}={v}" for c, v in example["values"].items())
    return f"row {example['row']}{line}: {values} (restriction #{example['restriction']})"


def count_samples(data: Any) -> int:
    """The number of samples in ``data`` without materialising it where its length is known.

    ``TensorDataset`` and any sized dataset: ``len``; a tensor or array: ``shape[0]``; ``(x, y)``
    or ``{"x": ...}``: rows of ``x``; a ``DataLoader``: the length of its sampler, less a dropped
    last batch (iterated once, counting rows, only when that length is unknown).
    """
    from .loading import as_tensors, iter_batches

    if isinstance(data, torch.utils.data.DataLoader):
        try:  # the samples the loader yields: its sampler's length, less a dropped last batch
            n = len(data.sampler) if data.batch_sampler is not None else len(data.dataset)  # type: ignore[arg-type]
        except TypeError:
            return sum(int(x.shape[0]) for x, _ in iter_batches(data, 1))
        if data.drop_last and data.batch_size:
            n -= n % data.batch_size
        return n
    if isinstance(data, torch.utils.data.TensorDataset):
        return int(data.tensors[0].shape[0])
    if isinstance(data, Mapping) and "x" in data:
        data = data["x"]
    elif isinstance(data, (tuple, list)) and len(data) in (1, 2) and hasattr(data[0], "shape"):
        data = data[0]
    shape = getattr(data, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    if isinstance(data, torch.utils.data.Dataset) and hasattr(data, "__len__"):
        return len(data)  # type: ignore[arg-type]
    return int(as_tensors(data)[0].shape[0])


def check_rows_match(
    table: ScenarioTable, n_samples: int, *, table_fixture: str = "scenario_table", data_fixture: str = "dataset"
) -> None:
    """Refuse a scenario table whose row count differs from the data's sample count.

    Row i of the scenario table describes sample i of the data: extra rows describe no sample
    (and can raise coverage), missing rows leave samples without a scenario (and shift ``where``).
    """
    rows = len(table)
    if rows == n_samples:
        return
    diff = abs(rows - n_samples)
    why = (f"{diff} row(s) describe no sample" if rows > n_samples
           else f"{diff} sample(s) have no scenario row")
    raise MetricError(
        f"the scenario table has {rows} rows but the data has {n_samples} samples (fixtures {table_fixture!r} "
        f"and {data_fixture!r}): {why}; row i of the scenario table must describe sample i of the data. Fix: "
        f"give the scenario file (dnnsafety_scenarios) exactly one row per sample of the evaluation data "
        f"(dnnsafety_data), in the data's order"
    )


def _format_where(where: Mapping[str, Sequence[str]] | None) -> str:
    if not where:
        return ""
    return ", ".join(f"{name}={'|'.join(values)}" for name, values in where.items())


@dataclass(frozen=True)
class SubsetCoverage:
    """Coverage of one k-subset of conditions (one projection table)."""

    conditions: tuple[str, ...]
    covered: int
    total: int
    infeasible: int
    value: float

    def to_details(self) -> dict[str, object]:
        return {
            "conditions": list(self.conditions),
            "covered": self.covered,
            "total": self.total,
            "infeasible": self.infeasible,
            "value": self.value,
        }


@dataclass(frozen=True)
class CoverageResult:
    """Scenario k-projection coverage with its holes (Cheng et al. 2018, §II-A, eq. (1)).

    ``value = covered / total`` over feasible cells; ``infeasible`` cells are excluded and listed
    in ``infeasible_cells``; ``uncovered`` lists every feasible cell below ``min_count`` rows, in
    subset order then mixed-radix order; ``proposals`` are full feasible scenarios that close
    holes (``proposal_closes[i]`` holes closed by the i-th, given the ones before it);
    ``infeasible_rows`` counts data rows that the restrictions declare impossible.
    """

    value: float
    covered: int
    total: int
    infeasible: int
    k: int
    min_count: int
    n_rows: int
    where: dict[str, tuple[str, ...]] | None
    feasibility_exact: bool
    per_subset: list[SubsetCoverage]
    uncovered: list[dict[str, str]]
    infeasible_cells: list[dict[str, str]]
    proposals: list[dict[str, str]]
    proposal_closes: list[int]
    infeasible_rows: int = 0
    infeasible_row_examples: list[dict[str, Any]] = field(default_factory=list)

    def detail(self, max_cells: int = 3) -> str:
        """The facts behind the value: ``k=2, 15/21 cells; uncovered: weather=cloudy × road=mud, …``.

        Lists the first ``max_cells`` uncovered cells (condition=value pairs joined by ' × ',
        '…' when more remain) and mentions excluded infeasible cells and approximate feasibility.
        """
        facts = [f"k={self.k}"]
        if self.min_count != 1:
            facts.append(f"min_count={self.min_count}")
        if self.where:
            facts.append(f"where {_format_where(self.where)}")
        facts.append(f"{self.covered}/{self.total} cells")
        if self.infeasible:
            facts.append(f"{self.infeasible} infeasible excluded")
        if not self.feasibility_exact:
            facts.append("feasibility approximate")
        text = ", ".join(facts)
        if self.uncovered and max_cells > 0:
            shown = [" × ".join(f"{c}={v}" for c, v in cell.items()) for cell in self.uncovered[:max_cells]]
            more = ", …" if len(self.uncovered) > max_cells else ""
            text += f"; uncovered: {', '.join(shown)}{more}"
        elif self.uncovered:
            text += f"; {len(self.uncovered)} uncovered"
        return text

    def summary(self, max_cells: int = 3) -> str:
        """One line: ``0.714 (k=2, 15/21 cells; uncovered: weather=cloudy × road=mud, …)``."""
        return f"{self.value:.3f} ({self.detail(max_cells)})"

    def to_details(self, max_cells: int | None = None) -> dict[str, object]:
        """JSON-able details (plain str/int/float/bool/list/dict); ``max_cells`` caps the cell lists."""

        def capped(cells: list[dict[str, str]]) -> list[dict[str, str]]:
            chosen = cells if max_cells is None else cells[:max_cells]
            return [dict(cell) for cell in chosen]

        return {
            "metric": "scene_coverage",
            "value": self.value,
            "covered": self.covered,
            "total": self.total,
            "infeasible": self.infeasible,
            "k": self.k,
            "min_count": self.min_count,
            "n_rows": self.n_rows,
            "where": None if self.where is None else {c: list(v) for c, v in self.where.items()},
            "feasibility_exact": self.feasibility_exact,
            "infeasible_rows": self.infeasible_rows,
            "infeasible_row_examples": [
                {**e, "values": dict(e["values"])} for e in self.infeasible_row_examples
            ],
            "per_subset": [s.to_details() for s in self.per_subset],
            "n_uncovered": len(self.uncovered),
            "uncovered": capped(self.uncovered),
            "n_infeasible_cells": len(self.infeasible_cells),
            "infeasible_cells": capped(self.infeasible_cells),
            "proposals": [
                {"scenario": dict(p), "closes": c} for p, c in zip(self.proposals, self.proposal_closes)
            ],
        }


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
