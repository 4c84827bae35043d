"""The HTML report's monitor plots: the fault family × severity heat map and the critical-difference diagram."""

from __future__ import annotations

import json
import re
from typing import Any

from pytest_dnnsafety.report import build_evidence
from pytest_dnnsafety.report.html import render_html
from pytest_dnnsafety.results import GateResult

ENV = {"pytest_dnnsafety": "0.1.0", "torch": "2", "numpy": "2", "pytest": "9", "python": "3.11",
       "platform": "Linux", "device": "cpu", "seed": 0, "workers": 1}

FAMILIES = ("gaussian_noise", "brightness", "fgsm")


def _faults(monitor: str | None = None, shift: float = 0.0) -> list[dict[str, Any]]:
    entries = []
    for f, family in enumerate(FAMILIES):
        for severity in (1, 2, 3, 4, 5):
            mcc = round(0.1 * severity + 0.05 * f - shift, 3)
            entry = {"family": family, "severity": severity, "n_ood": 100, "tp": 50, "fp": 5, "tn": 95,
                     "fn": 50, "fpr": 0.05, "fnr": 0.5, "precision": 0.9, "recall": 0.5, "f1": 0.64,
                     "mcc": mcc, "auroc": 0.8, "fpr_at_95tpr": 0.4}
            if monitor is not None:
                entry["monitor"] = monitor
            entries.append(entry)
    novel = {"family": "novel", "severity": None, "n_ood": 80, "mcc": 0.42, "fpr": 0.05}
    if monitor is not None:
        novel["monitor"] = monitor
    return entries + [novel]


RANKING = {"monitors": ["msp", "odin", "energy", "mahalanobis", "outside_the_box"],
           "average_ranks": [3.9, 3.1, 2.4, 1.8, 3.8], "cd": 1.364, "alpha": 0.05, "statistic": 14.2,
           "pvalue": 0.0067, "n_blocks": 16, "cliques": [[3, 2, 1], [2, 1, 4, 0]]}


def _page(details: dict[str, Any], status: str = "passed") -> str:
    gate = GateResult(nodeid="tests/test_m.py::test_monitor", marker="min_monitor_detection",
                      metric="monitor detection MCC", threshold=0.2, op=">=", status=status, value=0.3,
                      passed=status == "passed", summary="monitor detection", details=details, device="cpu")
    evidence = json.loads(json.dumps(build_evidence([gate], ENV, ())))  # the JSON round trip of the evidence
    return render_html(evidence)


def _figures(text: str, kind: str) -> list[str]:
    out = []
    for match in re.finditer(rf'<figure class="plot" data-plot="{kind}">', text):
        body = text[match.end():]
        out.append(body[: body.index("</figure>")])
    return out


def test_fault_heatmap_and_cd_diagram_are_inline_svgs() -> None:
    text = _page({"metric": "mcc", "faults": _faults(), "ranking": RANKING})
    (heat,) = _figures(text, "faults")
    (diagram,) = _figures(text, "ranking")
    for svg in (heat, diagram):
        assert svg.lstrip().startswith("<svg") and "<path" in svg
    assert all(family in heat for family in FAMILIES + ("novel",))
    assert "mcc per fault family × severity" in heat and "worst: gaussian_noise at severity 1, 0.100" in heat
    assert "0.75" in heat  # fgsm at severity 5: 0.5 + 0.1 + 0.15, annotated in its cell
    assert all(name in diagram for name in RANKING["monitors"])
    assert "CD = 1.364" in diagram and "mahalanobis (1.80)" in diagram
    assert "over 16 blocks" in diagram and "Friedman p = 0.0067" in diagram
    assert "not drawn" not in text
    # the data of the plots is kept as JSON under the card, not as an ordinary nested detail
    assert "faults (the data of the plot)" in text and "ranking (the data of the plot)" in text


def test_one_heatmap_per_monitor_when_entries_name_them() -> None:
    faults = _faults("energy") + _faults("msp", shift=0.3)
    text = _page({"metric": "fpr", "faults": faults})
    heats = _figures(text, "faults")
    assert len(heats) == 2
    assert "fpr per fault family × severity — energy" in heats[0] and "— msp" in heats[1]
    assert "(lower is better)" in heats[0]


def test_malformed_monitor_plot_data_is_a_note() -> None:
    bad_ranking = dict(RANKING, average_ranks=[1.0, 2.0])  # 5 monitors, 2 ranks
    duplicate = _faults()[:2] + _faults()[:1]
    text = _page({"faults": duplicate, "ranking": bad_ranking})
    assert _figures(text, "faults") == [] and _figures(text, "ranking") == []
    assert "faults: not drawn (ValueError: two entries for gaussian_noise at severity 1)" in text
    assert "ranking: not drawn (ValueError" in text
    # non-finite values (the evidence writes them as strings) are grey cells marked n/a
    nan_cell = [{"family": "zeroed_rows", "severity": None, "mcc": "nan"}]
    (heat,) = _figures(_page({"metric": "mcc", "faults": nan_cell}), "faults")
    assert "n/a" in heat and "zeroed_rows" in heat


def test_cd_diagram_without_cd_or_cliques_still_draws() -> None:
    text = _page({"ranking": {"monitors": ["a", "b", "c"], "average_ranks": [1.5, 1.5, 3.0]}})
    (diagram,) = _figures(text, "ranking")
    assert "a (1.50)" in diagram and "CD =" not in diagram
