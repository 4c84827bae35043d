"""Runtime safety monitors and their benchmark (Ferreira et al.; README "Runtime monitors"): pure torch, no pytest import.

* :mod:`.base` — the :class:`Monitor` protocol (fit on ID data → score, higher = more OOD → calibrated threshold
  → alarm), :class:`MonitorView` (the model's outputs and hidden features through the session's shared
  activation cache), :func:`fit_monitor`, user monitors (:class:`CustomMonitor`, :func:`as_monitor`) and
  :func:`measure_overhead`;
* :mod:`.output` — :class:`MSP`, :class:`ODIN`, :class:`Energy`;
* :mod:`.features` — :class:`OutsideTheBox`, :class:`ActivationPatterns`, :class:`Mahalanobis`;
* :mod:`.autoencoder` — :class:`Autoencoder` (the reconstruction error of the user's autoencoder);
* :mod:`.faults` — fault families (noise, distribution shift, anomalies, adversarial) at severities 1–5;
* :mod:`.metrics` — detection metrics (OOD = positive), AUROC, FPR@95%TPR, the system view.
"""

from __future__ import annotations

from . import autoencoder as _autoencoder
from . import base as _base
from . import faults as _faults
from . import features as _features
from . import metrics as _metrics
from . import output as _output
from . import overhead as _overhead
from .autoencoder import *
from .base import *
from .faults import *
from .features import *
from .metrics import *
from .output import *
from .overhead import *

__all__: list[str] = []
for _module in (_base, _overhead, _output, _features, _autoencoder, _faults, _metrics):
    __all__ += _module.__all__
del _module
