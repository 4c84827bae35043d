"""Activation capture: hooks leave no trace, reductions are right, the cache shares passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pytest_dnnsafety.engines.core.capture import ActivationCache, capture, layer_names
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.engines.core.guard import probing


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3), nn.ReLU())
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(6 * 4 * 4, 5), nn.ReLU(), nn.Linear(5, 3))
        self.calls = 0
        self.fail_at: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not probing():  # the guard's determinism probe (once per model) is not a batch of the pass
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
    with pytest.raises(MetricError, match="the model raised RuntimeError on batch 2 .*: boom mid-pass"):
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


# ---------------------------------------------------------------------- the model is checked too (issue #7)
class Conv8(nn.Module):
    """The common case: a small conv net on (N, 1, 8, 8) images."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.ReLU(), nn.Linear(6, 3))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.classifier(self.features(x))


class NanLogits(Conv8):
    """Finite activations everywhere, NaN logits for inputs whose first pixel is above 5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return torch.where(x[:, :1, 0, 0] > 5, torch.full_like(out, float("nan")), out)


@pytest.fixture
def conv() -> Conv8:
    torch.manual_seed(0)
    return Conv8()


@pytest.fixture
def images() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return torch.rand(40, 1, 8, 8, generator=gen), torch.randint(0, 3, (40,), generator=gen)


def test_conv_model_on_8x8_images_is_captured(conv: Conv8, images: tuple) -> None:
    acts = capture(conv, images, ["features.1", "classifier.2"], batch_size=16)
    assert acts["features.1"].unit_shape == (4, 8, 8) and acts["features.1"].n_inputs == 40
    # the determinism probe, the memory probe (1 and 2 inputs), 3 batches
    assert acts["classifier.2"].n_neurons == 6 and conv.calls == 2 + 2 + 3


def test_wrong_input_shape_names_the_batch_the_shape_and_the_fix(conv: Conv8, images: tuple) -> None:
    flat = (images[0].flatten(1), images[1])  # (N, 64) into a conv net
    with pytest.raises(MetricError) as info:
        capture(conv, flat, ["features.1"], batch_size=16)
    first = str(info.value).splitlines()[0]
    assert first.startswith("the shared forward pass (model outputs and layer activations): the model raised "
                            "RuntimeError on batch 0 (inputs of shape (16, 64), float32, on cpu; model: Conv8 with float32 weights")
    assert "Fix: give inputs in the shape the model expects" in first
    assert _hook_count(conv) == 0


def test_float64_weights_with_float32_images_names_both_dtypes(conv: Conv8, images: tuple) -> None:
    conv.double()
    with pytest.raises(MetricError) as info:
        capture(conv, images, ["features.1"], batch_size=16)
    first = str(info.value).splitlines()[0]
    assert "the model raised RuntimeError on batch 0 (inputs of shape (16, 1, 8, 8), float32" in first
    assert "Conv8 with float64 weights" in first
    assert "Fix: the inputs are float32 but the model's weights are float64" in first


def test_nan_logits_fail_the_capture_naming_the_first_bad_batch(images: tuple) -> None:
    torch.manual_seed(0)
    model = NanLogits()
    x = images[0].clone()
    x[35, 0, 0, 0] = 9.0  # batch 2 of 16 (rows 32..39)
    x[38, 0, 0, 0] = 9.0
    with pytest.raises(MetricError) as info:
        capture(model, (x, images[1]), ["features.1", "classifier.2"], batch_size=16)
    assert str(info.value).splitlines()[0].startswith(
        "the shared forward pass (model outputs and layer activations): the model's outputs hold NaN/inf in 2 of 40 "
        "inputs; the first bad batch is batch 2.")


def test_nan_activations_name_the_first_bad_input_and_batch(images: tuple) -> None:
    class Blowup(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.where(x > 5, torch.full_like(x, float("inf")), x)

    class NanInside(Conv8):  # inf inside, finite logits: only the activation check can see it
        def __init__(self) -> None:
            super().__init__()
            self.features.insert(0, Blowup())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = torch.nan_to_num(self.features(x), nan=0.0, posinf=0.0, neginf=0.0)
            return self.classifier(hidden)

    torch.manual_seed(0)
    x = images[0].clone()
    x[21, 0, 0, 0] = 9.0
    with pytest.raises(MetricError, match=r"^layer 'features\.2' produced NaN/inf activations for 1 of 40 inputs; "
                                          r"the first is input 21 \(batch 1\)"):
        capture(NanInside(), (x, images[1]), ["features.2"], batch_size=16)


def test_model_output_that_is_not_one_row_per_input_fails_the_capture(images: tuple) -> None:
    class FeatureMap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x)

    with pytest.raises(MetricError, match=r"on batch 0 the model returned shape \(16, 2, 6, 6\) for 16 inputs of "
                                          r"shape \(1, 8, 8\); expected \(16, classes\)"):
        capture(FeatureMap(), images, ["conv"], batch_size=16)


def test_a_layer_called_twice_per_pass_is_refused(images: tuple) -> None:
    class Shared(Conv8):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            relu = self.features[1]
            return self.classifier[3](relu(self.classifier[1](relu(self.features[0](x)).amax(1).flatten(1))))

    torch.manual_seed(0)
    with pytest.raises(MetricError, match=r"^layer 'features\.1' was called 6 time\(s\) in 3 batch\(es\)"):
        capture(Shared(), images, ["features.1"], batch_size=16)


def test_a_failed_pass_fails_every_gate_that_shares_it_without_a_rerun(images: tuple) -> None:
    torch.manual_seed(0)
    model = NanLogits()
    x = images[0].clone()
    x[3, 0, 0, 0] = 9.0
    data = (x, images[1])
    cache = ActivationCache()
    plan = ("classifier.2", "features.1")
    with pytest.raises(MetricError, match="the first bad batch is batch 0") as first:
        cache.get(model, data, ["features.1"], batch_size=16, device="cpu", plan=plan)
    calls = model.calls
    for layer in plan:  # the other gate on the same pass, and the same gate again
        with pytest.raises(MetricError) as again:
            cache.get(model, data, [layer], batch_size=16, device="cpu", plan=plan)
        assert str(again.value) == str(first.value)
    # the determinism probe, the memory probe (1 and 2 inputs), 3 batches
    assert cache.forward_passes == 1 and model.calls == calls == 2 + 2 + 3


def test_an_unknown_layer_of_one_gate_is_not_cached_for_the_others(conv: Conv8, images: tuple) -> None:
    cache = ActivationCache()
    with pytest.raises(ConfigError, match="unknown layer 'nope'"):
        cache.get(conv, images, ["nope"], batch_size=16, device="cpu", plan=("features.1", "nope"))
    assert cache.get(conv, images, ["features.1"], batch_size=16, device="cpu",
                     plan=("features.1", "nope"))["features.1"].n_inputs == 40


# ---------------------------------------------------------------------- models that cannot be hooked
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # TorchScript is deprecated upstream
@pytest.mark.parametrize("make", [
    lambda m, x: torch.jit.script(m),
    lambda m, x: torch.jit.trace(m, x[:2]),
], ids=["scripted", "traced"])
def test_torchscript_model_is_refused_with_the_eager_fix(conv: Conv8, images: tuple, make) -> None:
    scripted = make(conv.eval(), images[0])
    for layer in ("features.1", "classifier"):
        with pytest.raises(ConfigError) as info:
            capture(scripted, images, [layer])
        assert str(info.value).splitlines()[0].startswith(
            f"layer {layer!r}: layer activations need forward hooks, which TorchScript modules do not support")
        assert "Fix: give the eager torch.nn.Module (dnnsafety_model_factory + a state dict, or a `model` fixture" \
            in str(info.value)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_model_loaded_from_a_file_is_refused(conv: Conv8, images: tuple, tmp_path) -> None:
    path = tmp_path / "m.pt"
    torch.jit.save(torch.jit.script(conv.eval()), str(path))
    loaded = torch.jit.load(str(path))
    with pytest.raises(ConfigError, match="^layer 'features.1': layer activations need forward hooks, which "
                                          "TorchScript modules do not support"):
        ActivationCache().get(loaded, images, ["features.1"], batch_size=16, device="cpu")


def test_exported_program_module_is_read_from_its_graph_nodes(conv: Conv8, images: tuple, tmp_path) -> None:
    """torch 2.13: export(...).module() keeps submodules only as weight holders (a hook on them never fires); the
    layers are read from the graph's nodes instead, equal to the eager model's hooks (tests/files/test_export_activations.py)."""
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(conv.eval(), (images[0][:2],), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(tmp_path / "m.pt2"))
    module = torch.export.load(str(tmp_path / "m.pt2")).module()
    layers = ["features.0", "classifier.1", "features.1"]  # a conv, a linear, a ReLU (gone from the module)
    assert set(layers) <= set(layer_names(module))
    eager, exported = capture(conv, images, layers), capture(module, images, layers)
    for layer in layers:
        assert torch.equal(eager[layer].max, exported[layer].max) and torch.equal(eager[layer].min, exported[layer].min)


def test_fx_traced_module_keeps_working(conv: Conv8, images: tuple) -> None:
    traced = torch.fx.symbolic_trace(conv.eval())
    eager = capture(conv, images, ["features.1"])["features.1"]
    fx = capture(traced, images, ["features.1"])["features.1"]
    torch.testing.assert_close(eager.max, fx.max)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_in_the_batch_loop_on_cuda(images: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sync debug mode is on exactly while capture works on a batch (moving it, the runner's deferred checks, the
    guarded forward, the hooks)."""
    from pytest_dnnsafety.engines.core import runner

    torch.manual_seed(0)
    model = NanLogits().cuda()
    original = runner.iter_batches
    seen = []

    def strict(data, batch_size):
        for batch in original(data, batch_size):  # slicing (and loading's own checks) may sync: not the loop
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield batch
            finally:
                torch.cuda.set_sync_debug_mode("default")
            seen.append(batch[0].shape[0])

    monkeypatch.setattr(runner, "iter_batches", strict)  # the runner's batch loop is capture's
    try:
        acts = capture(model, images, ["features.1", "classifier.2"], batch_size=8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert seen == [8] * 5 and acts["features.1"].max.is_cuda and acts["classifier.2"].n_inputs == 40
