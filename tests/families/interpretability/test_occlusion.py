"""The occlusion engine (M_interpret, M_OccSen; Cheng et al. 2018, §II-F/G, eq. 5).

The paper's worked example through the engine's set computation; heat maps against a
per-position Python loop (bitwise on a float64 model with dyadic weights, where every sum is
exact; to float rounding on the trained digits CNN); the occluding sets against a per-position
loop over the mask; hypothesis properties; the empty cases; bad inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.interpretability.occlusion import (
    OcclusionEngine,
    assess_occlusion,
    check_masks,
    interpretation_counts,
    occluding_positions,
    occlusion_maps,
    occlusion_positions,
)
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError


def _dyadic_net(channels: int = 1, size: int = 8, seed: int = 0) -> torch.nn.Module:
    """A small float64 conv net whose weights are multiples of 1/8: on digits (k/16) every sum is exact."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(channels, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(4 * size * size, 10)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_((p * 8).round() / 8)
    return net.eval()


def loop_maps(model, x, size, stride, fill, target=None) -> torch.Tensor:
    """The reference: one occluded image per forward pass, position by position."""
    h, w = (size, size) if isinstance(size, int) else size
    rows, cols = occlusion_positions(x.shape[-2], x.shape[-1], size, stride)
    out = torch.empty(x.shape[0], len(rows) * len(cols), dtype=torch.float64)
    with torch.no_grad():
        for i in range(x.shape[0]):
            c = int(model(x[i:i + 1]).argmax()) if target is None else int(target[i])
            for a, r in enumerate(rows.tolist()):
                for b, cc in enumerate(cols.tolist()):
                    xo = x[i:i + 1].clone()
                    value = x[i].mean(dim=(-2, -1), keepdim=True) if fill == "mean" else fill
                    xo[..., r:r + h, cc:cc + w] = value if fill != "mean" else value.expand_as(xo[..., r:r + h, cc:cc + w])
                    out[i, a * len(cols) + b] = torch.log_softmax(model(xo).double(), 1)[0, c].exp()
    return out


# ----------------------------------------------------------------------------- the paper's example


def test_paper_example_nine_hot_thirty_occluding_five_in_both() -> None:
    """Fig. 3b: 9 hot positions, 30 on the person, 5 in both → M_interpret = 5/9, M_OccSen = 5/30."""
    hot = torch.zeros(1, 100, dtype=torch.bool)
    occluding = torch.zeros(1, 100, dtype=torch.bool)
    occluding[0, 10:40] = True  # the 30 positions on the person
    hot[0, 35:40] = True  # 5 hot on the person (the head)
    hot[0, 60:64] = True  # 4 hot elsewhere
    n_hot, n_occ, n_both = interpretation_counts(hot, occluding)
    assert (int(n_hot), int(n_occ), int(n_both)) == (9, 30, 5)
    engine = OcclusionEngine()
    interpret, occsen = engine.update(hot, occluding)
    assert float(interpret) == pytest.approx(5 / 9) and float(occsen) == pytest.approx(5 / 30)
    result = engine.compute()
    assert result.value("interpret") == pytest.approx(5 / 9)
    assert result.value("occsen", "min") == pytest.approx(5 / 30)
    assert (result.hot_total, result.occluding_total, result.both_total) == (9, 30, 5)


# ----------------------------------------------------------------------------- maps against a loop


@pytest.mark.parametrize(("size", "stride", "fill"), [(2, 1, 0.0), (3, 2, "mean"), ((2, 3), (1, 2), 0.5), (8, 1, 0.0)])
def test_maps_equal_a_per_position_loop_bitwise(size, stride, fill) -> None:
    net = _dyadic_net()
    x, _ = digits_images(6)
    x = x.double()
    maps, cls, _, outputs = occlusion_maps(net, x, size=size, stride=stride, fill=fill, max_batch=17)
    assert outputs == "logits"
    assert torch.equal(maps, loop_maps(net, x, size, stride, fill))
    with torch.no_grad():
        assert torch.equal(cls, net(x).argmax(1))


def test_maps_equal_the_loop_on_rgb_images_and_given_labels() -> None:
    net = _dyadic_net(channels=3, size=6, seed=1)
    x = (torch.randint(0, 17, (4, 3, 6, 6), generator=torch.Generator().manual_seed(3)) / 16).double()
    target = torch.tensor([0, 3, 7, 9])
    maps, cls, _, _ = occlusion_maps(net, x, size=2, stride=2, fill=0.25, target=target, max_batch=5)
    assert torch.equal(cls, target)
    assert torch.equal(maps, loop_maps(net, x, 2, 2, 0.25, target))
    # per-channel means of 36 pixels are not dyadic: equal to rounding
    maps, *_ = occlusion_maps(net, x, size=(3, 2), stride=(2, 1), fill="mean", target=target, max_batch=5)
    torch.testing.assert_close(maps, loop_maps(net, x, (3, 2), (2, 1), "mean", target), atol=1e-12, rtol=0)


def test_trained_cnn_maps_match_the_loop_to_float_rounding() -> None:
    model = digits_cnn()
    x, _ = digits_images(5)
    maps, *_ = occlusion_maps(model, x, size=2, stride=1)
    ref = loop_maps(model, x, 2, 1, 0.0)
    torch.testing.assert_close(maps, ref, atol=1e-5, rtol=0)
    clear = (ref - 0.5).abs() > 1e-5
    assert torch.equal((maps < 0.5)[clear], (ref < 0.5)[clear])


def test_chunking_does_not_change_the_maps() -> None:
    net = _dyadic_net()
    x, _ = digits_images(7)
    x = x.double()
    maps = [occlusion_maps(net, x, size=3, stride=1, max_batch=mb)[0] for mb in (1, 13, 49, 10_000)]
    assert all(torch.equal(maps[0], m) for m in maps[1:])


# ----------------------------------------------------------------------------- geometry


@settings(max_examples=60, deadline=None)
@given(height=st.integers(1, 12), width=st.integers(1, 12), h=st.integers(1, 12), w=st.integers(1, 12),
       sh=st.integers(1, 5), sw=st.integers(1, 5))
def test_positions_cover_every_pixel(height, width, h, w, sh, sw) -> None:
    if h > height or w > width:
        with pytest.raises(ConfigError, match="larger than the images"):
            occlusion_positions(height, width, (h, w), (sh, sw))
        return
    if sh > h or sw > w:
        with pytest.raises(ConfigError, match="never be occluded"):
            occlusion_positions(height, width, (h, w), (sh, sw))
        return
    rows, cols = occlusion_positions(height, width, (h, w), (sh, sw))
    covered = torch.zeros(height, width, dtype=torch.bool)
    for r in rows.tolist():
        for c in cols.tolist():
            covered[r:r + h, c:c + w] = True
    assert covered.all()
    assert int(rows[-1]) == height - h and int(cols[-1]) == width - w
    assert rows.unique().numel() == rows.numel() and cols.unique().numel() == cols.numel()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), height=st.integers(2, 10), width=st.integers(2, 10), size=st.integers(1, 4),
       stride=st.integers(1, 3), density=st.floats(0.0, 0.6))
def test_occluding_positions_equal_a_per_position_loop(seed, height, width, size, stride, density) -> None:
    size = min(size, height, width)
    stride = min(stride, size)
    masks = torch.rand(3, height, width, generator=torch.Generator().manual_seed(seed)) < density
    got = occluding_positions(masks, size, stride)
    rows, cols = occlusion_positions(height, width, size, stride)
    ref = torch.tensor([[bool(m[r:r + size, c:c + size].any()) for r in rows.tolist() for c in cols.tolist()]
                        for m in masks])
    assert torch.equal(got, ref)


# ----------------------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), rho=st.floats(0.01, 0.99), size=st.integers(1, 4))
def test_properties_on_the_trained_cnn(seed, rho, size) -> None:
    model = _cached_cnn()
    x, _ = _cached_digits()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(x.shape[0], generator=gen)[:6]
    xs = x[idx]
    full = torch.ones(6, 8, 8, dtype=torch.bool)
    everything = assess_occlusion(model, xs, full, size=size, rho=rho, no_hot="skip")
    maps, *_ = occlusion_maps(model, xs, size=size)
    assert bool(((maps >= 0) & (maps <= 1)).all())
    hot = maps < rho
    # a mask covering everything: every position occludes, M_OccSen = |hot| / |all|, M_interpret = 1
    share = hot.double().mean(1)
    assert everything.occsen_mean == pytest.approx(float(share.mean()))
    assert everything.occsen_max == pytest.approx(float(share.max()))
    assert everything.n_interpret == int((hot.sum(1) > 0).sum())
    if everything.n_interpret:
        assert everything.interpret_min == everything.interpret_max == 1.0
    # any mask: values in [0, 1], min <= mean <= max
    masks = torch.rand(6, 8, 8, generator=gen) < 0.3
    masks[:, 0, 0] = True
    some = assess_occlusion(model, xs, masks, size=size, rho=rho, no_hot="zero")
    for metric in ("interpret", "occsen"):
        lo, mean, hi = (getattr(some, f"{metric}_{a}") for a in ("min", "mean", "max"))
        assert 0 <= lo <= mean + 1e-12 and mean <= hi + 1e-12 and hi <= 1
    # a larger mask never lowers the occluding set, so M_interpret never drops
    bigger = assess_occlusion(model, xs, masks | (torch.rand(6, 8, 8, generator=gen) < 0.3), size=size, rho=rho,
                              no_hot="zero")
    assert bigger.interpret_mean >= some.interpret_mean - 1e-12


_CACHE: dict[str, object] = {}


def _cached_cnn():
    return _CACHE.setdefault("cnn", digits_cnn())


def _cached_digits():
    return _CACHE.setdefault("digits", digits_images(200))


def test_merge_and_payload_equal_one_engine() -> None:
    gen = torch.Generator().manual_seed(0)
    hot = torch.rand(40, 25, generator=gen) < 0.2
    occ = torch.rand(40, 25, generator=gen) < 0.4
    occ[:, 0] = True
    whole = OcclusionEngine()
    whole.update(hot, occ)
    a, b = OcclusionEngine(), OcclusionEngine()
    a.update(hot[:13], occ[:13])
    b.update(hot[13:], occ[13:], start=13)
    merged = Engine.from_payload(a.state_payload()).merge(Engine.from_payload(b.state_payload()))
    r1, r2 = whole.compute(), merged.compute()
    for key in ("n", "n_interpret", "interpret_min", "interpret_max", "occsen_min", "occsen_max", "both_total"):
        assert getattr(r1, key) == getattr(r2, key)
    assert r1.interpret_mean == pytest.approx(r2.interpret_mean) and r1.occsen_mean == pytest.approx(r2.occsen_mean)
    with pytest.raises(ValueError, match="no_hot"):
        OcclusionEngine(no_hot="one").merge(OcclusionEngine())


# ----------------------------------------------------------------------------- empty cases


def test_no_hot_position_rules() -> None:
    hot = torch.tensor([[True, False, False, False], [False, False, False, False]])
    occ = torch.tensor([[True, True, False, False], [True, False, False, False]])
    for rule, interpret in (("skip", 1.0), ("one", 1.0), ("zero", 0.5)):
        engine = OcclusionEngine(no_hot=rule)
        engine.update(hot, occ)
        result = engine.compute()
        assert result.no_hot == 1
        assert result.interpret_mean == pytest.approx(interpret)
        assert result.n_interpret == (1 if rule == "skip" else 2)
        assert result.occsen_mean == pytest.approx(0.25)  # 1/2 and 0/1: defined without hot positions
    engine = OcclusionEngine()
    engine.update(hot[1:], occ[1:])
    with pytest.raises(MetricError, match="M_interpret is undefined.*no_hot='one'"):
        engine.compute().value("interpret")


def test_an_empty_mask_is_an_error_naming_the_input_or_skipped() -> None:
    hot = torch.tensor([[True, False], [True, True], [False, True]])
    occ = torch.tensor([[True, False], [False, False], [True, True]])
    engine = OcclusionEngine()
    engine.update(hot[:1], occ[:1])
    engine.update(hot[1:], occ[1:], start=1)
    with pytest.raises(DataError, match=r"1 of 3 masks are empty \(the first is input 1\).*empty_mask='skip'"):
        engine.compute()
    skip = OcclusionEngine(empty_mask="skip")
    skip.update(hot, occ)
    result = skip.compute()
    assert (result.empty_masks, result.n_interpret, result.n_occsen) == (1, 2, 2)
    assert result.interpret_mean == pytest.approx(1.0) and result.occsen_mean == pytest.approx(0.75)


def test_runner_reports_worst_inputs_and_maps() -> None:
    model = digits_cnn()
    x, y = digits_images(60)
    result = assess_occlusion(model, (x, y), x[:, 0] > 0.3, size=2, batch_size=16)
    details = result.to_details()
    assert details["n"] == 60 and details["positions"] == [7, 7] and details["size"] == [2, 2]
    worst = details["worst_inputs"]
    assert worst and worst[0]["m_interpret"] == pytest.approx(result.interpret_min)
    assert [w["m_interpret"] for w in worst] == sorted(w["m_interpret"] for w in worst)
    (low, fragile) = details["maps"]
    assert low["index"] == worst[0]["index"] and fragile["why"] == "highest M_OccSen"
    assert len(low["heatmap"]) == 7 and all(len(row) == 7 for row in low["heatmap"])
    assert sum(map(sum, low["hot"])) == worst[0]["hot"]
    assert "M_interpret mean" in result.detail()


def test_the_model_mode_is_restored_and_label_targets_work() -> None:
    model = digits_cnn().train()
    x, y = digits_images(20)
    masks = x[:, 0] > 0.3
    by_label = assess_occlusion(model, (x, y), masks, size=2, target="label")
    assert model.training
    predicted = assess_occlusion(model, (x, y), masks, size=2)
    with torch.no_grad():
        if bool((model.eval()(x).argmax(1) == y).all()):
            assert by_label.interpret_mean == pytest.approx(predicted.interpret_mean)
    with pytest.raises(DataError, match="target='label' needs labelled data"):
        assess_occlusion(model, x, masks, size=2, target="label")


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("masks, pattern", [
    (torch.ones(19, 8, 8, dtype=torch.bool), r"20 inputs but 19 masks"),
    (torch.ones(21, 8, 8, dtype=torch.bool), r"20 inputs but 21 masks"),
    (torch.ones(20, 7, 8, dtype=torch.bool), r"spatial sizes differ \(images \(20, 1, 8, 8\), masks \(20, 7, 8\)\)"),
    (torch.ones(20, 8, 8, 2, dtype=torch.bool), r"shape \(N, H, W\) or \(N, 1, H, W\); got shape \(20, 8, 8, 2\)"),
    (torch.full((20, 8, 8), 0.4), "booleans or 0/1.*masks > 0.5"),
    ({"mask": torch.ones(20, 8, 8)}, "needs key 'masks'"),
])
def test_bad_masks_are_data_errors_naming_both_shapes(masks, pattern) -> None:
    x, y = digits_images(20)
    with pytest.raises(DataError, match=pattern):
        assess_occlusion(_dyadic_net().float(), (x, y), masks, size=2)


def test_masks_of_a_wrong_count_from_a_loader_of_unknown_length() -> None:
    x, y = digits_images(20)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(x, y))

    loader = torch.utils.data.DataLoader(Stream(), batch_size=8)
    assert assess_occlusion(_dyadic_net().float(), loader, x[:, 0] > 0.3, size=2).n == 20
    with pytest.raises(DataError, match=r"more inputs than the 12 masks \(images \(16\+, 1, 8, 8\), masks \(12, 8, 8\)"):
        assess_occlusion(_dyadic_net().float(), loader, (x[:12, 0] > 0.3).numpy(), size=2)
    with pytest.raises(DataError, match=r"20 inputs but 24 masks \(20 images, masks \(24, 8, 8\)"):
        assess_occlusion(_dyadic_net().float(), loader, torch.ones(24, 8, 8), size=2)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"size": 9}, r"occluder 9x9 is larger than the images \(8x8\)"),
    ({"size": (2, 9)}, r"occluder 2x9 is larger"),
    ({"size": 0}, "size=0 is not a positive integer"),
    ({"size": 2, "stride": 0}, "stride=0"),
    ({"size": 2, "stride": 3}, "stride 3x3 is larger than the occluder 2x2"),
    ({"size": 2, "rho": 0.0}, r"rho=0.0 is outside \(0, 1\)"),
    ({"size": 2, "rho": 1.0}, r"rho=1.0 is outside \(0, 1\)"),
    ({"size": 2, "rho": -0.2}, r"outside \(0, 1\)"),
    ({"size": 2, "rho": math.nan}, r"outside \(0, 1\)"),
    ({"size": 2, "fill": "median"}, "fill='median' is neither"),
    ({"size": 2, "fill": math.inf}, "fill=inf is neither"),
    ({"size": 2, "no_hot": "drop"}, "no_hot='drop'"),
    ({"size": 2, "target": "true"}, "target='true'"),
])
def test_bad_options_are_config_errors(kwargs, pattern) -> None:
    x, y = digits_images(4)
    with pytest.raises(ConfigError, match=pattern):
        assess_occlusion(_dyadic_net().float(), (x, y), x[:, 0] > 0.3, **kwargs)


def test_a_model_returning_nan_fails_after_the_loop() -> None:
    class Broken(torch.nn.Module):
        def forward(self, x):
            out = torch.zeros(x.shape[0], 10)
            return torch.where(x.reshape(x.shape[0], -1)[:, :1] < 0.5, out, out + math.nan)

    x, y = digits_images(8)
    x[:, :, 0, 0] = 1.0
    with pytest.raises(MetricError, match="NaN/inf"):
        assess_occlusion(Broken(), (x, y), x[:, 0] > 0.3, size=2)


def test_check_masks_accepts_the_usual_forms() -> None:
    m = torch.rand(5, 6, 6) > 0.5
    assert torch.equal(check_masks(m[:, None].to(torch.uint8)), m)
    assert torch.equal(check_masks({"masks": m.numpy()}), m)
    assert torch.equal(check_masks(m.double()), m)
