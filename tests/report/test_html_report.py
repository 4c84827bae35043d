"""The HTML report (``--dnnsafety-html``): page structure, escaping, self-containment, and a real browser.

The browser tests drive Debian's ``chromium`` through ``chromedriver`` (Debian's ``chromium-driver``)
with selenium: the page must load with no console error (the page's Content-Security-Policy turns
any network reference into one), show one card per gate and draw its plots; a full-page
screenshot is written with ``chromium --headless --screenshot`` to ``$DNNSAFETY_ARTIFACTS`` (a
temporary folder when unset) for a person to look at. They are skipped only where chromium or
chromedriver is not installed (CI installs both).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from conftest import GateProject
from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.report import build_evidence
from pytest_dnnsafety.report.html import EXTRA_MESSAGE, check_html_path, render_html, write_html
from pytest_dnnsafety.results import STATUSES, GateResult

ROOT = Path(__file__).resolve().parents[2]
HOSTILE = '<script>alert("pwned")</script><img src=x onerror=alert(1)>'

ENV = {"pytest_dnnsafety": "0.1.0", "torch": "2.13.0+cpu", "numpy": "2", "pytest": "9", "python": "3.11",
       "platform": "Linux", "device": "cpu", "seed": 1234, "workers": 2,
       "inputs": {"scenarios": {"spec": "data/scenarios.csv", "source": "ini option dnnsafety_scenarios",
                                "path": "/p/data/scenarios.csv", "digest": "sha256:" + "ab" * 32}}}

PAIR_GRIDS = [
    {"conditions": ["weather", "road"], "values": [["sunny", "cloudy", "rainy"], ["stone", "mud", "tarmac"]],
     "counts": [[3, 0, 1], [2, -1, 0], [5, 4, 0]]},
    {"conditions": ["road", "orientation"], "values": [["stone", "mud", "tarmac"], ["straight", "curvy"]],
     "counts": [[1, 0], [0, 0], [2, 7]]},
]
CELLS_PLOT = {"mass": [0.5, 0.1, 1e-3, 1e-4, 0.0], "failure_rate": [0.0, 0.2, 1.0, 0.5, 0.3],
              "type": ["normal", "normal", "cross_boundary", "empty", "empty"]}


def _gate(name: str, status: str, **extra: Any) -> GateResult:
    fields: dict[str, Any] = dict(nodeid=f"tests/test_g.py::{name}", marker="min_scene_coverage",
                                  metric="scenario k-projection coverage", threshold=0.5, op=">=", status=status,
                                  value=0.7 if status in ("passed", "failed") else None,
                                  passed={"passed": True, "failed": False}.get(status),
                                  summary=f"{name}: summary", details={}, device="cpu")
    fields.update(extra)
    baseline = None if "baseline" in GateResult.__dataclass_fields__ else fields.pop("baseline", None)
    result = GateResult(**fields)
    if baseline is not None:  # the baseline comparison, before GateResult has its own field for it
        result.__dict__["_baseline"] = baseline
    return result


def _evidence(*gates: GateResult, lost: tuple[str, ...] = ()) -> dict[str, Any]:
    evidence = build_evidence(list(gates), ENV, lost)
    for record, gate in zip(evidence["gates"], gates):
        if "_baseline" in gate.__dict__:
            record["baseline"] = gate.__dict__["_baseline"]
    # the JSON round trip: the page is rendered from what the evidence file holds
    return json.loads(json.dumps(evidence))


def _all_verdicts() -> dict[str, Any]:
    return _evidence(
        _gate("test_pass_grid", "passed", details={"k": 2, "min_count": 2, "pair_grids": PAIR_GRIDS}),
        _gate("test_fail_neurons", "failed", marker="min_neuron_k_activation",
              details={"value": 0.4, "per_neuron_coverage": [0.1, 0.5, 0.9, 1.0, 0.0, 0.3]}),
        _gate("test_error", "error", details={"error_type": "ValueError", "error": "the model exploded",
                                              "traceback": ["  File \"x.py\", line 1, in f\n", "ValueError\n"]}),
        _gate("test_not_run", "not-evaluated", details={"reason": "test body failed"}),
        _gate("test_inconclusive", "inconclusive", marker="max_pmi_ub", op="<=", value=0.01, bound=0.02,
              details={"violations": ["cells wider than r_hat"], "cells_plot": CELLS_PLOT}),
        _gate("test_lost", "lost", details={"reason": "worker crashed"}),
        lost=("tests/test_g.py::test_lost",),
    )


class _Page(HTMLParser):
    """The page's cards, plots, scripts and every URL-valued attribute, from the stdlib parser."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.cards: list[dict[str, str]] = []
        self.plots: list[tuple[str, str]] = []  # (card nodeid, plot kind)
        self.svgs_in_plots = 0
        self.scripts = 0
        self.urls: list[str] = []
        self._figure: str | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "section" and "card" in a.get("class", "").split():
            self.cards.append(a)
        if tag == "figure" and "data-plot" in a:
            self._figure = a["data-plot"]
            self.plots.append((self.cards[-1]["data-nodeid"], a["data-plot"]))
        if tag == "svg" and self._figure:
            self.svgs_in_plots += 1
        if tag == "script":
            self.scripts += 1
        self.urls += [v for k, v in a.items() if k in ("src", "href", "xlink:href", "action", "data", "poster")]

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._figure = None


# -------------------------------------------------------------------------------------- page structure


def test_one_card_per_gate_worst_verdict_first_with_summary_counts() -> None:
    evidence = _all_verdicts()
    text = render_html(evidence)
    page = _Page(text)
    assert [c["data-status"] for c in page.cards] == ["failed", "error", "inconclusive", "lost", "not-evaluated",
                                                      "passed"]
    assert sorted(c["data-nodeid"] for c in page.cards) == sorted(g["nodeid"] for g in evidence["gates"])
    assert re.search(r'<div class="banner failed" id="verdict">\s*<div class="wrap"><h1>FAILED</h1>', text)
    for status in STATUSES:
        assert re.search(rf'data-status="{status}"><span class="n">1</span>', text), status
    assert "the model exploded" in text and "ValueError" in text and "worker crashed" in text
    assert "cells wider than r_hat" in text
    assert "sha256:" + "ab" * 32 in text  # the run's inputs with their digests


def test_all_passed_is_a_green_banner() -> None:
    text = render_html(_evidence(_gate("test_a", "passed"), _gate("test_b", "passed")))
    assert '<div class="banner passed" id="verdict">' in text and "all 2 gates passed" in text


def test_plots_are_inline_svg_only_where_the_details_have_their_keys() -> None:
    page = _Page(render_html(_all_verdicts()))
    assert sorted(page.plots) == sorted([
        ("tests/test_g.py::test_pass_grid", "pair_grids"), ("tests/test_g.py::test_pass_grid", "pair_grids"),
        ("tests/test_g.py::test_fail_neurons", "per_neuron_coverage"),
        ("tests/test_g.py::test_inconclusive", "cells_plot")])
    assert page.svgs_in_plots == 4
    plain = _Page(render_html(_evidence(_gate("test_a", "passed", details={"k": 2}))))
    assert plain.plots == [] and plain.svgs_in_plots == 0


def test_pair_grid_is_annotated_with_counts_and_infeasible_cells() -> None:
    text = render_html(_evidence(_gate("test_grid", "passed", details={"min_count": 2, "pair_grids": PAIR_GRIDS})))
    svg = text[text.index('data-plot="pair_grids"'):]
    svg = svg[: svg.index("</figure>")]
    assert "weather × road: 4/8 feasible cells covered" in svg  # counts ≥ min_count=2: 3, 2, 5, 4
    assert "×" in svg and "below min_count=2" in svg and "infeasible" in svg
    assert all(word in svg for word in ("sunny", "cloudy", "rainy", "stone", "mud", "tarmac"))


def test_malformed_plot_data_is_a_note_not_a_crash() -> None:
    bad = [{"conditions": ["a", "b"], "values": [["x"], ["y", "z"]], "counts": [[1]]}]
    text = render_html(_evidence(_gate("test_bad", "passed", details={"pair_grids": bad,
                                                                       "per_neuron_coverage": [],
                                                                       "cells_plot": {"mass": [1]}})))
    assert _Page(text).plots == []
    assert text.count("not drawn (") == 3


def test_page_is_self_contained() -> None:
    text = render_html(_all_verdicts())
    assert "http://" not in text and "https://" not in text
    page = _Page(text)
    assert page.urls and all(url.startswith(("#", "data:")) for url in page.urls), page.urls
    assert page.scripts == 1  # the page's own inline script, no src
    assert not re.search(r"url\((?!#)", text) and "@import" not in text and "<link" not in text
    assert "<?xml" not in text and "<!DOCTYPE svg" not in text
    assert "default-src 'none'" in text  # a stray reference is blocked and reported by the browser
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert len(ids) == len(set(ids)), "element ids must be unique across the inline plots"


def test_hostile_text_is_escaped_everywhere() -> None:
    grids = [{"conditions": [HOSTILE, "road"], "values": [[HOSTILE, "$x^2$"], ["stone"]], "counts": [[1], [0]]}]
    gate = _gate(f"test_x[{HOSTILE}]", "error", summary=HOSTILE, marker="min_scene_coverage",
                 details={HOSTILE: HOSTILE, "error": HOSTILE, "pair_grids": grids, "nested": {"k": [HOSTILE]}},
                 inputs={"data": {"fixture": HOSTILE, "origin": {"kind": "user fixture", "file": HOSTILE,
                                                                 "line": 3}, "type": HOSTILE, "digest": HOSTILE}},
                 baseline={"status": HOSTILE, "message": HOSTILE, "baseline_value": 0.5})
    evidence = _evidence(gate, lost=(HOSTILE,))
    evidence["environment"]["platform"] = HOSTILE
    text = render_html(evidence)
    assert "<script>alert" not in text and "<img src=x" not in text and "onerror=alert" not in text.replace(
        "onerror=alert(1)&gt;", "")
    assert text.count("<script") == 1
    assert "&lt;script&gt;alert(" in text
    assert _Page(text).plots  # the hostile condition still gets its heat map, with escaped labels
    assert "$x^2$" in text  # condition values are text, never mathtext


def test_baseline_comparison_is_shown_when_present() -> None:
    gate = _gate("test_b", "failed", baseline={"status": "regressed", "baseline_value": 0.9, "change": -0.2,
                                                "limit": 0.05, "message": "dropped by 0.200 > max_drop 0.050"})
    text = render_html(_evidence(gate))
    assert "regressed" in text and "dropped by 0.200 &gt; max_drop 0.050" in text
    assert "baseline_value" in text and "0.900" in text and "-0.200" in text
    assert 'class="baseline"' not in render_html(_evidence(_gate("test_c", "passed")))


def test_write_html_is_atomic_and_check_path_clears_a_stale_page(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "report.html"
    target.parent.mkdir()
    target.write_text("stale page")
    check_html_path(target)
    assert not target.exists()
    assert write_html(target, _all_verdicts()) == target
    assert target.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in target.parent.iterdir()] == ["report.html"]
    with pytest.raises(IsADirectoryError):
        check_html_path(tmp_path)


@pytest.mark.parametrize("module", ["jinja2", "matplotlib"])
def test_missing_extra_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import of it raises ImportError
    for call in (lambda: write_html(tmp_path / "r.html", _all_verdicts()),
                 lambda: check_html_path(tmp_path / "r.html")):
        with pytest.raises(ConfigError) as info:
            call()
        assert EXTRA_MESSAGE in str(info.value)
        assert "pip install 'pytest-dnnsafety[html]'" in str(info.value)
    assert not (tmp_path / "r.html").exists()


# ----------------------------------------------------------------------------- a pytester run, end to end

VERDICT_TESTS = """
    import pytest

    @pytest.fixture(scope="session")
    def broken_table():
        raise RuntimeError("scenario database <unreachable>")

    @pytest.mark.min_scene_coverage(0.2)
    def test_passes(scenario_table):
        pass

    @pytest.mark.min_scene_coverage(0.9)
    def test_fails(scenario_table):
        pass

    @pytest.mark.min_scene_coverage(0.3, scenarios="broken_table")
    def test_errors():
        pass

    @pytest.mark.min_scene_coverage(0.4)
    def test_body_fails(scenario_table):
        assert False, "the body failed"
"""


@pytest.fixture
def verdict_run(gate_project: GateProject) -> tuple[Path, dict[str, Any]]:
    """A pytester run with a passed, a failed, an errored and a not-run gate; its page and evidence.

    Needs ``--dnnsafety-html`` wired into the plugin's session finish (the page of the same evidence
    dict as ``--dnnsafety-json``).
    """
    gate_project.tests(VERDICT_TESTS)
    result = gate_project.run("--dnnsafety-json=reports/e.json", "--dnnsafety-html=reports/report.html")
    result.assert_outcomes(passed=1, failed=2, errors=1)
    root = gate_project.pytester.path
    evidence = json.loads((root / "reports/e.json").read_text())
    assert {g["status"] for g in evidence["gates"]} == {"passed", "failed", "error", "not-evaluated"}
    return root / "reports/report.html", evidence


def test_html_option_writes_the_page_of_the_evidence(verdict_run: tuple[Path, dict[str, Any]],
                                                     tmp_path: Path) -> None:
    page_path, evidence = verdict_run
    text = page_path.read_text()
    page = _Page(text)
    assert sorted(c["data-nodeid"] for c in page.cards) == sorted(g["nodeid"] for g in evidence["gates"])
    assert [c["data-status"] for c in page.cards][-1] == "passed"
    assert "scenario database &lt;unreachable&gt;" in text  # the error's message, escaped
    not_run = next(g for g in evidence["gates"] if g["status"] == "not-evaluated")
    assert not_run["details"]["reason"] in text
    # the page renders the evidence and nothing else: the same page from the JSON file
    assert write_html(tmp_path / "again.html", evidence).read_text() == text


def test_html_option_with_a_directory_stops_the_run(gate_project: GateProject) -> None:
    gate_project.tests(VERDICT_TESTS)
    (gate_project.pytester.path / "out").mkdir()
    result = gate_project.run("--dnnsafety-html=out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*dnnsafety_html*out*is a directory*"])


# ------------------------------------------------------------------------------------- a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Debian's chromium and chromium-driver are not installed (apt-get install -y chromium chromium-driver; "
           ".ci/run installs them)")


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where screenshots go: $DNNSAFETY_ARTIFACTS (CI keeps them) or a temporary folder."""
    folder = os.environ.get("DNNSAFETY_ARTIFACTS", "").strip()
    path = Path(folder) if folder else tmp_path_factory.mktemp("html-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _browse(page: Path, evidence: dict[str, Any], shot: Path, tmp_path: Path) -> None:
    """Open the page in headless chromium; check the console, the cards, the plots; write a screenshot."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        driver.get(page.resolve().as_uri())
        logs = driver.get_log("browser")
        problems = [entry for entry in logs if entry["level"] in ("SEVERE", "WARNING")]
        assert problems == [], problems
        gates = evidence["gates"]
        assert driver.execute_script("return document.documentElement.dataset.cards") == str(len(gates))
        cards = driver.find_elements(By.CSS_SELECTOR, "section.card")
        assert sorted(c.get_attribute("data-nodeid") for c in cards) == sorted(g["nodeid"] for g in gates)
        assert all(c.is_displayed() for c in cards)
        expected = sum(len(g["details"].get("pair_grids") or []) + ("per_neuron_coverage" in g["details"])
                       + ("cells_plot" in g["details"]) + ("families" in g["details"])
                       + ("verified" in g["details"]) + ("faults" in g["details"]) + ("ranking" in g["details"])
                       for g in gates)
        svgs = driver.find_elements(By.CSS_SELECTOR, "figure[data-plot] > svg")
        assert len(svgs) == expected
        for svg in svgs:  # drawn, with a size, and with marks inside
            box = driver.execute_script("var r = arguments[0].getBoundingClientRect(); return [r.width, r.height];",
                                        svg)
            assert box[0] > 100 and box[1] > 80, box
            assert driver.execute_script("return arguments[0].querySelectorAll('path, use').length", svg) > 5
        height = driver.execute_script("return document.documentElement.scrollHeight")  # of the whole page
        # the page's filter hides passed cards, and only them
        driver.find_element(By.ID, "only-problems").click()
        shown = {c.get_attribute("data-status") for c in cards if c.is_displayed()}
        assert shown == {g["status"] for g in gates} - {"passed"}
        assert driver.get_log("browser") == []
    finally:
        driver.quit()
    shot.unlink(missing_ok=True)
    run = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={tmp_path / 'shot-profile'}", f"--window-size=1280,{min(height, 16000)}",
                          f"--screenshot={shot}", page.resolve().as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert shot.is_file(), run.stdout + run.stderr
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"screenshot of {page.name}: {shot}")


@needs_browser
def test_browser_renders_every_verdict_and_plot(tmp_path: Path, artifacts: Path) -> None:
    evidence = _all_verdicts()
    page = write_html(tmp_path / "verdicts.html", evidence)
    _browse(page, evidence, artifacts / "html-report-verdicts.png", tmp_path)


@needs_browser
def test_browser_renders_a_run_with_failed_errored_and_not_run_gates(
        verdict_run: tuple[Path, dict[str, Any]], tmp_path: Path, artifacts: Path) -> None:
    page, evidence = verdict_run
    _browse(page, evidence, artifacts / "html-report-pytester.png", tmp_path)


@needs_browser
@pytest.mark.slow
def test_browser_renders_the_example_project(tmp_path: Path, artifacts: Path) -> None:
    """The example project's own run (trained here when its model is missing), as a reviewer sees it."""
    project = tmp_path / "example_project"
    source = ROOT / "example_project"
    trained = (source / "models").is_dir() and (source / "data" / "eval.npz").is_file()
    shutil.copytree(source, project, ignore=shutil.ignore_patterns(
        "reports", "__pycache__", ".pytest_cache", *(() if trained else ("models", "data"))))
    if not trained:
        subprocess.run([sys.executable, "-m", "digits_demo.train"], cwd=project, check=True, capture_output=True)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
                          "--dnnsafety-json=reports/e.json"], cwd=project, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    evidence = json.loads((project / "reports" / "e.json").read_text())
    page = write_html(project / "reports" / "report.html", evidence)
    assert len(_Page(page.read_text()).cards) == len(evidence["gates"]) >= 6
    _browse(page, evidence, artifacts / "html-report-example-project.png", tmp_path)
