"""Benchmark: batched occlusion heat maps (2x2 occluder, stride 1) on 1,000 digits images vs a per-position loop.

M_interpret and M_OccSen (Cheng et al. 2018, §II-F/G, eq. 5) need one forward pass per occluder
position per image: 49 positions on an 8x8 digit, 49,000 occluded images for 1,000 digits. The
engine (:func:`~pytest_dnnsafety.engines.interpretability.occlusion.occlusion_maps`) builds the occluded copies
of a batch of 256 images on the device and sends them to the model 4,096 at a time; the
reference occludes one position of one image per forward pass, as a straightforward Python
loop would. The loop runs on a subsample of 20 images and its time is extrapolated to the
1,000; on that subsample both give the same maps (to float32 rounding of batched vs single-image
convolutions, < 1e-5) and the same hot sets. Times and the ratio go to ``benchmark.extra_info``
and are printed. Under ``--benchmark-disable`` (the suite's default) it runs on 64 images and a
loop over 4, as a quick check.
"""

from __future__ import annotations

import time

import torch
from _timing import engine_seconds

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.interpretability.occlusion import occlusion_maps, occlusion_positions

N_IMAGES = 1_000
N_LOOP = 20
BATCH = 256
MAX_BATCH = 4096
SIZE = 2
STRIDE = 1
RHO = 0.5


def batched_maps(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([occlusion_maps(model, x[i:i + BATCH], size=SIZE, stride=STRIDE, max_batch=MAX_BATCH)[0]
                      for i in range(0, x.shape[0], BATCH)])


def loop_maps(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    rows, cols = occlusion_positions(x.shape[-2], x.shape[-1], SIZE, STRIDE)
    out = torch.empty(x.shape[0], len(rows) * len(cols), dtype=torch.float64)
    with torch.no_grad():
        for i in range(x.shape[0]):
            c = int(model(x[i:i + 1]).argmax())
            for a, r in enumerate(rows.tolist()):
                for b, cc in enumerate(cols.tolist()):
                    xo = x[i:i + 1].clone()
                    xo[..., r:r + SIZE, cc:cc + SIZE] = 0.0
                    out[i, a * len(cols) + b] = torch.log_softmax(model(xo).double(), 1)[0, c].exp()
    return out


def test_bench_occlusion_maps_batched_vs_per_position_loop(benchmark) -> None:
    full = not getattr(benchmark, "disabled", False)
    n_images, n_loop = (N_IMAGES, N_LOOP) if full else (64, 4)
    model = digits_cnn()
    x, _ = digits_images(n_images)
    maps = benchmark.pedantic(batched_maps, args=(model, x), rounds=3, iterations=1, warmup_rounds=1)
    positions = maps.shape[1]
    assert maps.shape == (n_images, 49)
    batched_seconds = engine_seconds(benchmark, lambda: batched_maps(model, x))

    start = time.perf_counter()
    looped = loop_maps(model, x[:n_loop])
    loop_seconds = time.perf_counter() - start
    max_diff = float((looped - maps[:n_loop]).abs().max())
    assert max_diff < 1e-5
    clear = (looped - RHO).abs() > 1e-5
    assert torch.equal((looped < RHO)[clear], (maps[:n_loop] < RHO)[clear])

    loop_full = loop_seconds * n_images / n_loop
    benchmark.extra_info.update(
        {
            "images": n_images,
            "positions_per_image": positions,
            "occluded_images": n_images * positions,
            "size": SIZE,
            "stride": STRIDE,
            "batch_size": BATCH,
            "max_batch": MAX_BATCH,
            "batched_seconds": batched_seconds,
            "batched_occluded_images_per_s": n_images * positions / batched_seconds,
            "loop_images": n_loop,
            "loop_seconds": loop_seconds,
            "loop_full_seconds_estimated": loop_full,
            "ratio_estimated": loop_full / batched_seconds,
            "max_abs_difference": max_diff,
            "hot_share": float((maps < RHO).double().mean()),
            "torch_threads": torch.get_num_threads(),
        }
    )
    print(
        f"\nocclusion maps {SIZE}x{SIZE}/stride {STRIDE} on {n_images} digits ({positions} positions, "
        f"{n_images * positions:,} occluded images): batched ({BATCH} images, ≤{MAX_BATCH} copies/forward) "
        f"{batched_seconds:.3f} s ({n_images * positions / batched_seconds:,.0f} occluded images/s); per-position "
        f"loop {loop_seconds:.2f} s on {n_loop} images → est. {loop_full:.1f} s for {n_images}; ratio "
        f"×{loop_full / batched_seconds:,.1f}; max |difference| {max_diff:.1e}"
    )
