"""Benchmark: COCO mAP@[.5:.95] by the plugin's engine vs faster-coco-eval's ``COCOeval_faster`` vs pycocotools'
``COCOeval``, on 5,000 and 50,000 images of 20 classes, about 9 detections and 5 objects per image (no timing
asserts).

What each side's time covers, from its users' own in-memory format:

* the plugin: ``BoxMatchEngine.update`` per batch of 256 images (the gates' default batch), from packed tensors
  already split into batches (as a DataLoader yields them; every COCO area range matched), then ``evaluate()``
  (mAP of every image) and ``area_maps()`` (small, medium, large: what the libraries' ``accumulate`` also
  computes);
* faster-coco-eval and pycocotools: building the ground-truth ``COCO`` object from the dataset dict, ``loadRes``
  of the results list, ``evaluate()`` and ``accumulate()`` (their ``summarize()`` only prints). Building the
  dicts from the tensors is left out (:func:`_coco_reference.coco_inputs`, fresh ones per call: ``loadRes``
  writes into them). Their ``evaluate`` + ``accumulate`` alone is timed too, and its ratio reported.

The contenders run interleaved (plugin, faster-coco-eval, pycocotools, plugin, …) with torch's default thread
count (nothing set here); medians and minima go to ``benchmark.extra_info`` (``ratio_faster_coco_eval_over_plugin``
and ``ratio_pycocotools_over_plugin``: reference time / plugin time, > 1 = plugin faster) and are printed. All
three mAPs are asserted equal (to 1e-9) first. Without faster-coco-eval installed, its part is skipped.
pycocotools (3–7 minutes a run at 50,000 images) runs at 50,000 only when faster-coco-eval is missing.

The bootstrap's cost: ``evaluate(bootstrap=B)`` minus ``evaluate()``, divided by the weighted evaluations it
runs (``B`` replicates + the jackknife's groups + the half-subsets: each is one weighted AP pass over every
detection), reported as ``bootstrap_seconds_per_replicate`` (at 5,000 images; it grows linearly with the detections).

Under the normal suite (benchmarks disabled) one small case (300 images) checks the three mAPs agree; no bootstrap.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time

import pytest
import torch
from _coco_reference import coco_inputs, random_case, timed_reference

from pytest_dnnsafety.engines.detection.bootstrap import HALF_SUBSETS, jackknife_groups
from pytest_dnnsafety.engines.detection.matching import BoxMatchEngine

pytest.importorskip("pycocotools")

BATCH = 256
CLASSES = 20


def split(dets, gts, n: int) -> list[tuple]:
    return [(dets.images(s, min(s + BATCH, n)), gts.images(s, min(s + BATCH, n)), s) for s in range(0, n, BATCH)]


def plugin_map(batches: list[tuple]) -> tuple[float, float]:
    start = time.perf_counter()
    engine = BoxMatchEngine()
    for d, g, first in batches:
        engine.update(d, g, start=first)
    result = engine.evaluate()
    engine.area_maps()  # small/medium/large too: the libraries' evaluate + accumulate compute every area range
    return result.map, time.perf_counter() - start


def _ratios(name: str, ours: list[float], theirs: list[float]) -> dict[str, float]:
    return {f"ratio_{name}_over_plugin": statistics.median(theirs) / statistics.median(ours),
            f"ratio_{name}_over_plugin_min": min(theirs) / min(ours)}


@pytest.mark.parametrize("n_images", [5_000, 50_000])
def test_bench_map_engine_vs_coco_libraries(benchmark, n_images: int) -> None:
    full = not getattr(benchmark, "disabled", False)
    if not full and n_images > 5_000:
        pytest.skip("the 50,000-image case runs only with --benchmark-enable")
    n = n_images if full else 300
    fast = importlib.util.find_spec("faster_coco_eval") is not None  # without it: the pycocotools part only
    dets, gts = random_case(7, n_images=n, n_classes=CLASSES, crowded=True)
    batches = split(dets, gts, n)
    rounds = (5 if n <= 5_000 else 3) if full else 1
    coco_rounds = (0 if fast else 1) if n > 5_000 else rounds  # pycocotools takes 3-7 minutes a run at 50,000
    times: dict[str, list[float]] = {"plugin": [], "faster_coco_eval": [], "faster_coco_eval_eval": [],
                                     "pycocotools": [], "pycocotools_eval": []}
    maps: dict[str, float] = {}
    for r in range(rounds):  # interleaved: plugin, faster-coco-eval, pycocotools, plugin, …
        maps["plugin"], seconds = plugin_map(batches)
        times["plugin"].append(seconds)
        for library in ("faster_coco_eval", "pycocotools") if fast else ("pycocotools",):
            if library == "pycocotools" and r >= coco_rounds:
                continue
            dataset, results = coco_inputs(dets, gts, CLASSES)
            maps[library], _, total, evaluate = timed_reference(library, dataset, results)
            times[library].append(total)
            times[library + "_eval"].append(evaluate)
        for library, value in maps.items():
            assert value == pytest.approx(maps["plugin"], abs=1e-9), library
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    per_replicate = boot_s = math.nan
    replicates = evaluations = 0
    if full and n <= 5_000:  # the bootstrap's cost: 5,000 images only (its 300 fixed jackknife and half-subset
        engine = BoxMatchEngine()  # evaluations take minutes at 50,000; the cost is linear in the detections)
        for d, g, first in batches:
            engine.update(d, g, start=first)
        replicates = 200
        start = time.perf_counter()
        engine.evaluate()
        point_s = time.perf_counter() - start
        start = time.perf_counter()
        engine.evaluate(bootstrap=replicates, generator=torch.Generator().manual_seed(0))
        boot_s = time.perf_counter() - start
        evaluations = replicates + jackknife_groups(n) + HALF_SUBSETS
        per_replicate = max(boot_s - point_s, 0.0) / evaluations
    info = {"images": n, "classes": CLASSES, "detections": len(dets), "objects": len(gts), "batch": BATCH,
            "map": maps["plugin"], "rounds": rounds, "pycocotools_rounds": coco_rounds,
            "torch_threads": torch.get_num_threads(), "bootstrap_replicates": replicates,
            "bootstrap_evaluations": evaluations, "bootstrap_seconds": boot_s,
            "bootstrap_seconds_per_replicate": per_replicate}
    for name, values in times.items():
        if values:
            info[f"{name}_seconds_median"] = statistics.median(values)
            info[f"{name}_seconds_min"] = min(values)
    for name in ("faster_coco_eval", "pycocotools"):
        if times[name]:
            info.update(_ratios(name, times["plugin"], times[name]))
            info[f"ratio_{name}_eval_only_over_plugin"] = (statistics.median(times[name + "_eval"])
                                                           / statistics.median(times["plugin"]))
    benchmark.extra_info.update(info)
    line = f"\nmAP of {n:,} images ({len(dets):,} detections, {len(gts):,} objects, {torch.get_num_threads()} " \
           f"threads): plugin {info['plugin_seconds_median']:.3f} s (min {info['plugin_seconds_min']:.3f})"
    for name in ("faster_coco_eval", "pycocotools"):
        if times[name]:
            line += (f", {name} {info[name + '_seconds_median']:.3f} s (min {info[name + '_seconds_min']:.3f}; "
                     f"x{info[f'ratio_{name}_over_plugin']:.1f}, evaluate+accumulate only "
                     f"x{info[f'ratio_{name}_eval_only_over_plugin']:.1f})")
    if evaluations:
        line += (f"; bootstrap {per_replicate * 1e3:.1f} ms per replicate ({evaluations} weighted evaluations in "
                 f"{boot_s:.2f} s)")
    print(line)
