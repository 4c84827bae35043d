"""Activation capture: hooks leave no trace, reductions are right, the cache shares passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pytest_dnnsafety.activations import ActivationCache, capture, layer_names
from pytest_dnnsafety.errors import ConfigError, DataError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3), nn.ReLU())
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(6 * 4 * 4, 5), nn.ReLU(), nn.Linear(5, 3))
        self.calls = 0
        self.fail_at: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError("boom mid-pass")
        return self.classifier(self.features(x))


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.rand(37, 1, 6, 6, generator=gen), torch.randint(0, 3, (37,), generator=gen)


def test_reductions_match_a_direct_computation(net: Net, data: tuple) -> None:
    acts = capture(net, data, ["features.1", "classifier.2"], batch_size=8)
    with torch.no_grad():
        fmap = net.features[1](net.features[0](data[0]))
        hidden = net.classifier[2](net.classifier[1](net.classifier[0](net.features(data[0]))))
    torch.testing.assert_close(acts["features.1"].max, fmap.amax(dim=(2, 3)))
    torch.testing.assert_close(acts["features.1"].mean, fmap.mean(dim=(2, 3)))
    torch.testing.assert_close(acts["classifier.2"].max, hidden)
    torch.testing.assert_close(acts["classifier.2"].mean, hidden)
    assert acts["features.1"].unit_shape == (4, 6, 6) and acts["features.1"].n_inputs == 37


@pytest.mark.parametrize("batch_size", [1, 5, 37, 100])
def test_batch_size_does_not_change_the_activations(net: Net, data: tuple, batch_size: int) -> None:
    whole = capture(net, data, ["features.3"], batch_size=37)["features.3"]
    split = capture(net, data, ["features.3"], batch_size=batch_size)["features.3"]
    torch.testing.assert_close(whole.max, split.max)
    torch.testing.assert_close(whole.mean, split.mean)


def test_hooks_removed_and_mode_restored(net: Net, data: tuple) -> None:
    net.train()
    capture(net, data, ["features.1", "classifier.2"])
    assert net.training and all(m.training for m in net.modules())
    assert _hook_count(net) == 0


def test_hooks_removed_and_mode_restored_when_the_model_fails_mid_pass(net: Net, data: tuple) -> None:
    net.train()
    net.fail_at = 3
    with pytest.raises(RuntimeError, match="boom mid-pass"):
        capture(net, data, ["features.1"], batch_size=4)
    assert _hook_count(net) == 0 and net.training


def test_eval_mode_and_no_grad_during_the_pass(data: tuple) -> None:
    seen = {}

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(36, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["training"], seen["grad"] = self.training, torch.is_grad_enabled()
            return self.lin(x.flatten(1))

    capture(Probe().train(), data, ["lin"])
    assert seen == {"training": False, "grad": False}


def test_unknown_layer_lists_the_available_names(net: Net, data: tuple) -> None:
    with pytest.raises(ConfigError, match=r"unknown layer 'features\.9'.*features\.0, features\.1, features\.2"):
        capture(net, data, ["features.9"])
    assert _hook_count(net) == 0


def test_a_callable_that_is_not_a_module_is_refused(data: tuple) -> None:
    with pytest.raises(ConfigError, match="need a torch.nn.Module"):
        capture(lambda x: x, data, ["anything"])


def test_empty_data_is_refused(net: Net) -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 1, 6, 6)), batch_size=4)
    with pytest.raises(DataError, match="no inputs"):
        capture(net, loader, ["features.1"])


def test_dataloader_and_tensordataset_give_the_same_activations(net: Net, data: tuple) -> None:
    ds = torch.utils.data.TensorDataset(*data)
    a = capture(net, ds, ["features.3"])["features.3"]
    b = capture(net, torch.utils.data.DataLoader(ds, batch_size=6), ["features.3"])["features.3"]
    torch.testing.assert_close(a.max, b.max)


def test_cache_shares_one_pass_between_gates_and_layers(net: Net, data: tuple) -> None:
    cache = ActivationCache()
    plan = ("classifier.2", "features.1")
    first = cache.get(net, data, ["features.1"], batch_size=16, device="cpu", plan=plan)
    calls = net.calls
    again = cache.get(net, data, ["features.1"], batch_size=16, device="cpu", plan=plan)
    other = cache.get(net, data, ["classifier.2"], batch_size=16, device="cpu", plan=plan)
    assert cache.forward_passes == 1 and net.calls == calls == 3  # 37 inputs in batches of 16
    assert again["features.1"] is first["features.1"] and other["classifier.2"].n_neurons == 5
    cache.get(net, (data[0][:5], data[1][:5]), ["features.1"], batch_size=16, device="cpu")
    assert cache.forward_passes == 2  # other data, another pass


def test_a_bad_planned_layer_does_not_break_another_gate(net: Net, data: tuple) -> None:
    cache = ActivationCache()
    got = cache.get(net, data, ["features.1"], batch_size=16, device="cpu", plan=("nope", "features.1"))
    assert got["features.1"].n_neurons == 4


def test_layer_names_are_the_named_modules(net: Net) -> None:
    assert layer_names(net)[:3] == ["features", "features.0", "features.1"]
