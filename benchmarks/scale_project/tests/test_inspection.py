"""DeepInspect's class confusion and bias on the pooled features (layer ``flatten``).

A briefly trained model may never predict a class; ``unpredicted="exclude"`` gates on the classes it
predicts (the details list the excluded ones) instead of erroring.
"""

import pytest


@pytest.mark.max_class_confusion(1.0, layer="flatten", unpredicted="exclude")
def test_no_pair_of_classes_is_indistinguishable():
    """1 - NAPVD of the most confusable pair of predicted classes."""


@pytest.mark.max_class_bias(0.5, layer="flatten", label_filter=False, unpredicted="exclude")
def test_class_bias():
    """The largest avg_bias over class pairs."""
