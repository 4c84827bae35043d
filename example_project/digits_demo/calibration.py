"""A custom dependability gate, written only against pytest-dnnsafety's public API.

``@pytest.mark.max_calibration_error(threshold, bins=15)`` fails unless the expected calibration
error (ECE) of the model's softmax confidence on the evaluation data is at most ``threshold``:

    ECE = sum over bins b of (n_b / N) * |accuracy_b - mean confidence_b|

with ``bins`` equal-width confidence bins over [0, 1] (Guo et al., *On Calibration of Modern Neural
Networks*, ICML 2017, eq. 3). A reader that says "95% sure" should be right about 95% of the time;
a safety monitor that thresholds the confidence relies on it.

The gate is registered in ``tests/conftest.py`` through the ``pytest_dnnsafety_register_gates``
hook (or, for a package of gates, by this module's own hook with ``-p digits_demo.calibration`` or a
``pytest11`` entry point).
"""

from __future__ import annotations

from typing import Any, Mapping

from pytest_dnnsafety import (ForwardGuard, GateContext, GateDef, GateRegistry, GateSpec, Measurement, MetricError, Param,
                              hookimpl)

__all__ = ["MAX_CALIBRATION_ERROR", "expected_calibration_error"]


def expected_calibration_error(model: Any, data: Any, *, bins: int = 15, batch_size: int = 256,
                               device: Any = "cpu") -> dict[str, Any]:
    """ECE of ``model``'s softmax on labelled ``data`` (a dataset of ``(x, y)``), batched on ``device``.

    Per-bin counts, confidence sums and correct counts stay on the device (no host sync per
    batch); the result holds the ECE, the accuracy, the mean confidence and the bins.
    """
    import torch

    counts = torch.zeros(bins, dtype=torch.float64, device=device)
    confidence = torch.zeros(bins, dtype=torch.float64, device=device)
    correct = torch.zeros(bins, dtype=torch.float64, device=device)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)
    # The plugin's guard: a model that raises, returns the wrong shape or NaN/inf is an error, never a score.
    guard = ForwardGuard("max_calibration_error: model on the evaluation data")
    with torch.no_grad():
        for batch in loader:
            if len(batch) < 2:
                raise MetricError("the calibration error needs labelled data (x, y). Fix: give a dataset with labels")
            x, y = batch[0].to(device), batch[1].to(device)
            probs = torch.softmax(guard(model, x).double(), dim=1)
            conf, pred = probs.max(dim=1)
            # bin b holds confidences in [b/bins, (b+1)/bins); NaN goes to bin 0 only to keep the loop well-defined:
            # guard.check() after the loop refuses such outputs
            index = (conf.nan_to_num(0.0) * bins).long().clamp(0, bins - 1)
            counts.index_add_(0, index, torch.ones_like(conf))
            confidence.index_add_(0, index, conf)
            correct.index_add_(0, index, (pred == y).double())
    guard.check()  # one host sync, after the loop: names the first batch with NaN/inf outputs
    n = counts.sum()
    if n.item() == 0:
        raise MetricError("the evaluation data is empty; the calibration error needs at least one sample")
    gap = (correct - confidence).abs()
    ece = (gap.sum() / n).item()  # sum_b n_b/N * |acc_b - conf_b| = sum_b |correct_b - confidence_b| / N
    counts, confidence, correct = counts.cpu().tolist(), confidence.cpu().tolist(), correct.cpu().tolist()
    return {
        "ece": ece,
        "samples": int(sum(counts)),
        "accuracy": sum(correct) / sum(counts),
        "mean_confidence": sum(confidence) / sum(counts),
        "bins": [{"low": b / bins, "high": (b + 1) / bins, "count": int(c),
                  "accuracy": (k / c) if c else None, "confidence": (s / c) if c else None}
                 for b, (c, s, k) in enumerate(zip(counts, confidence, correct))],
    }


def _measure(spec: GateSpec, fixtures: Mapping[str, Any], ctx: GateContext) -> Measurement:
    result = expected_calibration_error(fixtures["model"], fixtures["data"], bins=spec.options["bins"],
                                        batch_size=ctx.batch_size, device=ctx.device)
    detail = (f"{spec.options['bins']} bins, {result['samples']} samples, accuracy {result['accuracy']:.3f}, "
              f"mean confidence {result['mean_confidence']:.3f}")
    return Measurement(value=result["ece"], detail=detail, details=result)


def _bins(value: int) -> str | None:
    return None if 1 <= value <= 1000 else f"{value!r} is outside [1, 1000]"


MAX_CALIBRATION_ERROR = GateDef(
    marker="max_calibration_error",
    metric="expected calibration error",
    op="<=",
    threshold_range=(0.0, 1.0),
    params=(Param("bins", (int,), 15, _bins, "use a number of equal-width confidence bins in 1..1000, e.g. 15"),),
    fixtures={"model": "model", "data": "dataset"},
    measure=_measure,
    doc="fail unless the expected calibration error of the model's softmax confidence on the data "
        "(equal-width bins) is at most `threshold` (Guo et al. 2017, eq. 3)",
)


@hookimpl
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add(MAX_CALIBRATION_ERROR)
