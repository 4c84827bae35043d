"""The multi-label reader: which digits are on a canvas (fixtures ``reader`` and ``ml_data``)."""

import pytest


@pytest.mark.min_scenario_accuracy(0.55, by=["lighting"], score="f1", average="macro", model="reader", data="ml_data")
def test_reader_f1_holds_in_every_lighting(reader, ml_data):
    """Macro F1 over the 10 digits (a digit read as present at probability >= 0.5), per lighting;
    the bound is the bootstrap lower bound at 95% (an estimate). Measured: day 0.809, dusk 0.780,
    night 0.680 (bound 0.612)."""


@pytest.mark.min_scenario_accuracy(0.5, by=["clutter"], score="f1", average="macro", model="reader", data="ml_data")
def test_reader_f1_holds_under_clutter(reader, ml_data):
    """Macro F1 per clutter level. Measured: none 0.842, low 0.789, high 0.634 (bound 0.562)."""


@pytest.mark.max_class_confusion(0.1, layer="backbone.9", statistic="type2", model="reader", data="ml_data")
def test_no_digit_drags_in_another(reader, ml_data):
    """Type-2 confusion (DeepInspect, multi-label): for the worst pair of digits, P(both read | one
    present, the other absent), each conditioning set at least 10 canvases. Measured: 0.045 (1 and 5;
    every pair has 88-111 canvases). NAPVD on ``backbone.9`` calls every pair alike (0.98-0.99):
    most channels fire on every canvas, so the layer's activation profile says little here."""
