"""The scenario table: one row per evaluation sample, read from CSV or built in code; its coverage and row checks.

Part of :mod:`pytest_dnnsafety.scenarios`.
"""

from __future__ import annotations

import csv
import itertools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.projection import ProjectionLayout
from pytest_dnnsafety.engines.coverage.counting import column_major, key_dtype
from pytest_dnnsafety.engines.coverage.scenario import ScenarioCoverageEngine, check_projection_cells
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.files.parsing import NotRegularFile, open_text
from pytest_dnnsafety.runtime import threads
from pytest_dnnsafety.scenarios.conditions import Conditions, Where, _as_value_list, _prefix
from pytest_dnnsafety.scenarios.proposals import _propose, scenario_strategy
from pytest_dnnsafety.scenarios.result import (
    CoverageResult,
    SubsetCoverage,
    _format_where,
    pair_grids_from_counts,
    pair_grids_shown,
)

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy


#: The most k-projection cells :meth:`ScenarioTable.coverage` counts: its result lists every uncovered cell
#: (a dict each: about 0.4 GB and 4 s per million cells), so the cap sits below the coverage engine's
#: ``MAX_CELLS``, as the reliability grid caps the cells it holds (``MAX_GRID_CELLS``).
MAX_TABLE_CELLS = 1 << 22
#: Columns of a scenario CSV that name each row's image (not conditions): matched to COCO data's ids or file names.
JOIN_COLUMNS = ("image_id", "file_name")


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
        #: (codes tensor, its version, its column-major compact copy): see :meth:`_columns`
        self._column_cache: tuple[Tensor, int, Tensor] | None = None
        if isinstance(rows, Tensor):
            self.codes = _check_code_tensor(rows, conditions, source)
        else:
            if isinstance(rows, Mapping) or isinstance(rows, (str, bytes)):
                raise DataError(f"{_prefix(source)}rows must be a sequence of scenario dicts, got {type(rows).__name__}")
            encoded = [conditions.encode(row, f"{_prefix(source)}row {i}") for i, row in enumerate(rows)]
            self.codes = torch.tensor(encoded, dtype=torch.int64).reshape(len(encoded), len(conditions))
        #: the codes as range-checked here (and their version): :meth:`_columns` trusts only these
        self._checked: tuple[Tensor, int] | None = (self.codes, self.codes._version)

    @classmethod
    def from_csv(cls, path: str | Path, conditions: Conditions) -> ScenarioTable:
        """Read a CSV file: header = condition names (any order), one row per evaluation sample."""
        path = Path(path)
        where = f"scenario file {str(path)!r}"
        try:
            handle = open_text(path, newline="", encoding="utf-8-sig")
        except FileNotFoundError:
            raise DataError(f"{where} does not exist; check the dnnsafety_scenarios path") from None
        except NotRegularFile as exc:
            raise DataError(f"{where}: {exc}; refused before opening it. Fix: point dnnsafety_scenarios at a CSV "
                            "file with one row per evaluation sample") from None
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
        join: tuple[str, int] | None = None  # a column of image ids / file names, matched to COCO data
        for j, name in enumerate(header):
            if name in JOIN_COLUMNS and name not in conditions.domains:
                if join is not None:
                    raise DataError(f"{where}, line {header_line}: both {join[0]!r} and {name!r} columns; keep one "
                                    "column that names each row's image")
                join = (name, j)
                continue
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
        if join is not None:
            table._join = (join[0], tuple(columns[join[1]]))
        return table

    def aligned_to(self, data: Any) -> ScenarioTable:
        """The rows in the data's order, when this table (read by :meth:`from_csv`) has an ``image_id`` or
        ``file_name`` column and ``data`` are COCO data (:class:`~pytest_dnnsafety.files.coco.CocoDetectionData`:
        ``image_ids``, ``file_names``); else the table itself (rows matched by position). A missing, extra or
        repeated image is a DataError naming it."""
        join = getattr(self, "_join", None)
        if join is None or getattr(data, "image_ids", None) is None:
            return self
        from pytest_dnnsafety.files.coco import reorder_rows

        rows = reorder_rows(join[1], data, join[0], self._source or "scenario table")
        out = ScenarioTable(self.conditions, self.codes[torch.as_tensor(rows, dtype=torch.int64)], source=self._source)
        if self._lines is not None:
            out._lines = tuple(self._lines[i] for i in rows)
        return out

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

    def _columns(self) -> Tensor:
        """The codes as a contiguous ``(conditions, rows)`` tensor of the narrowest integer dtype (int16 up to
        32,768 values per condition), built once per codes tensor and reused by every :meth:`coverage` call.

        The coverage engine reads its columns as they are (no per-call conversion or range check). Keyed
        on the ``codes`` tensor and its in-place version counter, so a replaced or modified ``codes`` is
        converted and range-checked again.
        """
        codes = self.codes
        cache = getattr(self, "_column_cache", None)
        if cache is not None and cache[0] is codes and cache[1] == codes._version:
            return cache[2]
        checked = getattr(self, "_checked", None)
        if checked is None or checked[0] is not codes or checked[1] != codes._version:
            # not the codes range-checked at construction (replaced or modified since): check them again
            codes = _check_code_tensor(codes, self.conditions, self._source)
        columns = column_major(codes, key_dtype(max(self.conditions.cardinalities)))
        self._column_cache = (self.codes, self.codes._version, columns)
        return columns

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

    def _refuse_violations(self, where: Where | None, found: tuple[int, list[dict[str, Any]]] | None = None) -> None:
        total, examples = self.restriction_violations(where) if found is None else found
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

        Runs on one torch thread (:func:`~pytest_dnnsafety.runtime.threads.host_bound`): the counting
        is a few passes of serial ``bincount`` over the cached int16 columns (:meth:`_columns`), the rest
        small kernels.
        """
        with threads.host_bound():
            return self._coverage(k, min_count, where, propose, seed, allow_infeasible_rows)

    def _coverage(
        self, k: int, min_count: int, where: Where | None, propose: int, seed: int, allow_infeasible_rows: bool
    ) -> CoverageResult:
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
        check_projection_cells(conditions.cardinalities, k, conditions.names, cap=MAX_TABLE_CELLS,
                               why=" (the result lists every uncovered cell)")  # before anything per cell
        feasible, exact = conditions.cell_feasibility(k)
        if not bool(feasible.any()):
            scope = f" where {_format_where(where_values)}" if where_values else ""
            raise MetricError(
                f"scenario coverage{scope} is undefined: the restrictions make every k={k} cell infeasible; "
                f"relax the restrictions{' or widen where' if scope else ''}"
            )
        engine = ScenarioCoverageEngine(
            conditions.cardinalities, k=k, min_count=min_count, feasible=feasible, names=conditions.names
        )
        columns = table._columns()
        engine.update(columns.t(), validate=False)  # the table's codes are range-checked
        out = engine.compute()
        # A row breaking a restriction of at most k conditions lands in a cell that restriction makes
        # infeasible (exact or not, cell_feasibility excludes such cells): with none occupied and no wider
        # restriction, no row breaks one, and the rows need no scan.
        if all(len(parts) <= k for parts in conditions._coded) and not bool((out.counts[~out.feasible] > 0).any()):
            violations: tuple[int, list[dict[str, Any]]] = (0, [])
        else:
            violations = self.restriction_violations(where)
        if not allow_infeasible_rows:
            self._refuse_violations(where, violations)
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
        infeasible_rows, infeasible_examples = violations
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
            pair_grids=_pair_grids(conditions, layout, out.counts, columns),
        )

    def strategy(self, k: int = 2) -> SearchStrategy[dict[str, str]]:
        """A hypothesis strategy of feasible scenario dicts, uncovered k-cells first.

        See :func:`~pytest_dnnsafety.scenarios.proposals.scenario_strategy`.
        """
        return scenario_strategy(self, k)


def _pair_grids(conditions: Conditions, layout: ProjectionLayout, counts: Tensor,
                columns: Tensor) -> list[dict[str, Any]] | None:
    """:func:`~pytest_dnnsafety.scenarios.result.pair_grids`, equal to it, from the k-projection counts.

    Each pair's grid is summed out of a k-subset holding both conditions (k = 2: the counts themselves);
    only k = 1 counts the pairs again, from the cached columns (``columns``, conditions × rows).
    """
    cards = conditions.cardinalities
    n = len(cards)
    if not pair_grids_shown(cards):
        return None
    if n < 2:
        return []
    if layout.k < 2:
        engine = ScenarioCoverageEngine(cards, k=2)
        engine.update(columns.t(), validate=False)
        layout, counts = engine.layout, engine.counts
    pairs = list(itertools.combinations(range(n), 2))
    if layout.k == 2:
        flat = counts
    else:
        source: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}
        for s, subset in enumerate(layout.subsets):
            for a, b in itertools.combinations(range(len(subset)), 2):
                others = tuple(d for d in range(len(subset)) if d not in (a, b))
                source.setdefault((subset[a], subset[b]), (s, others))
        blocks = []
        for pair in pairs:
            s, others = source[pair]
            block = counts[layout.offsets[s] : layout.offsets[s + 1]].view([cards[c] for c in layout.subsets[s]])
            blocks.append(block.sum(others).reshape(-1))
        flat = torch.cat(blocks)  # the k = 2 layout: pairs in combinations order, cells in mixed radix
    return pair_grids_from_counts(conditions, flat)


def _format_violation(example: Mapping[str, Any]) -> str:
    line = "" if example["line"] is None else f" (CSV line {example['line']})"
    values = " × ".join(f"{c}={v}" for c, v in example["values"].items())
    return f"row {example['row']}{line}: {values} (restriction #{example['restriction']})"


def count_samples(data: Any) -> int:
    """The number of samples in ``data`` without materialising it where its length is known.

    :func:`~pytest_dnnsafety.data.forms.known_length` where it knows; otherwise (an unsized loader or
    data in another form) the data is read once and its rows counted.
    """
    from pytest_dnnsafety.data.forms import as_tensors, iter_batches, known_length

    n = known_length(data)
    if n is not None:
        return n
    if isinstance(data, torch.utils.data.DataLoader):
        return sum(int(x.shape[0]) for x, _ in iter_batches(data, 1))
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
