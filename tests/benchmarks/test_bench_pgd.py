"""Benchmark: batched PGD-10 (L∞, ε = 0.1) on 1,000 digits images vs a per-image loop (no timing asserts).

M_adv (Cheng et al. 2018, §II-D, eq. 4) runs every perturbation family on every input; PGD is
the costly one (10 forward and backward passes per input). The engine attacks a batch at a time
(256 inputs, the runner's default batch size) with one forward and one backward pass per step;
the reference attacks one image at a time, as a per-image tool would. The loop runs on a
subsample of 100 images and its time is extrapolated to the 1,000; both give the same
adversarial images on that subsample (random start off, so no random draws differ). Times and
the ratio go to ``benchmark.extra_info`` and are printed.
"""

from __future__ import annotations

import time

import torch
from _timing import engine_seconds

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.perturb.adversarial import pgd

N_IMAGES = 1_000
N_LOOP = 100
BATCH = 256
EPS = 0.1
STEPS = 10
CLIP = (0.0, 1.0)


def batched_pgd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.cat([
        pgd(model, x[i:i + BATCH], y[i:i + BATCH], EPS, steps=STEPS, random_start=False, clip=CLIP)
        for i in range(0, x.shape[0], BATCH)
    ])


def loop_pgd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.cat([pgd(model, x[i:i + 1], y[i:i + 1], EPS, steps=STEPS, random_start=False, clip=CLIP)
                      for i in range(x.shape[0])])



def test_bench_pgd_batched_vs_per_image_loop(benchmark) -> None:
    model = digits_cnn()
    x, y = digits_images(N_IMAGES)
    adv = benchmark.pedantic(batched_pgd, args=(model, x, y), rounds=3, iterations=1, warmup_rounds=1)
    assert adv.shape == x.shape
    assert float((adv - x).abs().max()) <= EPS + 1e-6
    batched_seconds = engine_seconds(benchmark, lambda: batched_pgd(model, x, y))

    start = time.perf_counter()
    looped = loop_pgd(model, x[:N_LOOP], y[:N_LOOP])
    loop_seconds = time.perf_counter() - start
    # Same attack, same start: the images agree, up to a rare sign flip of a float32 gradient
    # component that is ~0 (batched and single-image convolutions round differently).
    differ = ((looped - adv[:N_LOOP]).abs() > 1e-5).float().mean()
    assert float(differ) < 1e-3

    loop_full = loop_seconds * N_IMAGES / N_LOOP
    with torch.no_grad():
        clean_acc = float((model(x).argmax(1) == y).float().mean())
        adv_acc = float((model(adv).argmax(1) == y).float().mean())
    benchmark.extra_info.update(
        {
            "images": N_IMAGES,
            "eps": EPS,
            "steps": STEPS,
            "batch_size": BATCH,
            "batched_seconds": batched_seconds,
            "batched_images_per_s": N_IMAGES / batched_seconds,
            "loop_images": N_LOOP,
            "loop_seconds": loop_seconds,
            "loop_full_seconds_estimated": loop_full,
            "ratio_estimated": loop_full / batched_seconds,
            "differing_elements_share": float(differ),
            "clean_accuracy": clean_acc,
            "pgd_accuracy": adv_acc,
            "torch_threads": torch.get_num_threads(),
        }
    )
    print(
        f"\nPGD-{STEPS} L∞ ε={EPS} on {N_IMAGES} digits: batched ({BATCH}/batch) {batched_seconds:.3f} s "
        f"({N_IMAGES / batched_seconds:,.0f} images/s); per-image loop {loop_seconds:.2f} s on {N_LOOP} → est. "
        f"{loop_full:.1f} s for {N_IMAGES}; ratio ×{loop_full / batched_seconds:,.1f}; accuracy clean "
        f"{clean_acc:.3f} → PGD {adv_acc:.3f}"
    )
