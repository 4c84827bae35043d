"""The drawings of the HTML report's plots: matplotlib figures (Agg backend) as inline SVG.

Each function draws one kind of figure from the values of one gate's details and returns ``(caption,
svg)``; :mod:`pytest_dnnsafety.report.plots` decides which of them a gate's details feed (the plot table).
matplotlib is imported only inside the functions (the optional extra ``pytest-dnnsafety[html]``).
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

__all__ = ["MAX_GRIDS", "MAX_HEATMAPS", "number", "pair_grid", "neuron_bars", "cells_scatter", "family_bars",
           "verdict_bar", "fault_heatmap", "cd_diagram", "map_bars", "type2_heatmap", "worst_group_index",
           "worst_pair_index"]

#: Colours of the plots (the page's CSS uses the same palette).
_GREEN, _AMBER, _RED, _GREY = "#2da44e", "#d4a72c", "#cf222e", "#afb8c1"
_CELL_COLOURS = {"normal": "#0969da", "empty": "#8c959f", "cross_boundary": "#cf222e"}

#: Limits that keep a page readable and its size sane; the JSON evidence keeps everything.
MAX_GRIDS = 36
MAX_ANNOTATED_CELLS = 400
MAX_SCATTER_VECTOR = 3000  # more points than this are rasterized (an inline data: PNG inside the SVG)


def number(value: Any) -> float | None:
    """A float from an evidence number (non-finite ones are strings there), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


_SVG_HEAD = re.compile(r"^.*?(?=<svg\b)", re.S)
_ID = re.compile(r'\bid="([^"]+)"')
_REF = re.compile(r'url\(#([^)]+)\)')
_HREF = re.compile(r'\b(?:xlink:)?href="#([^"]+)"')
_SIZE = re.compile(r'<svg\b([^>]*?)\swidth="([\d.]+)pt"\s+height="([\d.]+)pt"')


def _svg(fig: Any, prefix: str) -> str:
    """The figure as inline SVG: no prologue, no namespace URLs, ids unique to this plot."""
    import io

    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": prefix}):
        fig.savefig(buffer, format="svg", bbox_inches="tight",
                    metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = _SVG_HEAD.sub("", buffer.getvalue(), count=1)
    text = re.sub(r'\sxmlns(:\w+)?="[^"]*"', "", text)
    text = _ID.sub(lambda m: f'id="{prefix}-{m.group(1)}"', text)
    text = _REF.sub(lambda m: f"url(#{prefix}-{m.group(1)})", text)
    text = _HREF.sub(lambda m: f'href="#{prefix}-{m.group(1)}"', text)
    text = _SIZE.sub(lambda m: f'<svg{m.group(1)} width="{float(m.group(2)) * 4 / 3:.0f}" '
                               f'height="{float(m.group(3)) * 4 / 3:.0f}" style="max-width:100%;height:auto" role="img"',
                     text, count=1)
    return text.strip()


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=96, layout="constrained")


def _short(text: Any, width: int = 18) -> str:
    text = str(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def pair_grid(grid: dict[str, Any], min_count: int, prefix: str) -> tuple[str, str]:
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    conditions = [str(c) for c in grid["conditions"]]
    rows, cols = [list(v) for v in grid["values"]]
    counts = np.asarray(grid["counts"], dtype=float)
    if len(conditions) != 2 or counts.shape != (len(rows), len(cols)) or counts.size == 0:
        raise ValueError(f"counts of shape {counts.shape} do not match {len(rows)}×{len(cols)} values")
    # categories: 0 infeasible, 1 uncovered, 2 hit but below min_count, 3 covered
    category = np.where(counts < 0, 0, np.where(counts == 0, 1, np.where(counts < min_count, 2, 3)))
    fig = _figure(min(1.4 + 0.55 * len(cols), 11), min(1.3 + 0.4 * len(rows), 9))
    ax = fig.subplots()
    cmap = ListedColormap([_GREY, _RED, _AMBER, _GREEN])
    ax.pcolormesh(category, cmap=cmap, norm=BoundaryNorm([-0.5, 0.5, 1.5, 2.5, 3.5], cmap.N),
                  edgecolors="white", linewidth=1.5)
    ax.set_xticks(np.arange(len(cols)) + 0.5, [_short(c) for c in cols],
                  rotation=45 if any(len(str(c)) > 4 for c in cols) else 0, ha="right" if len(cols) > 1 else "center")
    ax.set_yticks(np.arange(len(rows)) + 0.5, [_short(r) for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(conditions[1])
    ax.set_ylabel(conditions[0])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    if counts.size <= MAX_ANNOTATED_CELLS:
        for (i, j), count in np.ndenumerate(counts):
            label = "×" if count < 0 else f"{int(count)}"
            ax.text(j + 0.5, i + 0.5, label, ha="center", va="center", fontsize=8,
                    color="#24292f" if category[i, j] in (0, 2) else "white")
    present = sorted(set(category.ravel().tolist()))
    names = {0: "infeasible (×)", 1: "uncovered (0 rows)", 2: f"below min_count={min_count}",
             3: f"covered (≥ {min_count} row{'s' if min_count != 1 else ''})"}
    colours = {0: _GREY, 1: _RED, 2: _AMBER, 3: _GREEN}
    fig.legend(handles=[Patch(color=colours[c], label=names[c]) for c in present], loc="outside lower center",
               ncols=min(len(present), 2), fontsize=7, frameon=False)
    feasible = int((counts >= 0).sum())
    covered = int((category == 3).sum())
    title = f"{conditions[0]} × {conditions[1]}: {covered}/{feasible} feasible cells covered"
    # the title is the figure caption on the page
    return title, _svg(fig, prefix)


def neuron_bars(values: list[Any], prefix: str, overall: float | None) -> tuple[str, str]:
    import numpy as np

    data = np.asarray([number(v) if number(v) is not None else np.nan for v in values], dtype=float)
    if data.ndim != 1 or data.size == 0:
        raise ValueError("per_neuron_coverage is not a non-empty list of numbers")
    fig = _figure(min(3 + 0.09 * data.size, 11), 2.8)
    ax = fig.subplots()
    x = np.arange(data.size)
    colours = np.where(data >= 0.75, _GREEN, np.where(data >= 0.25, _AMBER, _RED))
    if data.size <= 512:
        ax.bar(x, np.nan_to_num(data), width=0.85, color=colours)
    else:
        ax.fill_between(x, np.nan_to_num(data), step="mid", color="#0969da", alpha=0.7)
    if overall is not None and math.isfinite(overall):
        ax.axhline(overall, color="#24292f", linestyle="--", linewidth=1, label=f"gate value {overall:.3f}")
        ax.legend(loc="upper right", fontsize=7, frameon=False)
    ax.set_ylim(0, 1.05)
    ax.set_xlim(-0.7, data.size - 0.3)
    ax.set_xlabel("neuron")
    ax.set_ylabel("k-activation coverage")
    ax.spines[["top", "right"]].set_visible(False)
    low = int((data < 0.25).sum())
    title = f"coverage per neuron ({data.size} neurons, min {np.nanmin(data):.2f}, {low} below 0.25)"
    # the title is the figure caption on the page
    return title, _svg(fig, prefix)


_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _decade(value: float, _position: Any = None) -> str:
    if value <= 0 or not math.isfinite(value):
        return ""
    exponent = math.log10(value)
    if abs(exponent - round(exponent)) > 1e-9:
        return f"{value:g}"
    return "1" if round(exponent) == 0 else "10" + str(int(round(exponent))).translate(_SUPERSCRIPT)


def cells_scatter(plot: dict[str, Any], prefix: str) -> tuple[str, str]:
    import numpy as np

    mass = np.asarray([number(v) if number(v) is not None else np.nan for v in plot["mass"]], dtype=float)
    rate = np.asarray([number(v) if number(v) is not None else np.nan for v in plot["failure_rate"]], dtype=float)
    kinds = [str(t) for t in plot.get("type") or ["cell"] * len(mass)]
    if not (len(mass) == len(rate) == len(kinds)) or len(mass) == 0:
        raise ValueError(f"mass, failure_rate and type differ in length ({len(mass)}, {len(rate)}, {len(kinds)})")
    shown = np.isfinite(mass) & np.isfinite(rate) & (mass > 0)
    fig = _figure(6.2, 3.4)
    ax = fig.subplots()
    kind_array = np.asarray(kinds)
    fallback = iter(["#8250df", "#bf3989", "#1b7c83", "#953800"])
    for kind in dict.fromkeys(kinds):
        pick = shown & (kind_array == kind)
        if not pick.any():
            continue
        colour = _CELL_COLOURS.get(kind) or next(fallback, "#24292f")
        ax.scatter(mass[pick], rate[pick], s=14, alpha=0.75, color=colour, edgecolors="none",
                   label=f"{kind} ({int(pick.sum())})", rasterized=bool(shown.sum() > MAX_SCATTER_VECTOR))
    if shown.any():
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.set_xscale("log")  # mathtext is off (user text is never parsed), so the decades are plain text
        ax.xaxis.set_major_formatter(FuncFormatter(_decade))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("cell probability mass (log)")
    ax.set_ylabel("failure rate in the cell")
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(loc="best", fontsize=7, frameon=False, title="cell type", title_fontsize=7)
    hidden = int(len(mass) - shown.sum())
    title = (f"failure rate vs mass of {len(mass):,} cells"
             + (f" ({hidden} with zero or non-finite mass not shown)" if hidden else ""))
    # the title is the figure caption on the page
    return title, _svg(fig, prefix)


def family_bars(families: list[Any], prefix: str) -> tuple[str, str]:
    import numpy as np

    names = [_short(f.get("name", f.get("family", "?")), 14) for f in families]
    loss = np.asarray([number(f.get("loss")) or 0.0 for f in families], dtype=float)
    acc = np.asarray([number(f.get("robust_accuracy")) or 0.0 for f in families], dtype=float)
    if not names:
        raise ValueError("families is empty")
    fig = _figure(min(2.6 + 0.7 * len(names), 11), 2.8)
    ax = fig.subplots()
    x = np.arange(len(names))
    ax.bar(x - 0.2, loss, width=0.4, color=_RED, label="confidence loss (mean drop of p(true))")
    ax.bar(x + 0.2, acc, width=0.4, color=_GREEN, label="robust accuracy")
    ax.set_xticks(x, names, rotation=30 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center")
    ax.set_ylim(min(0.0, float(loss.min()) - 0.05), 1.05)
    ax.axhline(0, color="#24292f", linewidth=0.6)
    ax.spines[["top", "right"]].set_visible(False)
    fig.legend(loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    worst = names[int(np.argmax(loss))]
    title = f"per perturbation family ({len(names)}): the largest confidence loss is {worst}'s, {loss.max():.3f}"
    return title, _svg(fig, prefix)


def verdict_bar(verdicts: Mapping[str, Any], prefix: str) -> tuple[str, str]:
    parts = [("verified", _GREEN), ("unknown", _GREY), ("falsified", _RED)]
    counts = [int(number(verdicts.get(name)) or 0) for name, _ in parts]
    total = sum(counts)
    if total <= 0:
        raise ValueError("no verdicts")
    fig = _figure(6.2, 1.3)
    ax = fig.subplots()
    left = 0
    for (name, colour), count in zip(parts, counts):
        ax.barh(0, count, left=left, color=colour, label=f"{name} {count}")
        if count / total > 0.08:
            ax.text(left + count / 2, 0, f"{count / total:.0%}", ha="center", va="center", color="white", fontsize=8)
        left += count
    ax.set_xlim(0, total)
    ax.set_yticks([])
    ax.set_xlabel("inputs")
    ax.spines[["top", "right", "left"]].set_visible(False)
    fig.legend(loc="outside right center", fontsize=7, frameon=False)
    title = f"{counts[0]} of {total} inputs verified, {counts[2]} falsified by a counterexample, {counts[1]} unknown"
    return title, _svg(fig, prefix)


#: Metrics of the detection gate for which smaller is better (the heat map's colours flip for them).
_LOWER_IS_BETTER = ("fpr", "fnr", "fpr_at_95tpr", "selective_risk", "model_risk")
MAX_HEATMAPS = 12


def fault_heatmap(entries: list[Any], metric: str, prefix: str, monitor: str | None = None) -> tuple[str, str]:
    """A family × severity heat map of ``metric`` over the detection gate's ``faults`` entries."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    families: list[str] = []
    severities: list[int | None] = []
    cells: dict[tuple[str, int | None], float] = {}
    for entry in entries:
        if not isinstance(entry, dict) or "family" not in entry:
            raise ValueError("a faults entry is not a mapping with a 'family'")
        family = str(entry["family"])
        raw = entry.get("severity")
        if raw is not None and (isinstance(raw, bool) or number(raw) is None):
            raise ValueError(f"severity {raw!r} of {family} is not a number")
        severity = None if raw is None else int(number(raw) or 0)
        if (family, severity) in cells:
            raise ValueError(f"two entries for {family} at severity {severity}")
        value = number(entry.get(metric))
        cells[(family, severity)] = math.nan if value is None else value
        if family not in families:
            families.append(family)
        if severity not in severities:
            severities.append(severity)
    if not cells:
        raise ValueError("faults is empty")
    columns = sorted(s for s in severities if s is not None) + ([None] if None in severities else [])
    grid = np.full((len(families), len(columns)), np.nan)
    present = np.zeros_like(grid, dtype=bool)
    for (family, severity), value in cells.items():
        i, j = families.index(family), columns.index(severity)
        grid[i, j] = value
        present[i, j] = True
    finite = grid[np.isfinite(grid)]
    lo, hi = (-1.0, 1.0) if metric == "mcc" else (0.0, 1.0)
    if finite.size:
        lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    lower_better = metric in _LOWER_IS_BETTER
    cmap = colormaps["RdYlGn_r" if lower_better else "RdYlGn"].with_extremes(bad=_GREY)
    norm = Normalize(vmin=lo, vmax=hi)
    fig = _figure(min(2.4 + 0.62 * len(columns), 10), min(1.2 + 0.3 * len(families), 9))
    ax = fig.subplots()
    mesh = ax.pcolormesh(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, edgecolors="white", linewidth=1.5)
    ax.set_xticks(np.arange(len(columns)) + 0.5, ["–" if c is None else str(c) for c in columns])
    ax.set_yticks(np.arange(len(families)) + 0.5, [_short(f, 22) for f in families])
    ax.invert_yaxis()
    ax.set_xlabel("severity")
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    if grid.size <= MAX_ANNOTATED_CELLS:
        for (i, j), value in np.ndenumerate(grid):
            if not present[i, j]:
                continue
            if math.isfinite(value):
                red, green, blue, _ = cmap(norm(value))
                dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
                ax.text(j + 0.5, i + 0.5, f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if dark else "#24292f")
            else:
                ax.text(j + 0.5, i + 0.5, "n/a", ha="center", va="center", fontsize=7, color="#24292f")
    fig.colorbar(mesh, ax=ax, shrink=0.9, label=metric + (" (lower is better)" if lower_better else ""))
    title = f"{metric} per fault family × severity" + (f" — {monitor}" if monitor else "")
    if finite.size:
        pick = np.nanargmax(grid) if lower_better else np.nanargmin(grid)
        i, j = np.unravel_index(pick, grid.shape)
        where = families[i] + ("" if columns[j] is None else f" at severity {columns[j]}")
        title += f"; worst: {where}, {grid[i, j]:.3f}"
    return title, _svg(fig, prefix)


def cd_diagram(ranking: dict[str, Any], prefix: str) -> tuple[str, str]:
    """Demšar's (2006) critical-difference diagram: average ranks on an axis, cliques as thick bars."""
    import numpy as np

    names = [str(m) for m in ranking["monitors"]]
    ranks = np.asarray([number(r) if number(r) is not None else np.nan for r in ranking["average_ranks"]],
                       dtype=float)
    k = len(names)
    if k < 2 or ranks.shape != (k,) or not np.isfinite(ranks).all():
        raise ValueError(f"{k} monitors and {ranks.size} finite average ranks: need the same number, at least 2")
    cd = number(ranking.get("cd"))
    cliques: list[list[int]] = []
    for clique in ranking.get("cliques") or []:
        members = [int(i) for i in clique]
        if any(not 0 <= i < k for i in members):
            raise ValueError(f"clique {members} names a monitor outside 0..{k - 1}")
        if len(members) >= 2:
            cliques.append(members)
    low = 1.0
    high = float(max(k, math.ceil(float(ranks.max()))))
    order = [int(i) for i in np.argsort(ranks, kind="stable")]
    half = (k + 1) // 2
    left, right = order[:half], order[half:][::-1]  # no crossing lines: outermost rank on the top row
    rows = max(len(left), len(right))
    clique_y = [0.35 + 0.22 * n for n in range(len(cliques))]
    label_top = (clique_y[-1] if clique_y else 0.2) + 0.4
    row_y = [label_top + 0.32 * n for n in range(rows)]
    span = high - low
    margin = max(0.55 * span, 1.2)
    fig = _figure(7.2, 1.1 + 0.26 * (rows + len(cliques)))
    ax = fig.subplots()
    ax.set_xlim(low - margin, high + margin)
    ax.set_ylim(row_y[-1] + 0.3, -0.9)
    ax.axis("off")
    ax.plot([low, high], [0, 0], color="#24292f", linewidth=1)
    for tick in np.arange(low, high + 0.01, 0.5):
        major = abs(tick - round(tick)) < 1e-9
        ax.plot([tick, tick], [0, -0.12 if major else -0.06], color="#24292f", linewidth=0.8)
        if major:
            ax.text(tick, -0.17, f"{round(tick)}", ha="center", va="bottom", fontsize=7)
    if cd is not None and math.isfinite(cd) and cd > 0:
        end = low + cd
        ax.plot([low, end], [-0.62, -0.62], color=_RED, linewidth=1.2)
        for x in (low, end):
            ax.plot([x, x], [-0.68, -0.56], color=_RED, linewidth=1.2)
        ax.text((low + end) / 2, -0.7, f"CD = {cd:.3f}", ha="center", va="bottom", fontsize=7, color=_RED)
    for y, members in zip(clique_y, cliques):
        values = ranks[members]
        ax.plot([values.min() - 0.03, values.max() + 0.03], [y, y], color="#24292f", linewidth=3.5,
                solid_capstyle="round")
    for side, methods in (("left", left), ("right", right)):
        for y, method in zip(row_y, methods):
            x = float(ranks[method])
            edge = low - 0.15 * margin if side == "left" else high + 0.15 * margin
            ax.plot([x, x, edge], [0, y, y], color="#57606a", linewidth=0.8)
            ax.text(edge + (-0.05 if side == "left" else 0.05), y, f"{_short(names[method], 24)} ({x:.2f})",
                    ha="right" if side == "left" else "left", va="center", fontsize=7)
    n_blocks = ranking.get("n_blocks")
    alpha = number(ranking.get("alpha"))
    pvalue = number(ranking.get("pvalue"))
    title = f"average ranks of {k} monitors (1 = best)"
    if isinstance(n_blocks, int) and not isinstance(n_blocks, bool):
        title += f" over {n_blocks} blocks"
    if pvalue is not None:
        title += f"; Friedman p = {pvalue:.3g}"
    if cd is not None:
        title += f"; Nemenyi CD = {cd:.3f}" + (f" at α = {alpha:g}" if alpha is not None else "")
        title += "; bars join monitors not significantly different"
    return title, _svg(fig, prefix)


def _finite(value: Any) -> float | None:
    got = number(value)
    return got if got is not None and math.isfinite(got) else None


def worst_group_index(details: Mapping[str, Any]) -> int:
    """The index in ``details["map_groups"]`` of the worst group, as the gate chose it: the group that
    ``details["worst_group"]`` names (the one the gate's summary names), else the gate's own rule — the smallest
    gated number (``lower``, or ``map`` with ``statistic="estimate"``; a missing lower bound falls back to the mAP),
    ties broken by the smaller mAP, then by the groups' order. The card text and the plot caption both come from
    this choice, so they never name different groups on a tie."""
    rows = details.get("map_groups")
    if not isinstance(rows, list) or not rows:
        raise ValueError("map_groups is not a non-empty list of groups")
    named = details.get("worst_group")
    if isinstance(named, str):
        for i, row in enumerate(rows):
            if isinstance(row, Mapping) and row.get("group") == named and _finite(row.get("map")) is not None:
                return i
    key = "map" if details.get("statistic") == "estimate" else "lower"

    def rank(i: int) -> tuple[float, float, int]:
        row = rows[i] if isinstance(rows[i], Mapping) else {}
        point = _finite(row.get("map"))
        gated = _finite(row.get(key))
        gated = point if gated is None else gated
        return (math.inf if gated is None else gated, math.inf if point is None else point, i)

    return min(range(len(rows)), key=rank)


def worst_pair_index(details: Mapping[str, Any], matrix: Any, classes: list[Any]) -> tuple[int, int] | None:
    """The (row, column) of the worst type-2 pair, as the gate chose it: the pair ``details["type2_worst"]`` names
    (the largest value over the pairs with ``min_support``), else the first largest defined cell of the upper
    triangle (the gate's order); None when no cell is defined."""
    import numpy as np

    worst = details.get("type2_worst")
    pair = worst.get("pair") if isinstance(worst, Mapping) else None
    names = [str(c) for c in classes]
    if isinstance(pair, list) and len(pair) == 2 and all(str(c) in names for c in pair):
        i, j = names.index(str(pair[0])), names.index(str(pair[1]))
        if math.isfinite(matrix[i, j]):
            return i, j
    k = matrix.shape[0]
    iu = np.triu_indices(k, 1)
    values = matrix[iu]
    if not np.isfinite(values).any():
        return None
    best = int(np.nanargmax(np.where(np.isfinite(values), values, -np.inf)))
    return int(iu[0][best]), int(iu[1][best])


def map_bars(rows: list[Any], prefix: str, confidence: float | None, worst: int | None = None) -> tuple[str, str]:
    """min_detection_map: one bar per scenario group (point mAP), the bootstrap interval as an error bar and
    its lower bound (the gated number) as a marker; the worst group's bar is red (``worst``: its index, by
    default :func:`worst_group_index` of the rows alone)."""
    import numpy as np

    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError("map_groups is not a non-empty list of groups")
    names = [_short(r.get("group", "?"), 22) for r in rows]
    point = np.asarray([number(r.get("map")) if number(r.get("map")) is not None else np.nan for r in rows])
    lower = np.asarray([number(r.get("lower")) if number(r.get("lower")) is not None else np.nan for r in rows])
    upper = np.asarray([number(r.get("upper")) if number(r.get("upper")) is not None else np.nan for r in rows])
    if not np.isfinite(point).any():
        raise ValueError("no group has a finite mAP")
    worst = worst_group_index({"map_groups": rows}) if worst is None else worst
    fig = _figure(min(2.6 + 0.6 * len(rows), 11), 3.0)
    ax = fig.subplots()
    x = np.arange(len(rows))
    colours = [_RED if i == worst else "#0969da" for i in range(len(rows))]
    ax.bar(x, np.nan_to_num(point), width=0.7, color=colours, alpha=0.85, label="mAP (estimate)")
    has = np.isfinite(lower) & np.isfinite(upper) & np.isfinite(point)
    if has.any():
        err = np.vstack([np.clip(point - lower, 0, None), np.clip(upper - point, 0, None)])[:, has]
        ax.errorbar(x[has], point[has], yerr=err, fmt="none", ecolor="#24292f", elinewidth=1, capsize=3,
                    label="bootstrap interval")
        level = f"{confidence:.0%} " if confidence is not None else ""
        ax.scatter(x[has], lower[has], marker="_", s=220, linewidths=2.2, color="#24292f", zorder=3,
                   label=f"{level}lower bound (gated)")
    ax.set_xticks(x, names, rotation=30 if len(rows) > 4 else 0, ha="right" if len(rows) > 4 else "center")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("mAP")
    ax.spines[["top", "right"]].set_visible(False)
    fig.legend(loc="outside lower center", ncols=3, fontsize=7, frameon=False)
    bound = "" if not np.isfinite(lower[worst]) else f", lower bound {lower[worst]:.3f}"
    title = (f"mAP per scenario group ({len(rows)}): the worst is {rows[worst].get('group', '?')}, "
             f"{point[worst]:.3f}{bound}")
    return title, _svg(fig, prefix)


def type2_heatmap(matrix: list[Any], classes: list[Any], prefix: str,
                  details: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """max_class_confusion (multi-label ground truth): the K × K type-2 pair matrix, undefined pairs grey; the
    caption names the gate's worst pair (:func:`worst_pair_index` of the gate's ``details``)."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    grid = np.asarray([[number(v) if number(v) is not None else np.nan for v in row] for row in matrix],
                      dtype=float)
    k = len(classes)
    if grid.ndim != 2 or grid.shape != (k, k) or k == 0:
        raise ValueError(f"type2_matrix of shape {grid.shape} does not match {k} classes")
    names = [_short(c, 14) for c in classes]
    cmap = colormaps["Reds"].with_extremes(bad=_GREY)
    fig = _figure(min(2.4 + 0.42 * k, 11), min(1.8 + 0.36 * k, 10))
    ax = fig.subplots()
    mesh = ax.pcolormesh(np.ma.masked_invalid(grid), cmap=cmap, norm=Normalize(0.0, 1.0), edgecolors="white",
                         linewidth=1)
    ax.set_xticks(np.arange(k) + 0.5, names, rotation=45 if k > 3 else 0, ha="right" if k > 3 else "center")
    ax.set_yticks(np.arange(k) + 0.5, names)
    ax.invert_yaxis()
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    if k * k <= MAX_ANNOTATED_CELLS:
        for (i, j), value in np.ndenumerate(grid):
            text = "–" if not math.isfinite(value) else f"{value:.2f}"
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=6,
                    color="white" if math.isfinite(value) and value > 0.6 else "#24292f")
    fig.colorbar(mesh, ax=ax, shrink=0.9, label="type-2 confusion (higher is worse)")
    finite = np.isfinite(grid)
    title = f"type-2 confusion per class pair ({k} classes, {int(finite.sum())} defined cells)"
    pick = worst_pair_index(details or {}, grid, classes)
    if pick is not None:
        i, j = pick
        title += f"; worst pair {classes[i]} / {classes[j]}, {grid[i, j]:.3f}"
    return title, _svg(fig, prefix)


