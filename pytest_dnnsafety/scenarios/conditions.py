"""Operating conditions: value domains, restrictions (cell feasibility) and the conditions TOML file.

Part of :mod:`pytest_dnnsafety.scenarios`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Union

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.projection import ProjectionLayout
from pytest_dnnsafety.engines.coverage.scenario import check_projection_cells
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.files.parsing import NotRegularFile, TooDeep, check_depth, open_regular

#: Largest number of joint assignments of one group of restricted conditions that is
#: enumerated to decide cell feasibility exactly; larger groups fall back to a sufficient check.
EXACT_FEASIBILITY_LIMIT = 20_000_000



def _exact_limit() -> int:
    """:data:`EXACT_FEASIBILITY_LIMIT` as currently set on :mod:`pytest_dnnsafety.scenarios`.

    The public module re-exports the constant; reading it there keeps an override of
    ``pytest_dnnsafety.scenarios.EXACT_FEASIBILITY_LIMIT`` effective (as before the package split).
    """
    public = sys.modules.get("pytest_dnnsafety.scenarios")  # loaded: this module is part of it (no import cycle)
    return int(getattr(public, "EXACT_FEASIBILITY_LIMIT", EXACT_FEASIBILITY_LIMIT))


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
            with open_regular(path) as handle:
                text = handle.read().decode("utf-8")
            data = tomllib.loads(text)
            check_depth(data)
        except FileNotFoundError:
            raise DataError(f"{where} does not exist; check the dnnsafety_conditions path") from None
        except NotRegularFile as exc:
            raise DataError(f"{where}: {exc}; refused before opening it. Fix: point dnnsafety_conditions at a TOML "
                            "file with a [conditions] table") from None
        except UnicodeDecodeError as exc:
            raise DataError(f"{where} is not UTF-8 text ({exc}); save it as UTF-8") from None
        except tomllib.TOMLDecodeError as exc:
            raise DataError(f"{where} is not valid TOML: {exc}; fix the syntax") from None
        except (RecursionError, TooDeep):
            raise DataError(f"{where} cannot be read: {TooDeep()}; declare each condition's domain as a flat "
                            'list, e.g. [conditions] weather = ["sunny", "rainy"]') from None
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
        check_projection_cells(self.cardinalities, k, self._names)  # one bool per cell: refused before allocating
        layout = ProjectionLayout(self.cardinalities, k)
        feasible = torch.ones(layout.total, dtype=torch.bool)
        exact = True
        for conds, rs in self._components:
            cond_set = set(conds)
            if self._component_size(conds) <= _exact_limit():
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

    def subset_feasibility(self, columns: Sequence[int]) -> Tensor:
        """Feasibility of every value combination of the conditions ``columns`` (bool, ``∏`` of their sizes).

        Mixed radix in the given order, first condition most significant: the ``by=`` groups'
        layout. Equal to the subset's block of :meth:`cell_feasibility` (exact where that is exact),
        but computed for this subset alone, so large conditions outside it cost nothing. The caller
        bounds the product of the sizes (:mod:`.groups` checks it against ``MAX_GROUPS``).
        """
        columns = tuple(columns)
        cards = [len(self._domains[self._names[c]]) for c in columns]
        size = math.prod(cards)
        feasible = torch.ones(size, dtype=torch.bool)
        if not self._coded or not columns:
            return feasible
        cells = _product_codes(cards, 0, size)
        for conds, rs in self._components:
            cond_set = set(conds)
            inside = [j for j, c in enumerate(columns) if c in cond_set]
            if not inside:
                continue
            if self._component_size(conds) <= _exact_limit():
                part = tuple(columns[j] for j in inside)
                tables = self._projection_tables(conds, rs, {part})
                if tables is None:  # this group admits no assignment at all: nothing is feasible
                    return torch.zeros(size, dtype=torch.bool)
                table, strides = tables[part]
                feasible &= table[(cells[:, inside] * torch.tensor(strides, dtype=torch.int64)).sum(1)]
            else:  # the sufficient check of cell_feasibility: restrictions lying wholly inside the subset
                for r in rs:
                    parts = self._coded[r]
                    if all(cond in columns for cond, _ in parts):
                        match = torch.ones(size, dtype=torch.bool)
                        for cond, allowed in parts:
                            match &= allowed[cells[:, columns.index(cond)]]
                        feasible &= ~match
        return feasible

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
            if self._component_size(conds) <= _exact_limit():
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
