"""The plots of the HTML report: matplotlib figures (Agg backend) as inline SVG, one kind per detail.

A plot is keyed by the ``details`` key it draws (see :mod:`.html` for the built-in ones). Its plot
function (:data:`PlotFn`) reads one gate's details and gives the drawings it can make of them, each
returning ``(caption, svg)``, or notes; :func:`_plots` walks a plot table (details key -> plot
function) over one gate and turns a drawing that fails on malformed details into a note. The table
of a run is the one its gate families declare (``Family(plots=...)`` in :mod:`pytest_dnnsafety.gates`);
:data:`BUILTIN_PLOTS`, every plot defined here, stands in when a page is rendered without one.
matplotlib is imported only inside the functions (the optional extra ``pytest-dnnsafety[html]``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from pytest_dnnsafety.report.drawings import (  # the figures themselves
    MAX_GRIDS, MAX_HEATMAPS, cd_diagram, cells_scatter, family_bars, fault_heatmap, map_bars, neuron_bars, number, pair_grid, type2_heatmap, verdict_bar,
    worst_group_index,
)

__all__ = ["Drawing", "PlotFn", "BUILTIN_PLOTS", "plot_pair_grids", "plot_per_neuron_coverage", "plot_cells",
           "plot_families", "plot_verdicts", "plot_faults", "plot_ranking", "plot_map_groups", "plot_type2_matrix"]


# ------------------------------------------------------------------------------------- the plot table

#: One drawing: ``draw()`` -> ``(caption, svg)``; an exception makes it a note on the card instead.
Drawing = Callable[[], tuple[str, str]]

#: A plot function: ``plot(details, prefix)`` -> the drawings (and notes, as str) it makes of one gate's
#: details; nothing when the details hold no data for it. ``prefix`` is unique to the gate's card: a
#: drawing's SVG ids start with it followed by something unique to the drawing (the built-in ones add a
#: letter and a number).
PlotFn = Callable[[Mapping[str, Any], str], Iterable[Drawing | str]]


def plot_pair_grids(details: Mapping[str, Any], prefix: str) -> list[Drawing | str]:
    """Scenario coverage: one heat map per pair of conditions (at most :data:`MAX_GRIDS`, then a note)."""
    grids = details.get("pair_grids")
    if not isinstance(grids, list):
        return []
    min_count = details.get("min_count", 1)
    min_count = min_count if isinstance(min_count, int) and not isinstance(min_count, bool) else 1
    out: list[Drawing | str] = [lambda grid=grid, n=n: pair_grid(grid, max(min_count, 1), f"{prefix}p{n}")
                                for n, grid in enumerate(grids[:MAX_GRIDS])]
    if len(grids) > MAX_GRIDS:
        out.append(f"pair_grids: {len(grids) - MAX_GRIDS} more pairs not drawn (see per_subset in the details)")
    return out


def plot_per_neuron_coverage(details: Mapping[str, Any], prefix: str) -> list[Drawing | str]:
    """Neuron k-activation: one bar per neuron, the gate's value as a line."""
    if not isinstance(details.get("per_neuron_coverage"), list):
        return []
    overall = number(details.get("value"))
    return [lambda: neuron_bars(details["per_neuron_coverage"], f"{prefix}n", overall)]


def plot_cells(details: Mapping[str, Any], prefix: str) -> list[Drawing | str]:
    """pmi (``cells_plot``): each cell's failure rate against its probability mass."""
    if not isinstance(details.get("cells_plot"), dict):
        return []
    return [lambda: cells_scatter(details["cells_plot"], f"{prefix}c")]


def plot_families(details: Mapping[str, Any], prefix: str) -> list[Drawing | str]:
    """Robustness: confidence loss and robust accuracy per perturbation family."""
    if not isinstance(details.get("families"), list):
        return []
    return [lambda: family_bars(details["families"], f"{prefix}f")]


def plot_verdicts(details: Mapping[str, Any], prefix: str) -> list[Drawing | str]:
    """Verified robustness (the counts ``verified``, ``falsified``, ``unknown``): one bar split by verdict."""
    if not all(isinstance(details.get(k), int) and not isinstance(details.get(k), bool)
               for k in ("verified", "falsified", "unknown")):
        return []
    return [lambda: verdict_bar(details, f"{prefix}v")]


def plot_faults(details: Mapping[str, Any], prefix: str) -> list[Drawing | str]:
    """Monitor detection: a fault family × severity heat map per monitor named in the entries (one when none)."""
    faults = details.get("faults")
    if not isinstance(faults, list):
        return []
    metric = details.get("metric") if isinstance(details.get("metric"), str) else "mcc"
    groups: dict[str | None, list[Any]] = {}
    for entry in faults:
        name = entry.get("monitor") if isinstance(entry, dict) else None
        groups.setdefault(None if name is None else str(name), []).append(entry)
    single = len(groups) == 1
    return [lambda entries=entries, monitor=monitor, n=n: fault_heatmap(
        entries, str(metric), f"{prefix}h{n}", None if single else monitor)
        for n, (monitor, entries) in enumerate(list(groups.items())[:MAX_HEATMAPS])]


def plot_ranking(details: Mapping[str, Any], prefix: str) -> list[Drawing | str]:
    """Monitors ranked over benchmarks: the critical-difference diagram."""
    if not isinstance(details.get("ranking"), dict):
        return []
    return [lambda: cd_diagram(details["ranking"], f"{prefix}r")]


def plot_map_groups(details: Mapping[str, Any], prefix: str) -> list[Drawing | str]:
    """Detection mAP: one bar per scenario group with its bootstrap interval and the gated lower bound."""
    if not isinstance(details.get("map_groups"), list):
        return []
    level = number(details.get("confidence"))
    return [lambda: map_bars(details["map_groups"], f"{prefix}m", level, worst_group_index(details))]


def plot_type2_matrix(details: Mapping[str, Any], prefix: str) -> list[Drawing | str]:
    """Multi-label class confusion (``type2_matrix`` with ``classes``): the K × K pair matrix."""
    if not (isinstance(details.get("type2_matrix"), list) and isinstance(details.get("classes"), list)):
        return []
    return [lambda: type2_heatmap(details["type2_matrix"], details["classes"], f"{prefix}t", details)]


#: Every plot defined here, in the order a card shows them: what a page rendered without the table of a
#: run's families draws (the built-in families declare the same functions under the same keys).
BUILTIN_PLOTS: dict[str, PlotFn] = {
    "pair_grids": plot_pair_grids, "per_neuron_coverage": plot_per_neuron_coverage, "cells_plot": plot_cells,
    "families": plot_families, "verdicts": plot_verdicts, "faults": plot_faults, "ranking": plot_ranking,
    "map_groups": plot_map_groups, "type2_matrix": plot_type2_matrix,
}


def _plots(details: Mapping[str, Any], index: int, table: Mapping[str, PlotFn] | None = None
           ) -> tuple[list[dict[str, str]], list[str]]:
    """(plots, notes) of the gate card ``index``: every plot of ``table`` (default :data:`BUILTIN_PLOTS`) the
    details allow, in the table's order; a plot that fails on malformed details becomes a note."""
    import matplotlib  # Figure objects draw without pyplot: no GUI backend is ever selected

    plots: list[dict[str, str]] = []
    notes: list[str] = []
    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False, "font.size": 8,
                                "axes.titlesize": 9}):
        for kind, plot in (BUILTIN_PLOTS if table is None else table).items():
            try:  # a report must not die on one malformed plot (or one faulty plot function)
                made = list(plot(details, f"g{index}"))
            except Exception as exc:
                notes.append(f"{kind}: not drawn ({type(exc).__name__}: {exc})")
                continue
            for item in made:
                if isinstance(item, str):
                    notes.append(item)
                    continue
                try:
                    title, svg = item()
                except Exception as exc:
                    notes.append(f"{kind}: not drawn ({type(exc).__name__}: {exc})")
                else:
                    plots.append({"kind": kind, "title": title, "svg": svg})
    return plots, notes
