"""What a runtime monitor may read about one data set: :class:`MonitorView` (Ferreira et al.; docs: gates/monitors.md).

The model's outputs and the per-neuron features of hidden layers come from the session's
:class:`~pytest_dnnsafety.engines.core.capture.ActivationCache`, so every monitor of a session (and every
neuron gate) on the same model and data shares one forward pass; those are per-input values (logits,
predictions, neuron reductions), never the inputs. Monitors that need more than one plain pass
(ODIN's input perturbation, an autoencoder, a user monitor's ``score``) read the inputs batch by
batch through the view's :class:`~pytest_dnnsafety.engines.core.runner.Runner` (:meth:`MonitorView.runner`
and :meth:`MonitorView.each`), so a ``DataLoader`` streams and nothing holds the whole data set.

Under torchrun a view may hold one rank's :class:`~pytest_dnnsafety.runtime.torchrun.Shard`: its outputs,
features and batches are then that rank's rows only (the batches of the single-process run, with
their global indices), and :meth:`~pytest_dnnsafety.engines.monitors.Monitor.score` all-gathers the
per-input scores, so every rank holds the single-process scores. Pure torch; no pytest import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.capture import ActivationCache, ModelOutputs
from pytest_dnnsafety.data.forms import known_length
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.engines.core.runner import Batch, Runner, model_device

__all__ = ["MonitorView"]

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class MonitorView:
    """What a monitor may read about one data set; forward passes shared through the session ActivationCache.

    ``model`` and ``data`` (any accepted data form: tensors, ``(x, y)``, a dict, a ``TensorDataset``, an
    in-order ``DataLoader``); ``batch_size`` and ``device`` as for the neuron gates (``device`` only for a
    model without parameters: batches go to the model's own device). ``cache``: the session's
    :class:`~pytest_dnnsafety.engines.core.capture.ActivationCache` (a private one when None). ``plan``: layers to
    capture in the same pass as the outputs (the monitors' :meth:`Monitor.layers`). ``rows``: a subset of
    the data's rows (1-D int64 indices; see :meth:`subset`). ``shard``: this torchrun rank's
    :class:`~pytest_dnnsafety.runtime.torchrun.Shard` of the data (not with ``rows``): the view is that rank's rows, and
    ``Monitor.score`` all-gathers the ranks' scores unless ``gather`` is False (every rank then scores its own
    rows alone, e.g. to time the monitor on one rank).
    """

    def __init__(self, model: Any, data: Any, *, batch_size: int = 256, device: torch.device | str = "cpu",
                 cache: ActivationCache | None = None, plan: Iterable[str] = (), rows: Tensor | None = None,
                 shard: Any = None, gather: bool = True) -> None:
        self.model = model
        self.data = data
        self.batch_size = check_count(batch_size, "batch_size", 1, "pass a positive batch size, e.g. 256.")
        self.device = torch.device(device)
        self.cache = cache if cache is not None else ActivationCache()
        self.plan = tuple(plan)
        self.shard = shard
        self.gather = bool(gather)
        self.rows: Tensor | None = None
        self._sorted = True
        if rows is not None:
            if shard is not None:
                raise ConfigError("a MonitorView takes rows= or shard=, not both. Fix: subset the whole view.")
            rows = torch.as_tensor(rows).detach().to("cpu")
            if rows.ndim != 1 or rows.dtype not in _INDEX_DTYPES:
                raise ConfigError(f"rows of shape {tuple(rows.shape)} and dtype {rows.dtype} are not row indices. "
                                  f"Fix: pass a 1-D integer tensor of row indices.")
            self.rows = rows.long()
            self._sorted = bool((self.rows[1:] > self.rows[:-1]).all()) if self.rows.numel() > 1 else True
        self._outputs: ModelOutputs | None = None
        self._features: dict[tuple[str, str], Tensor] = {}

    # -- sizes and the model's device

    @property
    def n_inputs(self) -> int:
        """Inputs of the view (this rank's share under a shard)."""
        if self.rows is not None:
            return int(self.rows.numel())
        if self.shard is not None:
            return int(self.shard.n_local)
        n = known_length(self.data)
        return int(n) if n is not None else self.outputs().n_inputs

    @property
    def first_row(self) -> int:
        """The data row of the view's first input (a shard's first row; else 0)."""
        return int(self.shard.rows[0]) if self.shard is not None else 0

    @property
    def model_device(self) -> torch.device:
        try:
            return model_device(self.model, self.device)
        except Exception:  # a scripted/exported module may refuse parameters(); use the fallback
            return self.device

    def _select(self, tensor: Tensor) -> Tensor:
        return tensor if self.rows is None else tensor[self.rows.to(tensor.device)]

    def _select_labels(self, labels: Any) -> Any:
        """Labels (a tensor) or a detector's packed boxes (a :class:`~pytest_dnnsafety.data.tasks.BoxSet`) of the rows."""
        if labels is None or self.rows is None:
            return labels
        if isinstance(labels, BoxSet):
            from pytest_dnnsafety.engines.core.detections import select_images

            return select_images(labels, self.rows)
        return self._select(labels)

    # -- the shared pass

    def outputs(self) -> ModelOutputs:
        """The model's :class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs` on the view's rows (cached pass)."""
        if self._outputs is None:
            out = self.cache.outputs(self.model, self.data, batch_size=self.batch_size, device=self.device,
                                     plan=self.plan, shard=self.shard)
            if self.rows is not None:
                n = out.n_inputs
                if self.rows.numel() and (int(self.rows.min()) < 0 or int(self.rows.max()) >= n):
                    raise ConfigError(f"rows reach index {int(self.rows.max())} but the data has {n} inputs. "
                                      f"Fix: select rows in 0..{n - 1}.")
                out = ModelOutputs(self._select(out.predictions), self._select(out.confidence),
                                   self._select_labels(out.labels), out.num_classes,
                                   self._select(out.logits) if out.logits is not None else None,
                                   self._select_labels(out.detections))
            self._outputs = out
        return self._outputs

    def logits(self) -> Tensor:
        """``(N, K)`` float32 raw class scores on the model's device; MetricError for a label-returning model."""
        outputs = self.outputs()
        logits = outputs.logits
        if logits is None and outputs.detections is not None:
            raise MetricError(
                "the model is an object detector (one dict of boxes, scores and labels per image), so an output-based "
                "classifier monitor (maximum softmax, ODIN, energy) has no class scores to read. Fix: use "
                "DetectionScore() (1 - the top detection score) in the `monitors` fixture, or a feature monitor "
                "(outside_the_box, activation_patterns, mahalanobis) on one of its layers.")
        if logits is None:
            raise MetricError(
                "the model returns class labels (shape (batch,)), not class scores, so an output-based monitor "
                "(maximum softmax, ODIN, energy) has nothing to score. Fix: return logits (batch, classes) from "
                "the model, or use a feature monitor (outside_the_box, activation_patterns, mahalanobis)."
            )
        return logits

    def predictions(self) -> Tensor:
        return self.outputs().predictions

    def labels(self) -> Tensor | None:
        return self.outputs().labels

    def features(self, layer: str, reduce: str = "max") -> Tensor:
        """``(N, c)`` per-neuron features of ``layer`` (a conv channel reduced by its spatial max or mean)."""
        key = (layer, reduce)
        if key not in self._features:
            acts = self.cache.get(self.model, self.data, [layer], batch_size=self.batch_size, device=self.device,
                                  plan=self.plan, shard=self.shard)[layer]
            self._features[key] = self._select(acts.reduced(reduce))
        return self._features[key]

    # -- the inputs themselves, batch by batch

    def runner(self, what: str) -> Runner:
        """A :class:`~pytest_dnnsafety.engines.core.runner.Runner` over the view's data (its model, device, batch size
        and shard); pass it to :meth:`each`, take guards from it, and call its ``check()`` after the loop."""
        return Runner(what, model=self.model, device=self.device, batch_size=self.batch_size, shard=self.shard)

    def each(self, runner: Runner) -> Iterator[Batch]:
        """The view's batches, in the view's row order, through ``runner`` (inputs on the model's device).

        Without ``rows`` these are the runner's batches. With sorted ``rows`` each batch keeps its selected
        inputs (a batch with none is skipped). With rows in another order (:meth:`subset` of arbitrary
        indices) the selected inputs, and only those, are collected and re-cut in that order.
        """
        rows = self.rows
        if rows is None:
            yield from runner.batches(self.data)
            return
        picked: list[tuple[Tensor, Tensor, Tensor | None]] = []  # (positions in rows, x, y), unsorted rows only
        order = torch.sort(rows, stable=True)
        for batch in runner.batches(self.data):
            lo = int(torch.searchsorted(order.values, batch.start))
            hi = int(torch.searchsorted(order.values, batch.start + batch.n))
            if hi == lo:
                continue
            local = (order.values[lo:hi] - batch.start).to(batch.x.device)
            x, y = batch.x[local], (batch.y[local] if batch.y is not None else None)
            if self._sorted:
                yield Batch(index=batch.index, start=lo, x=x, y=y)
            else:
                picked.append((order.indices[lo:hi], x, y))
        if self._sorted or not picked:
            return
        where = torch.cat([p for p, _, _ in picked]).argsort().to(picked[0][1].device)
        x_all = torch.cat([x for _, x, _ in picked])[where]
        y_all = torch.cat([y for _, _, y in picked])[where] if all(y is not None for _, _, y in picked) else None
        for index, start in enumerate(range(0, x_all.shape[0], self.batch_size)):
            yield Batch(index=index, start=start, x=x_all[start:start + self.batch_size],
                        y=y_all[start:start + self.batch_size] if y_all is not None else None)

    def batches(self) -> Iterator[tuple[Tensor, Tensor | None]]:
        """``(x, y)`` batches of the view's rows (:meth:`each` with a runner of its own, checked at the end)."""
        runner = self.runner("monitor view")
        for batch in self.each(runner):
            yield batch.x, batch.y
        runner.check()

    def inputs(self) -> Tensor:
        """All inputs of the view's rows, concatenated, on the model's device.

        Holds the whole view in memory: only for a user monitor's ``fit(model, x, y)``, which takes its fit
        inputs at once (:class:`~pytest_dnnsafety.engines.monitors.CustomMonitor`); everything else streams.
        """
        xs = [x for x, _ in self.batches()]
        if not xs:
            raise DataError("no inputs: the data set (or the selected rows) is empty. Fix: provide data with at "
                            "least one sample.")
        return torch.cat(xs)

    def subset(self, rows: Tensor) -> MonitorView:
        """The same data and cache restricted to ``rows`` (indices into this view's rows): no new forward pass."""
        if self.shard is not None:
            raise ConfigError("a sharded MonitorView cannot be subset. Fix: subset the whole view.")
        rows = torch.as_tensor(rows).detach().to("cpu").long()
        absolute = self.rows[rows] if self.rows is not None else rows
        return MonitorView(self.model, self.data, batch_size=self.batch_size, device=self.device, cache=self.cache,
                           plan=self.plan, rows=absolute)

    def __repr__(self) -> str:
        rows = "all rows" if self.rows is None else f"{int(self.rows.numel())} rows"
        if self.shard is not None:
            rows = f"rows {self.shard.rows[0]}..{self.shard.rows[1] - 1} of {self.shard.n_rows}"
        return f"MonitorView({type(self.model).__name__}, {rows}, batch_size={self.batch_size})"
