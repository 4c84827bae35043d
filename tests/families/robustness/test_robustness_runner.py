"""The robustness families measure through the engine runner: any data form, any batch split, any shard.

``assess_adversarial_confidence`` (Cheng et al. 2018, eq. 4) and ``verify_robustness`` (IBP/CROWN
with a PGD search) run their per-batch step in :class:`~pytest_dnnsafety.engines.core.runner.Runner`:

* a DataLoader over a map-style dataset that refuses slices and lists (it must be read item by
  item, as a streaming dataset would) gives the same result as the tensors;
* the result does not depend on the batch size for deterministic families (FGSM, PGD without a
  random start, brightness; verification without the attack), the worst inputs and
  counterexamples included: they are ``topk`` engine states ordered by the global input index;
* on two gloo ranks, each measuring its :class:`~pytest_dnnsafety.runtime.torchrun.Shard` of the batches
  (seeds from the *global* batch index, so random families and the PGD start included), every
  rank gets the single-process result, bit for bit.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from _digits import DigitsCNN, digits_cnn, digits_images
from _gloo import GLOO_AVAILABLE, run_on_gloo_ranks
from pytest_dnnsafety.engines.robustness.confidence import assess_adversarial_confidence
from pytest_dnnsafety.engines.robustness.perturbations import make_family
from pytest_dnnsafety.engines.robustness.verification import verify_robustness

CLIP = (0.0, 1.0)
N = 70  # five batches of 16 (the last one short): two uneven shards on two ranks
BS = 16


class ItemOnly(torch.utils.data.Dataset):
    """A map-style dataset read item by item: indexing it with a slice or a list raises."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(index, int):
            raise TypeError(f"ItemOnly reads one item at a time, not {type(index).__name__}")
        return self.x[index], self.y[index]


def _loader(x: torch.Tensor, y: torch.Tensor, batch_size: int = BS) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ItemOnly(x, y), batch_size=batch_size)


def _families(random: bool) -> dict[str, Any]:
    """Deterministic families (no generator use), plus two random ones with ``random``."""
    families = {"fgsm": make_family("fgsm", clip=CLIP), "pgd": make_family("pgd", clip=CLIP, random_start=False),
                "brightness": make_family("brightness", clip=CLIP)}
    if random:
        families["pgd_random"] = make_family("pgd", clip=CLIP, steps=3)
        families["noise"] = make_family("gaussian_noise", clip=CLIP)
    return families


def _confidence(model: torch.nn.Module, data: Any, batch_size: int = BS, *, random: bool = False,
                shard: Any = None) -> Any:
    return assess_adversarial_confidence(model, data, _families(random), 0.08, batch_size=batch_size, seed=3,
                                         clip=CLIP, shard=shard)


def _verify(model: torch.nn.Module, data: Any, batch_size: int = BS, *, attack_steps: int = 0,
            shard: Any = None) -> Any:
    return verify_robustness(model, data, 0.03, clip=CLIP, batch_size=batch_size, seed=1,
                             attack_steps=attack_steps, shard=shard)


def _close(a: Any, b: Any, path: str, rel: float) -> None:
    """Equal, floats up to ``rel``."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for key in a:
            _close(a[key], b[key], f"{path}.{key}", rel)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            _close(u, v, f"{path}[{i}]", rel)
    elif isinstance(a, float) and not isinstance(b, str):
        assert b == pytest.approx(a, rel=rel, abs=rel * 1e-3) or (math.isnan(a) and math.isnan(b)), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.fixture(scope="module")
def digits() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    x, y = digits_images(1300)
    return digits_cnn(), x[1200:1200 + N], y[1200:1200 + N]  # held-out digits


def test_item_by_item_loader_equals_the_tensors(digits: tuple[torch.nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = digits
    tensors, loader = _confidence(model, (x, y), random=True), _confidence(model, _loader(x, y), random=True)
    assert tensors.n == N and len(tensors.worst_inputs) == 5
    assert loader == tensors  # the same batches: the same seeds, the same numbers
    tensors, loader = _verify(model, (x, y), attack_steps=3), _verify(model, _loader(x, y), attack_steps=3)
    assert tensors.n == N and tensors.counterexamples
    assert loader == tensors
    for a, b in zip(loader.counterexample_inputs, tensors.counterexample_inputs):
        assert torch.equal(a, b) and a.dtype == x.dtype and a.shape == x.shape[1:]


def test_batch_split_does_not_change_the_results(digits: tuple[torch.nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = digits
    small, large = _confidence(model, (x, y), 7), _confidence(model, (x, y), 64)
    assert small.n == large.n == N
    assert small.loss > 0 and len(small.worst_inputs) == 5
    # the worst inputs too (indices, families, drops); float32 kernels round differently by batch size, and the
    # attacks' gradients carry that on: rel 1e-4
    _close(small.to_details(), large.to_details(), "details", rel=1e-4)
    assert [w["index"] for w in small.worst_inputs] == [w["index"] for w in large.worst_inputs]
    assert small.chance_accuracy == large.chance_accuracy > 0
    small, large = _verify(model, (x, y), 7), _verify(model, (x, y), 64)
    assert (small.verified, small.falsified, small.unknown) == (large.verified, large.falsified, large.unknown)
    assert small.counterexamples and small.counterexamples == large.counterexamples
    assert small.margin_min == pytest.approx(large.margin_min, rel=1e-6)
    assert small.margin_median == pytest.approx(large.margin_median, rel=1e-6)


def test_worst_inputs_keep_the_first_index_among_equal_drops() -> None:
    """Ties (here: every drop is 0) are broken by the input's index, whatever the batches."""

    class Flat(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(x.shape[0], 3) + 0 * x.flatten(1).sum(1, keepdim=True)

    x, y = torch.rand(23, 4), torch.arange(23) % 3
    for batch_size in (1, 5, 64):
        result = assess_adversarial_confidence(Flat(), (x, y), {"brightness": make_family("brightness")}, 0.1,
                                               batch_size=batch_size)
        assert [w["index"] for w in result.worst_inputs] == [0, 1, 2, 3, 4]


def _rank(rank: int, world: int, weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
    """This rank's shard of the batches, measured from tensors and from an item-by-item loader."""
    from pytest_dnnsafety.runtime import torchrun as ranks

    model = DigitsCNN()
    model.load_state_dict(weights)
    model.eval()
    out: dict[str, Any] = {}
    for form, data in (("tensors", (x, y)), ("loader", _loader(x, y))):
        shard = ranks.batch_shard(data, BS)
        assert shard is not None and shard.rank == rank
        out[form] = {"rows": list(shard.rows),
                     "confidence": _confidence(model, data, random=True, shard=shard).to_details(),
                     "verification": _verify(model, data, attack_steps=3, shard=shard).to_details()}
    return out


@pytest.mark.skipif(not GLOO_AVAILABLE, reason="torch.distributed with gloo is not available")
def test_two_gloo_ranks_give_the_single_process_result(
        digits: tuple[torch.nn.Module, torch.Tensor, torch.Tensor]) -> None:
    model, x, y = digits
    single = {"confidence": json.loads(json.dumps(_confidence(model, (x, y), random=True).to_details())),
              "verification": json.loads(json.dumps(_verify(model, (x, y), attack_steps=3).to_details()))}
    results = run_on_gloo_ranks(_rank, 2, model.state_dict(), x, y)
    assert [r["tensors"]["rows"] for r in results] == [[0, 32], [32, N]]  # batches 0-1 and 2-4
    for result in results:
        for form in ("tensors", "loader"):
            got = result[form]
            assert got["confidence"] == single["confidence"], form  # bit for bit: per-input rows summed in order
            assert got["verification"] == single["verification"], form  # counts and margins: exact
    assert single["confidence"]["worst_inputs"] and single["verification"]["counterexamples"]
