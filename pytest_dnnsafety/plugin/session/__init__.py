"""The per-run state of each process: gate plan, results, provenance; one class per process role.

One session object is registered per process by :mod:`pytest_dnnsafety.plugin.hooks` (``pytest_configure``),
of the class :func:`role_for` picks, in the manner of pytest-cov's engines (Central, DistMaster,
DistWorker):

* :class:`SingleProcess`: collects, evaluates every gate, reports;
* :class:`XdistWorker`: collects and evaluates its tests' gates; attaches the results to each test's
  report as a JSON string (only plain strings cross pytest-xdist workers), and its gate plan to its
  first report;
* :class:`XdistController`: runs no test; knows every gate before it runs from its workers' plans,
  gathers their results, fails the run when an expected gate never reported;
* :class:`TorchrunRank`: a single process that evaluates in step with the other ranks; rank 0 reports.

The roles share :class:`DnnSafetyPlugin` (:mod:`.base`), the test-running part :class:`Evaluating`
(:mod:`.evaluating`: marker validation at collection, fixture provenance, evaluation) and the
reporting part :class:`Gathering` (:mod:`.gathering`). The outputs themselves (JSON evidence, HTML,
baseline, JUnit properties, GitHub job summary, terminal section) and the baseline verdict are the
report package's (:mod:`pytest_dnnsafety.report`); nothing here formats them.
"""

from __future__ import annotations

from typing import Any, Mapping

import pytest

from pytest_dnnsafety.settings import Settings
from pytest_dnnsafety.gates import GateDef
from pytest_dnnsafety.plugin.session.base import DnnSafetyPlugin, unmeasured
from pytest_dnnsafety.plugin.session.evaluating import PLUGIN_FIXTURE_SETTINGS, Evaluating
from pytest_dnnsafety.plugin.session.gathering import Gathering
from pytest_dnnsafety.plugin.session.roles import SingleProcess, TorchrunRank, XdistController, XdistWorker, role_for

__all__ = ["DnnSafetyPlugin", "PLUGIN_FIXTURE_SETTINGS", "Evaluating", "Gathering", "SingleProcess",
           "XdistController", "XdistWorker", "TorchrunRank", "role_for", "make_session", "unmeasured"]


def make_session(config: pytest.Config, settings: Settings, registry: Mapping[str, GateDef]) -> Any:
    """This process's session object, of the role :func:`role_for` picks for ``config``."""
    return role_for(config)(config, settings, registry)
