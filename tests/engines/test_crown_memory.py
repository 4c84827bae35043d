"""CROWN's memory budget (issue #21, item 4): ``max_memory`` parsed, respected, and never changing a bound.

* sizes: ``"2GiB"``/``"512MiB"``/bytes parse; bad ones raise naming ``max_memory`` (engine) or the
  marker argument (``min_verified_robustness(max_memory=...)``);
* chunking: the bounds of a residual CNN with BatchNorm are the same (float64, 1e-9) whatever the budget,
  from one part and large chunks to many parts of one input and chunks of a few rows;
* the budget is respected: no coefficient tensor of a sweep exceeds ``max_elements`` (derived from
  ``max_memory``), the parts' per-input state fits half the budget, and (slow) the peak RSS growth of
  CROWN on a ResNet-18-style model in a fresh process stays below ``max_memory``;
* the refined intervals that select the neurons CROWN bounds are sound (sampled points inside, never
  looser than plain IBP).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _rss import run_script
import torch
from torch import nn

from pytest_dnnsafety.engines.bounds import crown as bounds_crown
from pytest_dnnsafety.engines.bounds.model import BoundedModel
from pytest_dnnsafety.engines.bounds.box import input_box
from pytest_dnnsafety.engines.robustness.verification import verify_robustness
from pytest_dnnsafety.errors import ConfigError, MarkerError
from pytest_dnnsafety.gates import parse_marker
from pytest_dnnsafety.runtime.sizes import MIN_MEMORY, parse_memory

ROOT = Path(__file__).resolve().parents[2]


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)


def resnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), Block(4), Block(4),
                          nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.copy_(0.1 * torch.randn(4, generator=gen))
            module.running_var.copy_(0.5 + torch.rand(4, generator=gen))
    return model.eval().double()


def boxes(n: int = 7, eps: float = 0.03) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.rand(n, 3, 6, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    lo, hi = input_box(x, eps, (0.0, 1.0))
    return x, lo, hi


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(("text", "size"), [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("512 mib", 512 << 20),
                                            ("1.5GB", 1_500_000_000), ("64MB", 64_000_000), (1 << 30, 1 << 30)])
def test_sizes_parse(text: object, size: int) -> None:
    assert parse_memory(text) == size
    assert BoundedModel(resnet(), max_memory=text).max_memory == size


@pytest.mark.parametrize("bad", ["lots", "2 GiBs", "-1GiB", "", "1KiB", 1024, -5, True, 2.5, [1]])
def test_bad_sizes_name_the_argument(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"max_memory=.*Fix: give max_memory as bytes"):
        BoundedModel(resnet(), max_memory=bad)  # type: ignore[arg-type]


def test_marker_option() -> None:
    spec = parse_marker("min_verified_robustness", (0.5,), {"eps": 0.01, "max_memory": "512MiB"}, "t.py::t")
    assert spec.options["max_memory"] == "512MiB"
    assert parse_marker("min_verified_robustness", (0.5,), {"eps": 0.01}, "t.py::t").options["max_memory"] is None
    assert parse_marker("min_verified_robustness", (0.5,), {"eps": 0.01, "max_memory": 1 << 30},
                        "t.py::t").options["max_memory"] == 1 << 30
    for bad in ("lots", "1KiB", 1000, 2.5, True):
        with pytest.raises(MarkerError, match=r"argument max_memory: .*Fix: give the bounds' working-memory budget"):
            parse_marker("min_verified_robustness", (0.5,), {"eps": 0.01, "max_memory": bad}, "t.py::t")


# ----------------------------------------------------------------------------- chunking changes nothing


@pytest.mark.slow
def test_bounds_identical_across_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    model = resnet()
    x, lo, hi = boxes(4)
    y = model(x).argmax(1)
    spec = torch.randn(2, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    reference = BoundedModel(model)  # one part, large chunks
    want = (reference.crown(lo, hi), reference.crown(lo, hi, spec), reference.margin_lower_bounds(lo, hi, y))
    parts: list[int] = []
    original = bounds_crown.BoundState.__init__

    def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        parts.append(self.batch)

    monkeypatch.setattr(bounds_crown.BoundState, "__init__", counting)
    monkeypatch.setattr(bounds_crown, "STATE_COPIES", 40_000)  # the 16 MiB minimum holds one input's state
    for small in (BoundedModel(model, max_memory=MIN_MEMORY, max_elements=2000), BoundedModel(model, max_memory="16MiB")):
        parts.clear()
        got = (small.crown(lo, hi), small.crown(lo, hi, spec), small.margin_lower_bounds(lo, hi, y))
        for g, w in zip((*got[0], *got[1], got[2]), (*want[0], *want[1], want[2])):
            assert torch.allclose(g, w, atol=1e-9, rtol=0), (g - w).abs().max()
        assert len(parts) > 1 or small.max_memory > MIN_MEMORY  # the batch was split in parts
    # and the verdicts of the driver are the same
    data = (x.float(), y)
    one = verify_robustness(model.float(), data, 0.03, clip=(0, 1), attack_steps=2)
    two = verify_robustness(model.float(), data, 0.03, clip=(0, 1), attack_steps=2, max_memory="16MiB")
    assert (one.verified, one.falsified, one.unknown) == (two.verified, two.falsified, two.unknown)
    assert abs(one.margin_min - two.margin_min) <= 1e-5


def test_largest_coefficient_tensor_within_max_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    model = resnet()
    _, lo, hi = boxes(3)
    seen: list[int] = []
    sweep = bounds_crown.BoundState._sweep

    def watched(self, target, pending, *args):  # type: ignore[no-untyped-def]
        seen.extend(a.numel() for a in pending.values())
        return sweep(self, target, pending, *args)

    monkeypatch.setattr(bounds_crown.BoundState, "_sweep", watched)
    for memory in (MIN_MEMORY, 64 << 20):
        bm = BoundedModel(model, max_memory=memory)
        limit = bounds_crown.memory_plan(memory, 8)[0]
        assert bm.max_elements == limit == memory // 2 // (8 * bounds_crown.WORK_COPIES)
        seen.clear()
        bm.crown(lo, hi)
        assert seen and max(seen) <= limit
    # the per-input state of a part fits half the budget
    ops, _ = BoundedModel(model)._build_ops(lo)
    per_input = sum(op.numel for op in ops) * 8 * bounds_crown.STATE_COPIES
    size = bounds_crown.memory_plan(MIN_MEMORY, 8, ops)[1]
    assert size * per_input <= MIN_MEMORY // 2 < (size + 1) * per_input


# ----------------------------------------------------------------------------- soundness of the refined intervals


def test_refined_intervals_sound_and_tighter() -> None:
    model = resnet(1)
    _, lo, hi = boxes(3, 0.05)
    state = BoundedModel(model)._prepare(lo, hi)
    state.lower(state.out, state.spec(None)[0], True)  # every intermediate bound, refined intervals with them
    gen = torch.Generator().manual_seed(4)
    points = lo + (hi - lo) * torch.rand((16, *lo.shape), generator=gen, dtype=lo.dtype)
    corners = torch.where(torch.rand((16, *lo.shape), generator=gen) < 0.5, lo, hi)
    values: dict[int, list[torch.Tensor]] = {}
    for x in torch.cat([points, corners]):
        acts = [x]
        for op in state.ops[1:]:
            acts.append(op.forward([acts[j] for j in op.inputs]) if op.linear else torch.relu(acts[op.inputs[0]]))
        for i in state.refined:
            values.setdefault(i, []).append(acts[i])
    assert len(state.refined) > 5
    for i, (r_lo, r_hi) in state.refined.items():
        v = torch.stack(values[i])
        assert bool((v >= r_lo - 1e-9).all() & (v <= r_hi + 1e-9).all()), state.ops[i].label
        i_lo, i_hi = state.ivs[i]
        assert bool((r_lo >= i_lo).all() & (r_hi <= i_hi).all())


# ----------------------------------------------------------------------------- peak memory (fresh process)

_RSS_SCRIPT = """
    from pytest_dnnsafety.engines.bounds.model import BoundedModel
    from pytest_dnnsafety.engines.bounds.box import input_box

    torch.set_num_threads(1)
    model = resnet18(width=4, stem="cifar")
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))  # 16x16: seconds, not minutes
    y = model(x).argmax(1)
    lo, hi = input_box(x, 0.5 / 255, (0, 1))
    bm = BoundedModel(model, max_memory={memory!r})
    bm.margin_lower_bounds(lo, hi, y, "ibp")
    open("/proc/self/clear_refs", "w").write("5")
    base = hwm()
    bm.margin_lower_bounds(lo, hi, y, "crown")
    print(hwm() - base)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_peak_rss_growth_within_max_memory() -> None:
    # The budget covers CROWN's coefficient and per-part state tensors; the per-layer intervals of the batch and the
    # allocator's slack come on top (about 40 MiB here: a 32 MiB budget grew 43 MiB, 64 MiB grew 52 MiB, no
    # budget 126 MiB), so the budget is set where those fixed costs fit inside it.
    memory = 64 << 20
    growth = int(run_script(_RSS_SCRIPT.format(memory=memory), 600).strip().splitlines()[-1])
    assert growth <= memory, f"peak RSS grew by {growth / 2**20:.0f} MiB under max_memory=64MiB"
