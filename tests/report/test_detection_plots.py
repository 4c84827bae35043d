"""The HTML report's detection mAP bars and type-2 confusion heat map, from synthetic gate details.

``map_groups`` is what ``min_detection_map`` puts in its details (one entry per scenario group: point
mAP, bootstrap lower/upper, images, objects); ``type2_matrix`` with ``classes`` is what
``max_class_confusion`` puts there for multi-label data (K × K, null/NaN where undefined). Each
becomes one inline SVG figure on its gate's card; malformed entries become notes, never a crash.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("jinja2")

from pytest_dnnsafety.report.evidence import build_evidence  # noqa: E402
from pytest_dnnsafety.report.html import render_html  # noqa: E402
from pytest_dnnsafety.report.plots import _plots  # noqa: E402
from pytest_dnnsafety.results import GateResult  # noqa: E402

MAP_DETAILS = {
    "confidence": 0.95, "statistic": "bound", "worst_group": "lighting=night",
    "map_groups": [
        {"group": "lighting=day", "map": 0.71, "lower": 0.64, "upper": 0.77, "images": 40, "objects": 95},
        {"group": "lighting=dusk", "map": 0.58, "lower": 0.49, "upper": 0.66, "images": 40, "objects": 88},
        {"group": "lighting=night", "map": 0.21, "lower": 0.12, "upper": 0.30, "images": 40, "objects": 90},
    ],
}
NAN = float("nan")
TYPE2_DETAILS = {"statistic": "type2", "classes": ["car", "person", "bike"],
                 "type2_matrix": [[NAN, 0.1, 0.42], [0.1, NAN, None], [0.42, None, NAN]]}


def test_map_bars_name_the_worst_group_and_draw_the_interval() -> None:
    plots, notes = _plots(json.loads(json.dumps(MAP_DETAILS)), 0)
    assert notes == []
    (plot,) = plots
    assert plot["kind"] == "map_groups" and plot["svg"].startswith("<svg")
    assert "lighting=night" in plot["title"] and "0.210" in plot["title"] and "lower bound 0.120" in plot["title"]
    assert "lighting=dusk" in plot["svg"] and "95% lower bound (gated)" in plot["svg"]


def test_type2_heatmap_greys_undefined_pairs_and_names_the_worst() -> None:
    plots, notes = _plots(TYPE2_DETAILS, 1)
    assert notes == []
    (plot,) = plots
    assert plot["kind"] == "type2_matrix"
    assert "worst pair car / bike, 0.420" in plot["title"] and "3 classes, 4 defined cells" in plot["title"]
    assert "–" in plot["svg"]  # the undefined cells are marked, not drawn as 0


@pytest.mark.parametrize("details", [
    {"map_groups": []},
    {"map_groups": [{"group": "a", "map": None}]},
    {"type2_matrix": [[0.1, 0.2]], "classes": ["a", "b"]},
    {"type2_matrix": [[0.1]], "classes": []},
])
def test_malformed_details_are_notes(details: dict[str, Any]) -> None:
    plots, notes = _plots(details, 2)
    assert plots == [] and len(notes) == 1 and "not drawn" in notes[0]


def test_the_page_shows_both_plots_on_their_cards() -> None:
    gates = [GateResult(nodeid="tests/test_d.py::test_map", marker="min_detection_map", metric="mAP", threshold=0.3,
                        op=">=", status="failed", value=0.21, bound=0.12, passed=False, summary="worst lighting=night",
                        details=MAP_DETAILS, device="cpu"),
             GateResult(nodeid="tests/test_d.py::test_type2", marker="max_class_confusion", metric="type-2",
                        threshold=0.5, op="<=", status="passed", value=0.42, passed=True, summary="ok",
                        details={**TYPE2_DETAILS, "type2_matrix": [[None if isinstance(v, float) and math.isnan(v)
                                                                      else v for v in row]
                                                                     for row in TYPE2_DETAILS["type2_matrix"]]},
                        device="cpu")]
    evidence = json.loads(json.dumps(build_evidence(gates, {"device": "cpu", "seed": 1}, ())))
    page = render_html(evidence)
    assert 'data-plot="map_groups"' in page and 'data-plot="type2_matrix"' in page
    assert page.count("<svg") >= 2
