"""ForwardGuard: a model's exceptions, wrong shapes and NaN/inf outputs become clear MetricErrors."""

from __future__ import annotations

import pytest
import torch

from pytest_dnnsafety.errors import MetricError
from pytest_dnnsafety.engines.core.guard import ForwardGuard, describe_model


def _conv(num_classes: int = 10) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 8 * 8, num_classes)).eval()


def _batches(n: int = 3, size: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.rand(size, 1, 8, 8, generator=gen) for _ in range(n)]


def test_good_model_passes_and_learns_the_class_count() -> None:
    guard = ForwardGuard("gate")
    model = _conv()
    for x in _batches():
        out = guard(model, x)
        assert out.shape == (5, 10)
    guard.check()
    assert guard.num_classes == 10 and guard.batches == 3


@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
def test_non_finite_rows_name_the_first_bad_batch(poison: str) -> None:
    guard = ForwardGuard("my_gate")
    model = _conv()
    for i, x in enumerate(_batches(4)):
        out = model(x).detach()
        if i in (2, 3):  # one row of batches 2 and 3 goes bad, as a corrupted layer would make it
            out[1, 3] = float(poison)
        guard.observe(out, x)
    with pytest.raises(MetricError, match=r"^my_gate: the model's outputs hold NaN/inf in 2 of 20 inputs; the "
                                          r"first bad batch is batch 2\."):
        guard.check()


def test_all_nan_model_is_caught() -> None:
    model = _conv()
    with torch.no_grad():
        model[3].bias.fill_(float("nan"))
    guard = ForwardGuard("g")
    for x in _batches():
        guard(model, x)
    with pytest.raises(MetricError, match="in 15 of 15 inputs; the first bad batch is batch 0"):
        guard.check()


def test_a_raising_model_names_batch_shape_and_fix() -> None:
    model = _conv()
    guard = ForwardGuard("g")
    guard(model, _batches(1)[0])
    with pytest.raises(MetricError, match=r"^g: the model raised RuntimeError on batch 1 \(inputs of shape "
                                          r"\(5, 64\), float32, on cpu; model: Sequential with float32 weights "
                                          r"on cpu\)") as info:
        guard(model, torch.rand(5, 64))
    assert "Fix: give inputs in the shape the model expects" in str(info.value)


def test_float64_weights_with_float32_data_say_which_to_convert() -> None:
    model = _conv().double()
    with pytest.raises(MetricError, match="the inputs are float32 but the model's weights are float64"):
        ForwardGuard("g")(model, _batches(1)[0])


@pytest.mark.parametrize(("output", "message"), [
    (lambda x: x.flatten(1)[:, :1], "one score per input"),
    (lambda x: x.flatten(1)[:-1, :3], r"returned shape \(4, 3\) for 5 inputs"),
    (lambda x: x[:, 0, 0, :3].unsqueeze(-1), r"returned shape \(5, 3, 1\)"),
    (lambda x: [1, 2, 3], "returned list, not a tensor"),
])
def test_wrong_output_shapes_are_refused(output, message) -> None:
    with pytest.raises(MetricError, match=message):
        ForwardGuard("g")(output, _batches(1)[0])


def test_class_count_must_stay_the_same() -> None:
    guard = ForwardGuard("g", num_classes=10)
    with pytest.raises(MetricError, match="returned 3 class scores, expected 10"):
        guard(lambda x: x.flatten(1)[:, :3], _batches(1)[0])


def test_integer_labels_only_where_allowed() -> None:
    labels = lambda x: torch.zeros(x.shape[0], dtype=torch.int64)  # noqa: E731
    assert ForwardGuard("g", labels_ok=True)(labels, _batches(1)[0]).shape == (5,)
    with pytest.raises(MetricError, match=r"returned shape \(5,\)"):
        ForwardGuard("g")(labels, _batches(1)[0])


def test_no_host_sync_in_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Observing outputs must not read tensors back (item/bool/int) until check()."""
    guard = ForwardGuard("g")
    model = _conv()
    calls = []
    for name in ("item", "__bool__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: calls.append(_n) or _o(self))
    for x in _batches():
        with torch.no_grad():
            guard.observe(model(x), x)
    assert calls == []
    guard.check()
    assert calls  # the one sync happens here


def test_describe_model_for_callables_and_modules() -> None:
    assert describe_model(lambda x: x) == "function"
    assert describe_model(_conv()) == "Sequential with float32 weights on cpu"
