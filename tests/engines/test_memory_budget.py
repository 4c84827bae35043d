"""Batch sizes from a memory budget (issue #30 §5): the measured bytes per input, not a fixed count."""

from __future__ import annotations

from pathlib import Path

import pytest

from _rss import run_script
import torch
from torch import nn

from pytest_dnnsafety.engines.core import budget
from pytest_dnnsafety.engines.core.budget import chunk_size, input_cost, spans
from pytest_dnnsafety.engines.core.capture import capture
from pytest_dnnsafety.engines.interpretability.occlusion import assess_occlusion, occlusion_maps
from pytest_dnnsafety.engines.robustness.confidence import assess_adversarial_confidence
from pytest_dnnsafety.engines.robustness.perturbations import make_family
from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.runtime.sizes import (DEFAULT_WORKING_MEMORY, MIN_MEMORY, batch_for, memory_budget,
                                            working_memory)


class Net(nn.Module):
    """A small conv net that counts its calls and the rows it sees per call."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * width, 4))
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(int(x.shape[0]))
        return self.body(x)


def _images(n: int = 12, side: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.rand(n, 3, side, side, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def test_the_budget_is_a_context_with_a_default() -> None:
    assert working_memory() == DEFAULT_WORKING_MEMORY == 2**30
    with memory_budget("64MiB") as size:
        assert size == working_memory() == 64 * 2**20
        with memory_budget(None):
            assert working_memory() == DEFAULT_WORKING_MEMORY
        assert working_memory() == 64 * 2**20
    assert working_memory() == DEFAULT_WORKING_MEMORY
    with pytest.raises(ConfigError, match="dnnsafety_max_memory='1MiB'.*Fix"):
        with memory_budget("1MiB", "dnnsafety_max_memory"):
            pass


def test_batch_for_fits_the_budget_and_tries_at_least_one() -> None:
    assert batch_for(10 * 2**20, budget=100 * 2**20) == 10
    assert batch_for(10 * 2**20, fixed=50 * 2**20, budget=100 * 2**20) == 5
    assert batch_for(10 * 2**20, budget=2**20) == 1  # one input is always tried
    assert batch_for(1, budget=2**30, cap=7) == 7
    assert list(spans(7, 3)) == [(0, 3), (3, 6), (6, 7)]


def test_the_measured_cost_grows_with_the_input_and_with_a_backward_pass() -> None:
    net = Net().eval()
    small, _ = _images(side=16)
    large, _ = _images(side=32)
    per_small, _ = input_cost(net, small)
    per_large, _ = input_cost(net, large)
    per_grad, _ = input_cost(net, large, grad=True)
    # at least the conv activations of one input (16 channels x H x W float32), about 4x for twice the side
    assert per_small >= 16 * 16 * 16 * 4 and 3 * per_small <= per_large <= 5 * per_small
    assert per_grad > per_large
    calls = len(net.rows)
    input_cost(net, large)  # measured once per model and input form
    assert len(net.rows) == calls


def test_a_model_the_probe_cannot_follow_gets_the_fallback() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no")

    x, _ = _images()
    per, fixed = input_cost(broken, x)
    assert per == x[0].numel() * 4 * budget.FALLBACK_FACTOR[0] and fixed == 0


def test_a_small_budget_gives_small_chunks() -> None:
    net = Net().eval()
    x, _ = _images(side=32)
    per, _ = input_cost(net, x)
    with memory_budget(MIN_MEMORY):
        small = chunk_size(net, x)
    assert small == max(1, int(MIN_MEMORY // (per * budget.MARGIN)))
    assert chunk_size(net, x) > small
    assert chunk_size(net, x, budget=int(3 * per * budget.MARGIN)) == 3


def test_occlusion_chunks_follow_the_budget_with_the_same_maps() -> None:
    net = Net(32).eval()
    x, _ = _images(n=2, side=64)
    whole = occlusion_maps(net, x, size=16, stride=16)[0]
    before = len(net.rows)
    with memory_budget(MIN_MEMORY):
        cost = input_cost(net, x)[0] * budget.MARGIN + 3 * x[0].numel() * 4 + 64 * 64
        chunked = occlusion_maps(net, x, size=16, stride=16)[0]
    calls = net.rows[before + 1:]  # after the clean forward
    assert max(calls) == max(1, int(MIN_MEMORY // cost)) < 2 * 16 and len(calls) > 1
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    before = len(net.rows)
    assert occlusion_maps(net, x, size=16, stride=16, max_batch=2)[0].shape == whole.shape  # a cap still applies
    assert max(net.rows[before + 1:]) == 2


def test_assess_occlusion_is_the_same_under_a_small_budget() -> None:
    net = Net(32).eval()
    x, _ = _images(n=3, side=64)
    masks = torch.zeros(3, 64, 64, dtype=torch.bool)
    masks[:, 16:40, 16:40] = True
    whole = assess_occlusion(net, x, masks, size=16, stride=16, batch_size=3)
    with memory_budget(MIN_MEMORY):
        chunked = assess_occlusion(net, x, masks, size=16, stride=16, batch_size=3)
    assert chunked.interpret_mean == pytest.approx(whole.interpret_mean, rel=1e-6)
    assert chunked.occsen_mean == pytest.approx(whole.occsen_mean, rel=1e-6)
    assert chunked.hot_total == whole.hot_total


@pytest.mark.parametrize("family", ["fgsm", "pgd", "translation", "brightness"])
def test_attacks_split_a_batch_by_the_budget_with_the_same_results(family: str) -> None:
    net = Net(32).eval()
    x, y = _images(n=6, side=64)
    fams = {family: make_family(family, clip=(0.0, 1.0))}
    whole = assess_adversarial_confidence(net, (x, y), fams, eps=0.03, batch_size=6, clip=(0.0, 1.0), seed=3)
    start = len(net.rows)
    grad = fams[family].gradient
    with memory_budget(MIN_MEMORY):
        per = chunk_size(net, x, grad=grad, extra=3 * x[0].numel() * 4)
        forward = chunk_size(net, x)  # the k candidates of a natural family: forwards of at most this many
        chunked = assess_adversarial_confidence(net, (x, y), fams, eps=0.03, batch_size=6, clip=(0.0, 1.0), seed=3)
    # no call saw the whole batch (a gradient family's) or all its k candidates at once (a natural family's)
    assert (per < 6) if grad else (forward < 6 * fams[family].candidates)
    assert max(net.rows[start:]) <= (per if grad else forward)
    if family != "pgd":  # pgd's random start draws per chunk: the same distribution, other draws
        assert chunked.m_adv == pytest.approx(whole.m_adv, rel=1e-5, abs=1e-6)
        assert chunked.robust_accuracy == whole.robust_accuracy
    else:
        assert chunked.n == whole.n


def test_the_shared_pass_splits_a_batch_by_the_budget_with_the_same_values() -> None:
    net = Net(32).eval()
    x, y = _images(n=12, side=64)
    whole = capture(net, (x, y), ["body.1"], batch_size=12)["body.1"]
    start = len(net.rows)
    per = input_cost(net, x)[0]
    with memory_budget(MIN_MEMORY):
        size = chunk_size(net, x)
        chunked = capture(net, (x, y), ["body.1"], batch_size=12)["body.1"]
    assert size < 12 and max(net.rows[start:]) == size and len(net.rows) - start > 1
    torch.testing.assert_close(chunked.max, whole.max)
    torch.testing.assert_close(chunked.mean, whole.mean)


# ----------------------------------------------------------------------------- 224x224, real width (fresh process)

_RSS_SCRIPT = """
    from pytest_dnnsafety.engines.core.budget import chunk_size
    from pytest_dnnsafety.engines.interpretability.occlusion import occlusion_maps

    torch.set_num_threads(2)
    model = resnet18(width=64).eval()
    x = torch.rand(3, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    chunk = chunk_size(model, x, extra=3 * x[0].numel() * 4 + 224 * 224)
    occlusion_maps(model, x, size=56, stride=56, max_batch=4096)  # 48 copies: one chunk of the budget's size
    print(chunk, hwm())
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for the peak RSS")
def test_occlusion_at_224_on_a_real_resnet18_stays_under_2_gib() -> None:
    """The former fixed chunk (222 copies of a 224x224 image) took 2.3 GiB; the default 1 GiB budget gives ~100."""
    chunk, peak = map(int, run_script(_RSS_SCRIPT, 300).split()[-2:])
    assert 40 <= chunk <= 150, chunk  # ~6 MiB measured per input, x1.5, plus the copies: ~100 in 1 GiB
    assert peak < 2 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"
