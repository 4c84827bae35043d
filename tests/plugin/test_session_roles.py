"""The session's process roles (issue #20 item 5): one class per role, chosen once at configure time.

Whole runs of each role are covered by the plugin, evidence, xdist and torchrun suites; this file
checks the choice of role, what each role does and does not do, and that the session modules hold
no output formatting (the report package writes the outputs).
"""

from __future__ import annotations

import ast
import types
from pathlib import Path
from typing import Any

import pytest

from pytest_dnnsafety.runtime import torchrun as ranks
from pytest_dnnsafety.plugin.session import (
    DnnSafetyPlugin,
    Evaluating,
    Gathering,
    SingleProcess,
    TorchrunRank,
    XdistController,
    XdistWorker,
    role_for,
)

SESSION = Path(__file__).resolve().parents[2] / "pytest_dnnsafety" / "plugin" / "session"
TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29999"}


def _config(dist: str = "no", worker: bool = False) -> Any:
    config = types.SimpleNamespace(option=types.SimpleNamespace(dist=dist))
    if worker:
        config.workerinput = {"workerid": "gw0"}
    return config


@pytest.fixture
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ranks.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)


def test_the_role_follows_how_pytest_was_started(no_torchrun: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert role_for(_config()) is SingleProcess
    assert role_for(_config(dist="load")) is XdistController
    assert role_for(_config(dist="load", worker=True)) is XdistWorker
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    assert role_for(_config()) is TorchrunRank


def test_each_role_runs_tests_or_reports_or_both() -> None:
    assert all(issubclass(role, DnnSafetyPlugin) for role in (SingleProcess, XdistController, XdistWorker,
                                                              TorchrunRank))
    runs = {role: issubclass(role, Evaluating) for role in (SingleProcess, XdistController, XdistWorker,
                                                             TorchrunRank)}
    reports = {role: issubclass(role, Gathering) for role in runs}
    assert runs == {SingleProcess: True, XdistController: False, XdistWorker: True, TorchrunRank: True}
    assert reports == {SingleProcess: True, XdistController: True, XdistWorker: False, TorchrunRank: True}
    # the controller collects nothing: its order comes from xdist, its plan from the workers' reports
    assert hasattr(XdistController, "pytest_xdist_node_collection_finished")
    assert not hasattr(XdistController, "pytest_runtest_call")
    assert not hasattr(XdistWorker, "pytest_sessionfinish") and not hasattr(XdistWorker, "pytest_terminal_summary")
    assert XdistController.distributed and XdistWorker.is_worker and not SingleProcess.distributed


def test_only_rank_0_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    rank = types.SimpleNamespace()
    monkeypatch.setattr(ranks, "is_main", lambda: False)
    assert TorchrunRank.writes_reports(rank) is False  # type: ignore[arg-type]
    monkeypatch.setattr(ranks, "is_main", lambda: True)
    assert TorchrunRank.writes_reports(rank) is True  # type: ignore[arg-type]


def test_single_process_agrees_with_nobody() -> None:
    one = types.SimpleNamespace()
    assert SingleProcess.bodies_failed(one, "test body failed") == []  # type: ignore[arg-type]
    assert SingleProcess.world_size(one) == 1  # type: ignore[arg-type]


def test_the_session_modules_format_no_output() -> None:
    """The report package writes the outputs: no session module imports the writers or writes a file."""
    writers = {"write_evidence", "write_html", "save_baseline", "patch_junit", "write_github_step_summary",
               "render_table", "build_evidence", "write_text_atomic", "json.dump", "write_text", "write_sep",
               "write_line"}
    for path in sorted(SESSION.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        used |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        used |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
        assert not used & writers, f"{path.name} formats or writes output: {sorted(used & writers)}"
        assert len(path.read_text(encoding="utf-8").splitlines()) <= 600, path.name
