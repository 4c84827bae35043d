"""The HTML card's text and its plot's caption name the same worst group and pair, ties included (issue #29 §3).

``min_detection_map`` names its worst group in the summary (the card text) and in ``details["worst_group"]``:
the group of smallest gated number, ties broken by the smaller mAP, then by the groups' order. The bar plot's
caption used to pick the first smallest lower bound on its own, so on a tie the card and the plot named different
groups. The caption (and the red bar) now read the gate's own choice, and without one rank the groups the gate's
way (:func:`pytest_dnnsafety.report.drawings.worst_group_index`). The multi-label confusion heat map names the
gate's worst supported pair (``type2_worst``), not the largest cell of the whole matrix.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("jinja2")

from pytest_dnnsafety.report.drawings import worst_group_index  # noqa: E402
from pytest_dnnsafety.report.evidence import build_evidence  # noqa: E402
from pytest_dnnsafety.report.html import render_html  # noqa: E402
from pytest_dnnsafety.report.plots import _plots  # noqa: E402
from pytest_dnnsafety.results import GateResult  # noqa: E402


def _groups(*rows: tuple[str, float, float]) -> list[dict[str, Any]]:
    return [{"group": g, "map": m, "lower": lo, "upper": m + 0.05, "images": 40, "objects": 90} for g, m, lo in rows]


def _engine_worst(rows: list[dict[str, Any]], statistic: str) -> str:
    """The rule of engines/detection/quality.py's worst_map: min over (gated number, mAP), first on a tie."""
    key = "lower" if statistic == "bound" else "map"
    return min(rows, key=lambda r: (r[key], r["map"]))["group"]


TIES = [
    ("bound", _groups(("a=day", 0.70, 0.40), ("a=night", 0.55, 0.40), ("a=dusk", 0.80, 0.60))),  # same lower
    ("bound", _groups(("a=day", 0.50, 0.40), ("a=night", 0.50, 0.40))),  # same lower and mAP: the first
    ("estimate", _groups(("a=day", 0.50, 0.45), ("a=night", 0.50, 0.30))),  # the gate compares the mAP
    ("estimate", _groups(("a=day", 0.60, 0.20), ("a=night", 0.50, 0.45))),
]


@pytest.mark.parametrize("statistic, rows", TIES)
def test_the_caption_names_the_gates_worst_group(statistic: str, rows: list[dict[str, Any]]) -> None:
    worst = _engine_worst(rows, statistic)
    details = {"confidence": 0.95, "statistic": statistic, "worst_group": worst, "map_groups": rows}
    plots, notes = _plots(json.loads(json.dumps(details)), 0)
    assert notes == [] and len(plots) == 1
    assert f"the worst is {worst}," in plots[0]["title"]
    # without the gate's choice (hand-made details) the plot ranks the groups the gate's way
    del details["worst_group"]
    assert rows[worst_group_index(details)]["group"] == worst
    plots, _ = _plots(json.loads(json.dumps(details)), 0)
    assert f"the worst is {worst}," in plots[0]["title"]


def test_the_card_text_and_the_caption_agree_on_the_page() -> None:
    statistic, rows = TIES[0]
    worst = _engine_worst(rows, statistic)
    details = {"confidence": 0.95, "statistic": statistic, "worst_group": worst, "map_groups": rows}
    result = GateResult(nodeid="t.py::test_map", marker="min_detection_map", metric="worst scenario group mAP",
                        threshold=0.3, op=">=", status="passed", value=0.55, bound=0.40, passed=True,
                        summary=f"worst group {worst}: mAP 0.550, lower bound 0.400", details=details)
    page = render_html(json.loads(json.dumps(build_evidence([result], {"seed": 1}))))
    named = set(re.findall(r"worst (?:group |is )(a=\w+)", page))
    assert named == {worst}, named


def test_the_type2_caption_names_the_gated_pair_not_an_unsupported_cell() -> None:
    nan = float("nan")
    details = {"statistic": "type2", "classes": ["car", "person", "bike"],
               "type2_matrix": [[nan, 0.3, 0.9], [0.3, nan, 0.3], [0.9, 0.3, nan]],
               "type2_worst": {"value": 0.3, "pair": ["car", "person"], "min_support": 10, "supported_pairs": 2,
                               "unsupported_pairs": 1}}
    plots, notes = _plots(json.loads(json.dumps(details)), 0)
    assert notes == [] and len(plots) == 1
    assert "worst pair car / person, 0.300" in plots[0]["title"]
