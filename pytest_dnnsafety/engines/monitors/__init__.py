"""Runtime safety monitors and their benchmark (Ferreira et al.; docs: gates/monitors.md): pure torch, no pytest import.

* :mod:`.base` — the :class:`Monitor` protocol (fit on ID data → score, higher = more OOD → calibrated threshold
  → alarm), :func:`fit_monitor`, user monitors (:class:`CustomMonitor`, :func:`as_monitor`);
* :mod:`.view` — :class:`MonitorView` (the model's outputs and hidden features through the session's shared
  activation cache; the inputs batch by batch through the runner; a torchrun rank's shard);
* :mod:`.overhead` — :func:`measure_overhead`;
* :mod:`.output` — :class:`MSP`, :class:`ODIN`, :class:`Energy`;
* :mod:`.detector` — :class:`DetectionScore` (a detector's top detection scores), its fault sets and errors;
* :mod:`.features` — :class:`OutsideTheBox`, :class:`ActivationPatterns`, :class:`Mahalanobis`;
* :mod:`.autoencoder` — :class:`Autoencoder` (the reconstruction error of the user's autoencoder);
* :mod:`.faults` — fault families (noise, distribution shift, anomalies, adversarial) at severities 1–5;
* :mod:`.stream` — :class:`FaultStream`: a fault set as lazy data, faulted batch by batch as it is read;
* :mod:`.metrics` — detection metrics (OOD = positive), AUROC, FPR@95%TPR, the system view.

The benchmark the gates run (imported by their modules, not re-exported here):

* :mod:`.variants` — its classifier and detector variants (:func:`~.variants.for_task`);
* :mod:`.session` — :class:`~.session.MonitorSession`: the session's memo, shared pass and fault sets;
* :mod:`.bench` — :class:`~.bench.MonitorBench`: one gate's fixtures, its monitors fitted and scored;
* :mod:`.gating` — the detection, selective-risk and overhead measurements and their results.
"""

from __future__ import annotations

from pytest_dnnsafety.engines.monitors import autoencoder as _autoencoder
from pytest_dnnsafety.engines.monitors import base as _base
from pytest_dnnsafety.engines.monitors import detector as _detection
from pytest_dnnsafety.engines.monitors import faults as _faults
from pytest_dnnsafety.engines.monitors import features as _features
from pytest_dnnsafety.engines.monitors import metrics as _metrics
from pytest_dnnsafety.engines.monitors import output as _output
from pytest_dnnsafety.engines.monitors import overhead as _overhead
from pytest_dnnsafety.engines.monitors import stream as _stream
from pytest_dnnsafety.engines.monitors import view as _view
from pytest_dnnsafety.engines.monitors.autoencoder import *
from pytest_dnnsafety.engines.monitors.base import *
from pytest_dnnsafety.engines.monitors.detector import *
from pytest_dnnsafety.engines.monitors.faults import *
from pytest_dnnsafety.engines.monitors.features import *
from pytest_dnnsafety.engines.monitors.metrics import *
from pytest_dnnsafety.engines.monitors.output import *
from pytest_dnnsafety.engines.monitors.overhead import *
from pytest_dnnsafety.engines.monitors.stream import *
from pytest_dnnsafety.engines.monitors.view import *

__all__: list[str] = []
for _module in (_view, _base, _overhead, _output, _detection, _features, _autoencoder, _faults, _stream, _metrics):
    __all__ += _module.__all__
del _module
