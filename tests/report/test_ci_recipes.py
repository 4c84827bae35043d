"""The CI recipes in example_project/ci/ parse, and name the options and report paths the plugin writes."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_dnnsafety.settings import SETTINGS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "example_project" / "ci"
INSTALL = 'pip install -c constraints.txt -e ".[test,example,html]"'
TRAIN = "python -m digits_demo.train"
REPORTS = {"--junitxml": "reports/junit.xml", "--dnnsafety-json": "reports/dnnsafety.json",
           "--dnnsafety-html": "reports/dnnsafety.html"}


def pytest_command(script: str) -> dict[str, str]:
    """The ``--option=value`` pairs of the ``python -m pytest`` line in a shell script."""
    lines = [line for line in script.splitlines() if "python -m pytest" in line]
    assert len(lines) == 1, f"expected one pytest command, got {lines}"
    words = shlex.split(lines[0].split("python -m pytest", 1)[1])
    options = {}
    for word in words:
        if word.startswith("--"):
            name, _, value = word.partition("=")
            options[name] = value
    return options


def baseline_options(script: str) -> dict[str, str]:
    """The baseline options the script adds (``--dnnsafety-baseline=...`` anywhere in it)."""
    return dict(re.findall(r"(--dnnsafety-(?:save-)?baseline)=([\w./-]+)", script))


def check_options_exist(options: dict[str, str]) -> None:
    known = {s.cli for s in SETTINGS.values()}
    for name in options:
        if name.startswith("--dnnsafety-"):
            assert name in known, f"{name} is not an option of the plugin (config.SETTINGS)"


def check_shell(script: str) -> None:
    bash = shutil.which("bash")
    if bash is None:
        return
    done = subprocess.run([bash, "-n"], input=script, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr


def test_the_install_extras_exist() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("test", "example", "html"):
        assert extra in extras
    assert (ROOT / "constraints.txt").is_file()
    assert (ROOT / "example_project" / "digits_demo" / "train.py").is_file()


def test_every_report_and_baseline_option_is_a_plugin_setting() -> None:
    known = {s.cli for s in SETTINGS.values()}
    for option in ("--dnnsafety-json", "--dnnsafety-html", "--dnnsafety-baseline", "--dnnsafety-save-baseline"):
        assert option in known


# ------------------------------------------------------------------------------------- GitHub Actions


def github() -> dict[str, Any]:
    return yaml.safe_load((CI / "github-actions.yml").read_text())


def github_steps() -> list[dict[str, Any]]:
    jobs = github()["jobs"]
    assert len(jobs) == 1
    return next(iter(jobs.values()))["steps"]


def step(steps: list[dict[str, Any]], predicate: Any) -> dict[str, Any]:
    found = [s for s in steps if predicate(s)]
    assert len(found) == 1, found
    return found[0]


def test_github_workflow_parses_and_runs_on_push_and_pull_request() -> None:
    workflow = github()
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert "pull_request" in triggers and "push" in triggers
    for s in github_steps():
        assert ("uses" in s) != ("run" in s)
        if "run" in s:
            check_shell(s["run"])


def test_github_install_train_and_gates_run_in_the_right_folders() -> None:
    steps = github_steps()
    install = step(steps, lambda s: "pip install" in s.get("run", ""))
    assert install["run"].strip() == INSTALL and "working-directory" not in install
    train = step(steps, lambda s: TRAIN in s.get("run", ""))
    assert train["working-directory"] == "example_project"
    gates = step(steps, lambda s: "python -m pytest" in s.get("run", ""))
    assert gates["working-directory"] == "example_project"
    assert steps.index(install) < steps.index(train) < steps.index(gates)
    options = pytest_command(gates["run"])
    check_options_exist(options)
    for name, path in REPORTS.items():
        assert options[name] == path


def test_github_uploads_the_reports_the_command_writes() -> None:
    steps = github_steps()
    gates = step(steps, lambda s: "python -m pytest" in s.get("run", ""))
    upload = step(steps, lambda s: s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["if"] == "always()"
    uploaded = set(upload["with"]["path"].split())
    written = {f"{gates['working-directory']}/{path}" for path in pytest_command(gates["run"]).values() if path}
    assert written == uploaded


def test_github_baseline_is_restored_compared_and_saved_from_main() -> None:
    steps = github_steps()
    restore = step(steps, lambda s: s.get("uses", "").startswith("actions/cache/restore@"))
    save = step(steps, lambda s: s.get("uses", "").startswith("actions/cache/save@"))
    gates = step(steps, lambda s: "python -m pytest" in s.get("run", ""))
    promote = step(steps, lambda s: "cp " in s.get("run", ""))
    assert steps.index(restore) < steps.index(gates) < steps.index(promote) < steps.index(save)
    assert restore["with"]["path"] == save["with"]["path"] == "example_project/baseline"
    assert restore["with"]["restore-keys"] == "dnnsafety-baseline-main-"
    assert save["with"]["key"].startswith("dnnsafety-baseline-main-")
    assert "refs/heads/main" in save["if"] and "success()" in save["if"]
    options = baseline_options(gates["run"])
    check_options_exist(options)
    # compared with the restored file, saved to a report that is promoted into the cached folder
    assert f"example_project/{options['--dnnsafety-baseline']}" == "example_project/baseline/baseline.json"
    cp = shlex.split(promote["run"].split("&&")[-1])
    assert cp == ["cp", f"example_project/{options['--dnnsafety-save-baseline']}",
                  "example_project/baseline/baseline.json"]


# ------------------------------------------------------------------------------------- GitLab CI


def gitlab_job() -> dict[str, Any]:
    config = yaml.safe_load((CI / ".gitlab-ci.yml").read_text())
    jobs = {k: v for k, v in config.items() if isinstance(v, dict) and "script" in v}
    assert len(jobs) == 1
    return next(iter(jobs.values()))


def test_gitlab_job_installs_trains_and_runs_the_gates() -> None:
    job = gitlab_job()
    script = job["script"]
    assert script[0] == INSTALL
    assert script[1] == "cd example_project"
    assert script[2] == TRAIN
    whole = "\n".join(script)
    check_shell(whole)
    options = pytest_command(whole)
    check_options_exist(options)
    for name, path in REPORTS.items():
        assert options[name] == path


def test_gitlab_publishes_junit_and_keeps_json_and_html() -> None:
    job = gitlab_job()
    artifacts = job["artifacts"]
    assert artifacts["when"] == "always"
    assert artifacts["reports"]["junit"] == "example_project/" + REPORTS["--junitxml"]
    kept = set(artifacts["paths"])
    for path in REPORTS.values():
        assert "example_project/" + path in kept


def test_gitlab_baseline_is_saved_on_the_default_branch_and_fetched_elsewhere() -> None:
    job = gitlab_job()
    whole = "\n".join(job["script"])
    options = baseline_options(whole)
    check_options_exist(options)
    saved = "example_project/" + options["--dnnsafety-save-baseline"]
    assert saved in job["artifacts"]["paths"]  # kept, so later pipelines can download it
    assert f"baseline-artifacts/{saved}" in whole  # the file taken from main's artifacts ...
    assert f"cp baseline-artifacts/{saved} {options['--dnnsafety-baseline']}" in whole  # ... is the one compared
    assert "$CI_DEFAULT_BRANCH" in whole and "jobs/artifacts/$CI_DEFAULT_BRANCH/download?job=$CI_JOB_NAME" in whole


# ------------------------------------------------------------------------------------- Jenkins


def groovy_structure(text: str) -> tuple[str, list[str]]:
    """Check brackets and quotes of Groovy source; returns (code without strings/comments, string bodies)."""
    code: list[str] = []
    strings: list[str] = []
    stack: list[tuple[str, int]] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    i, line = 0, 1
    while i < len(text):
        c = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            assert end >= 0, f"unterminated /* comment from line {line}"
            line += text.count("\n", i, end)
            i = end + 2
            continue
        quote = next((q for q in ("'''", '"""', "'", '"') if text.startswith(q, i)), None)
        if quote:
            j = i + len(quote)
            body = []
            while True:
                assert j < len(text), f"unterminated {quote} string from line {line}"
                if text[j] == "\\":
                    body.append(text[j:j + 2])
                    j += 2
                    continue
                if text.startswith(quote, j):
                    break
                assert len(quote) == 3 or text[j] != "\n", f"line break in a {quote} string on line {line}"
                body.append(text[j])
                j += 1
            strings.append("".join(body))
            line += text.count("\n", i, j)
            code.append(quote + quote)
            i = j + len(quote)
            continue
        if c in "([{":
            stack.append((c, line))
        elif c in ")]}":
            assert stack, f"unmatched {c!r} on line {line}"
            opened, where = stack.pop()
            assert opened == pairs[c], f"{opened!r} from line {where} closed by {c!r} on line {line}"
        if c == "\n":
            line += 1
        code.append(c)
        i += 1
    assert not stack, f"unclosed {stack[-1][0]!r} from line {stack[-1][1]}"
    return "".join(code), strings


def jenkinsfile() -> tuple[str, list[str]]:
    return groovy_structure((CI / "Jenkinsfile").read_text())


def test_the_groovy_checker_finds_broken_files() -> None:
    for broken in ("pipeline {", "pipeline { stages { }", "sh 'x", "sh '''x", "a(]", "}", "/* x"):
        with pytest.raises(AssertionError):
            groovy_structure(broken)
    code, strings = groovy_structure("pipeline { // { \n sh 'a}' \n sh '''\n b ( \n''' }")
    assert strings == ["a}", "\n b ( \n"]


def test_jenkinsfile_is_a_declarative_pipeline_with_stages_and_junit() -> None:
    code, strings = jenkinsfile()
    assert re.search(r"^pipeline\s*\{", code, re.M)
    assert re.search(r"\bstages\s*\{", code)
    assert re.search(r"\bpost\s*\{\s*always\s*\{", code)
    assert re.search(r"\bjunit\b", code)
    assert re.search(r"\barchiveArtifacts\b", code)
    assert len(re.findall(r"\bstage\(", code)) >= 3
    for body in strings:
        if "\n" in body:  # the shell scripts
            check_shell(body)


def test_jenkinsfile_installs_trains_runs_and_publishes_the_same_paths() -> None:
    code, strings = jenkinsfile()
    assert any(INSTALL in s for s in strings)
    assert any(TRAIN in s for s in strings)
    assert "dir('example_project')" in (CI / "Jenkinsfile").read_text()
    gates = [s for s in strings if "python -m pytest" in s]
    assert len(gates) == 1
    options = pytest_command(gates[0])
    check_options_exist(options)
    for name, path in REPORTS.items():
        assert options[name] == path
    junit = next(s for s in strings if s.endswith("junit.xml") and "," not in s)
    assert junit == "example_project/" + REPORTS["--junitxml"]
    archived = next(s for s in strings if "dnnsafety.json" in s and "," in s)
    archived_paths = {p.strip() for p in archived.split(",")}
    for path in REPORTS.values():
        assert "example_project/" + path in archived_paths
    baseline = baseline_options(gates[0])
    check_options_exist(baseline)
    assert "example_project/" + baseline["--dnnsafety-save-baseline"] in archived_paths
    copied = next(s for s in strings if s.endswith("baseline.json") and "," not in s and "/" in s)
    assert copied == "example_project/" + baseline["--dnnsafety-save-baseline"]  # main's archived file ...
    target = next(s for s in strings if s == "example_project/baseline")
    assert f"{target}/baseline.json" == "example_project/" + baseline["--dnnsafety-baseline"]  # ... is compared
