"""One class per process role, chosen once when pytest is configured (:func:`role_for`).

=================  =========================================  ===============================
role               runs tests (evaluates gates)               reports (outputs, summary)
=================  =========================================  ===============================
SingleProcess      yes                                        yes
XdistController    no: its workers do                         yes, from the workers' reports
XdistWorker        yes, and sends results in its reports      no
TorchrunRank       yes, in step with the other ranks          rank 0 only
=================  =========================================  ===============================
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pytest_dnnsafety.runtime import torchrun as ranks
from pytest_dnnsafety.gates import GateSpec
from pytest_dnnsafety.results import GateResult
from pytest_dnnsafety.plugin.session.evaluating import Evaluating
from pytest_dnnsafety.plugin.session.gathering import Gathering

__all__ = ["SingleProcess", "XdistController", "XdistWorker", "TorchrunRank", "role_for"]


class SingleProcess(Evaluating, Gathering):
    """The only process of the run: it evaluates every gate and writes every output."""


class XdistController(Gathering):
    """The controller of a pytest-xdist run: it collects nothing and gathers what its workers report.

    It knows every gate before it runs from the gate plan (nodeid -> marker, metric, op, threshold)
    that each worker attaches, as a JSON string, to the first report it sends, and the collection
    order from xdist's ``pytest_xdist_node_collection_finished``.
    """

    distributed = True

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        if not self.order:  # every worker collects the same ids
            self.order = {nodeid: i for i, nodeid in enumerate(ids)}

    def workers(self) -> int:
        numprocesses = getattr(self.config.option, "numprocesses", None)
        return numprocesses if isinstance(numprocesses, int) else 0


class XdistWorker(Evaluating):
    """A pytest-xdist worker: it evaluates its tests' gates and sends the results (and, once, its plan)."""

    is_worker = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan_sent = False

    def attach(self, report: pytest.TestReport) -> None:
        if not self.plan_sent and self.plan:
            # The controller of an xdist run collects nothing: each worker sends its gate plan once,
            # on its first report, so even a gate whose worker dies later has its threshold known.
            report.dnnsafety_plan = json.dumps(self.plan)
            self.plan_sent = True


class TorchrunRank(SingleProcess):
    """One of torchrun's ranks: every rank runs the same tests; the gates that declare
    :attr:`~pytest_dnnsafety.gates.GateDef.shards` split their batches; rank 0 reports.

    Before a test's gates run, the ranks tell each other whether its body passed; after each gate
    they agree on its verdict (:func:`pytest_dnnsafety.runtime.torchrun.agree_on_verdict`; a
    :attr:`~pytest_dnnsafety.gates.GateDef.timed` gate takes rank 0's).
    """

    def start(self) -> None:
        ranks.select_device(str(self.settings.get("device").value))  # `cuda`: this rank's GPU, before any model

    def writes_reports(self) -> bool:
        return ranks.is_main()

    def world_size(self) -> int:
        return ranks.world_size()

    def bodies_failed(self, why: str | None) -> list[tuple[int, str]]:
        """Every rank says whether its test body passed (``why`` None) before any gate runs.

        One collective per gated test, called by every rank whatever its body did, so the gates'
        own collectives stay in step.
        """
        if not ranks.active():
            return []
        ranks.ensure_group(str(self.settings.get("device").value))
        return [(r, text) for r, text in enumerate(ranks.gather(why)) if text is not None]

    def settle(self, spec: GateSpec, result: GateResult) -> None:
        if ranks.active():
            ranks.agree_on_verdict(result, spec.definition.timed)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        ranks.close()  # the process group, if the plugin created it


def role_for(config: pytest.Config) -> type[Any]:
    """This process's role, from how pytest was started (decided once, at ``pytest_configure``)."""
    if hasattr(config, "workerinput"):
        return XdistWorker
    if getattr(config.option, "dist", "no") != "no":
        return XdistController
    if ranks.launched():
        return TorchrunRank
    return SingleProcess
