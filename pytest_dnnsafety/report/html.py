"""The HTML report (``--dnnsafety-html=PATH``): one self-contained page per run for a reviewer.

The page is rendered from the evidence dict that :func:`~pytest_dnnsafety.report.evidence.build_evidence`
builds (the same dict the JSON evidence file holds), so the page and the JSON can never disagree,
and nothing is recomputed. It holds:

* the verdict of the run first (a banner), then the count of gates by verdict;
* the run's header: versions, device, seed, workers, created time, the configured inputs and their
  sha256 digests, the shared forward passes (each timed as its own row: images, seconds, images/s,
  the gate that needed it first; not counted in the gates' seconds), and the tests whose gates were lost;
  a page from an evidence dict with ``"complete": false`` says the run did not finish;
* an index of the gates (failing ones first) linking to one card per gate: verdict with its colour,
  the compared number (the bound when there is one) against the threshold and operator, the
  summary line, the baseline comparison (``gate["baseline"]``, when present), the inputs the gate
  read with their origin and fingerprints (``gate["inputs"]``), plots, and the details as a
  collapsible table (nested values as JSON);
* plots, only where the engine put the data for them in ``details``:
  ``pair_grids`` (scenario coverage: a heat map per pair of conditions, covered / below
  ``min_count`` / uncovered / infeasible, annotated with the row counts), ``per_neuron_coverage``
  (neuron k-activation: one bar per neuron), ``cells_plot`` (pmi: failure rate against the
  cell's probability mass, log scale, coloured by cell type), ``families`` (robustness: confidence
  loss and robust accuracy per perturbation family) and the counts ``verified``, ``falsified`` and
  ``unknown`` (verified robustness: one bar split by verdict), ``faults`` (monitor detection: a
  fault family × severity heat map of ``details["metric"]``, one per monitor when the entries name
  one), ``ranking`` (monitors ranked over benchmarks: Demšar's critical-difference diagram),
  ``map_groups`` (detection mAP: one bar per scenario group with its bootstrap interval and the gated
  lower bound marked) and ``type2_matrix`` with ``classes`` (multi-label class confusion: the K × K
  type-2 pair matrix as a heat map, undefined pairs grey). Those are the built-in families' plots; a
  run passes the plot table its families declare (``plots=``, details key -> plot function of
  :mod:`.plots`), so a family of a plugin or ``conftest.py`` adds its own. Without a table the
  built-in plots are drawn.

Self-contained: the plots are inline SVG (matplotlib, Agg backend, text as ``<text>``, the XML
prologue and namespace URLs removed, ids made unique per plot), styles and the small script are
inline, and a Content-Security-Policy forbids every network load (``default-src 'none'``), so a
stray external reference would show as a console error rather than a silent fetch. All text from
the run (node ids, summaries, condition names and values, details) is escaped: jinja2's
autoescaping for the page, matplotlib's XML writer (with mathtext off) for the plots.

jinja2 and matplotlib are the optional extra ``pytest-dnnsafety[html]``; they are imported only
when a page is written or its path is checked. A plot that cannot be drawn from malformed details
becomes a note on its card; it never costs the page.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.results import STATUSES, format_numbers
from pytest_dnnsafety.report.drawings import number as as_number
from pytest_dnnsafety.report.plots import BUILTIN_PLOTS, PlotFn, _plots  # a card's plots (inline SVG)

__all__ = ["EXTRA_MESSAGE", "require_html_extra", "check_html_path", "render_html", "write_html", "VERDICT_ORDER"]

EXTRA_MESSAGE = "--dnnsafety-html needs the optional extra: pip install 'pytest-dnnsafety[html]'"

#: status -> (verdict text, css class); the order of the page's index and cards: worst first.
VERDICTS = {
    "failed": ("FAIL", "failed"),
    "error": ("ERROR", "error"),
    "inconclusive": ("INCONCLUSIVE", "inconclusive"),
    "lost": ("LOST", "lost"),
    "not-evaluated": ("NOT RUN", "not-evaluated"),
    "passed": ("PASS", "passed"),
}
VERDICT_ORDER = list(VERDICTS)


#: The most characters of a nested detail shown on the page; the JSON evidence keeps everything.
MAX_JSON_CHARS = 200_000


def require_html_extra() -> tuple[Any, Any]:
    """Import jinja2 and matplotlib, or raise a ConfigError naming the extra."""
    try:
        import jinja2
        import matplotlib
    except ImportError as exc:
        raise ConfigError(f"{EXTRA_MESSAGE} ({exc})") from None
    return jinja2, matplotlib


def check_html_path(path: Path) -> None:
    """At session start: the extra is installed and ``path`` can receive the page.

    Raises :class:`ConfigError` when the extra is missing, :class:`IsADirectoryError` for a folder
    and :class:`OSError` when the folder cannot be created or written. A page left by an earlier
    run is removed, so a crashed run leaves no page that looks current.
    """
    from pytest_dnnsafety.report.evidence import prepare_evidence_path

    require_html_extra()
    prepare_evidence_path(path)


def write_html(path: Path, evidence: dict[str, Any], plots: Mapping[str, PlotFn] | None = None) -> Path:
    """Render ``evidence`` (from ``build_evidence``) and write the page atomically to ``path``.

    ``plots``: the run's plot table (details key -> plot function); None draws the built-in plots.
    """
    from pytest_dnnsafety.report.evidence import write_text_atomic

    return write_text_atomic(Path(path), render_html(evidence, plots))


# -- numbers and text -------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    number = as_number(value)
    if number is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(number):
        return str(number)
    if number != 0 and (abs(number) < 1e-3 or abs(number) >= 1e5):
        return f"{number:.3e}"
    return f"{number:.3f}"


def _fmt_row(*values: Any) -> list[str]:
    """:func:`_fmt` of numbers shown side by side (value, bound, threshold): finite floats get enough digits
    that different numbers print differently (:func:`~pytest_dnnsafety.results.format_numbers`)."""
    plain = [isinstance(v, float) and math.isfinite(v) for v in values]
    texts = format_numbers(*(v if ok else None for v, ok in zip(values, plain)))
    return [t if ok else _fmt(v) for v, t, ok in zip(values, texts, plain)]


def _json(value: Any) -> str:
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False, default=str)
    if len(text) > MAX_JSON_CHARS:
        text = text[:MAX_JSON_CHARS] + f"\n… ({len(text) - MAX_JSON_CHARS:,} more characters in the JSON evidence)"
    return text


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


# -- the page ---------------------------------------------------------------------------------

def _inputs(inputs: Any) -> list[dict[str, Any]]:
    """A gate's inputs as rows: role, fixture, origin lines, type, digest, other facts."""
    rows = []
    for role, record in (inputs or {}).items():
        if not isinstance(record, dict):
            rows.append({"role": role, "fixture": "", "origin": [str(record)], "type": "", "digest": None,
                         "facts": []})
            continue
        origin = record.get("origin") or {}
        lines: list[str] = []
        if isinstance(origin, dict):
            kind = origin.get("kind", "")
            scope = origin.get("scope")
            lines.append(f"{kind}" + (f" ({scope} scope)" if scope else ""))
            for name, setting in (origin.get("settings") or {}).items():
                if isinstance(setting, dict):
                    text = f"{setting.get('setting', name)} = {setting.get('spec', '')}"
                    if setting.get("source"):
                        text += f" — from {setting['source']}"
                    if setting.get("sha256"):
                        text += f" — file {setting['sha256']}"
                    lines.append(text)
            where = [str(origin[k]) for k in ("file", "line") if origin.get(k) is not None]
            if where:
                lines.append(":".join(where) + (f" {origin['function']}" if origin.get("function") else ""))
            for key, value in origin.items():
                if key not in ("kind", "scope", "settings", "file", "line", "function"):
                    lines.append(f"{key}: {value if _scalar(value) else json.dumps(value, default=str)}")
        else:
            lines.append(str(origin))
        facts = [f"{k}: {_fmt(v) if _scalar(v) else json.dumps(v, default=str)}" for k, v in record.items()
                 if k not in ("fixture", "origin", "type", "digest")]
        rows.append({"role": role, "fixture": record.get("fixture", ""), "origin": lines,
                     "type": record.get("type", ""), "digest": record.get("digest"), "facts": facts})
    return rows


def _gauge(gate: dict[str, Any]) -> dict[str, float] | None:
    """Positions (in %) of the compared number and the threshold on a 0..1 scale, if both lie there."""
    compared = as_number(gate.get("bound")) if gate.get("bound") is not None else as_number(gate.get("value"))
    threshold = as_number(gate.get("threshold"))
    if compared is None or threshold is None or not (0 <= compared <= 1 and 0 <= threshold <= 1):
        return None
    return {"value": round(compared * 100, 2), "threshold": round(threshold * 100, 2)}


def _traceback(value: Any) -> str | None:
    if not value:
        return None
    if isinstance(value, list):
        return "\n".join(str(line).rstrip("\n") for line in value)
    return str(value)


def _card(gate: dict[str, Any], index: int, table: Mapping[str, PlotFn]) -> dict[str, Any]:
    status = str(gate.get("status", ""))
    verdict, css = VERDICTS.get(status, (status.upper() or "?", "unknown"))
    details = gate.get("details") if isinstance(gate.get("details"), dict) else {}
    plots, notes = _plots(details, index, table)
    op = gate.get("op")
    symbol = {">=": "≥", "<=": "≤"}.get(op, op or "")
    has_bound = gate.get("bound") is not None
    compared = gate.get("bound") if has_bound else gate.get("value")
    path, _, name = str(gate.get("nodeid", "")).partition("::")
    problem = None
    if status in ("error", "not-evaluated", "lost", "inconclusive"):
        problem = {k: details[k] for k in ("error_type", "error", "reason", "violations", "traceback")
                   if details.get(k) not in (None, "", [])}
    scalars = [(k, _fmt(v)) for k, v in details.items() if _scalar(v) and k not in ("traceback",)]
    # the data of the plots is kept as JSON under the card, apart from the other nested details
    nested = [(k, _json(v)) for k, v in details.items() if not _scalar(v) and k not in table]
    plotted = [(k, _json(details[k])) for k in table if k in details]
    baseline = gate.get("baseline") if isinstance(gate.get("baseline"), dict) else None
    value, bound, threshold, compared_text = _fmt_row(gate.get("value"), gate.get("bound"), gate.get("threshold"),
                                                      compared)
    return {
        "anchor": f"gate-{index}",
        "status": status,
        "verdict": verdict,
        "css": css,
        "nodeid": gate.get("nodeid", ""),
        "path": path,
        "name": name or path,
        "marker": gate.get("marker", ""),
        "metric": gate.get("metric", ""),
        "op": symbol,
        "value": value,
        "bound": bound if has_bound else None,
        "compared": compared_text,
        "compared_what": "bound" if has_bound else "value",
        "threshold": threshold,
        "summary": gate.get("summary", ""),
        "seconds": _fmt(gate.get("seconds")),
        "device": gate.get("device", ""),
        "gauge": _gauge(gate),
        "problem": problem,
        "traceback": _traceback(details.get("traceback")),
        "baseline": None if baseline is None else {
            "status": baseline.get("status", ""),
            "rows": [(k, _fmt(baseline.get(k))) for k in ("baseline_value", "change", "limit")
                     if k in baseline],
            "message": baseline.get("message", ""),
            "other": [(k, _fmt(v) if _scalar(v) else json.dumps(v, default=str)) for k, v in baseline.items()
                      if k not in ("status", "baseline_value", "change", "limit", "message")],
        },
        "inputs": _inputs(gate.get("inputs")),
        "plots": plots,
        "plot_notes": notes,
        "scalars": scalars,
        "nested": nested,
        "plotted": plotted,
    }


def _ordered(gates: Iterable[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    rank = {s: i for i, s in enumerate(VERDICT_ORDER)}
    indexed = list(enumerate(gates))
    return sorted(indexed, key=lambda pair: (rank.get(pair[1].get("status"), -1), pair[0]))


def render_html(evidence: dict[str, Any], plots: Mapping[str, PlotFn] | None = None) -> str:
    """The page for ``evidence`` as a string (see the module docstring); ``plots``: the run's plot table
    (details key -> plot function), None for the built-in plots."""
    jinja2, _ = require_html_extra()
    template_text = resources.files(__package__).joinpath("templates", "report.html.j2").read_text("utf-8")
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)
    env.filters["fmt"] = _fmt
    template = env.from_string(template_text)

    gates = [g for g in evidence.get("gates", []) if isinstance(g, dict)]
    table = BUILTIN_PLOTS if plots is None else plots
    cards = [_card(gate, index, table) for index, gate in _ordered(gates)]
    summary = evidence.get("summary") or {}
    counts = [{"status": s, "verdict": VERDICTS[s][0], "css": VERDICTS[s][1],
               "count": summary.get(s, sum(g.get("status") == s for g in gates))} for s in VERDICT_ORDER]
    total = summary.get("total", len(gates))
    bad = [c for c in counts if c["status"] != "passed" and c["count"]]
    lost = list(evidence.get("lost") or [])
    if not gates:
        overall = ("NO GATES", "not-evaluated", "the run recorded no gate")
    elif bad or lost:
        overall = ("FAILED", "failed", ", ".join(f"{c['count']} {c['verdict'].lower()}" for c in bad)
                   + f" of {total} gate{'s' if total != 1 else ''}; only PASS passes")
    else:
        overall = ("PASSED", "passed", f"all {total} gate{'s' if total != 1 else ''} passed")

    env_info = dict(evidence.get("environment") or {})
    env_inputs = env_info.pop("inputs", {}) or {}
    inputs_note = env_info.pop("inputs_note", None)
    header_keys = ("pytest_dnnsafety", "torch", "numpy", "pytest", "python", "platform", "device", "seed",
                   "workers", "cwd")
    header = [(k, env_info.pop(k)) for k in header_keys if k in env_info]
    header += [(k, v if _scalar(v) else json.dumps(v, default=str)) for k, v in env_info.items()]
    run_inputs = []
    for role, record in env_inputs.items():
        record = record if isinstance(record, dict) else {"spec": record}
        run_inputs.append({"role": role, "spec": record.get("spec", ""), "source": record.get("source", ""),
                           "path": record.get("path"), "digest": record.get("digest"),
                           "other": [f"{k}: {v}" for k, v in record.items()
                                     if k not in ("spec", "source", "path", "digest")]})
    passes = [{"what": f"{p.get('model') or 'model'} × {p.get('data') or 'data'}",
               "layers": ", ".join(str(x) for x in p.get("layers") or []) or "outputs only",
               "images": p.get("images") if p.get("images") is not None else "–", "seconds": _fmt(p.get("seconds")),
               "rate": _fmt(p.get("images_per_second")) if p.get("images_per_second") is not None else "–",
               "by": f"{p.get('nodeid', '')} [{p.get('marker', '')}]" + (f" on {p['worker']}" if p.get("worker") else ""),
               "error": p.get("error")}
              for p in evidence.get("shared_passes") or [] if isinstance(p, dict)]
    return template.render(
        complete=evidence.get("complete", True) is not False,
        shared_passes=passes,
        schema=evidence.get("schema", ""),
        created=evidence.get("created", ""),
        overall={"text": overall[0], "css": overall[1], "why": overall[2]},
        counts=counts,
        total=total,
        header=header,
        version=env_info.get("pytest_dnnsafety") or dict(header).get("pytest_dnnsafety", ""),
        run_inputs=run_inputs,
        inputs_note=inputs_note,
        lost=lost,
        cards=cards,
        statuses=STATUSES,
    )
