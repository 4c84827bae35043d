"""Benchmark: COCO mAP of 2,000 images by the plugin's engine vs pycocotools' COCOeval (no timing asserts).

``min_detection_map`` matches each batch as it streams (``BoxMatchEngine.update``: every (image, class)
cell and IoU threshold at once) and computes AP per class from the kept records; pycocotools loops over
images, classes and detections in Python. Both give the same mAP (checked here to 1e-6). The engine's
time (matching 2,000 images in batches of 256, then mAP) and pycocotools' (``evaluate`` + ``accumulate``)
and their ratio go to ``benchmark.extra_info`` and are printed. The engine's 1,000-replicate bootstrap
is timed too (pycocotools has none: it would repeat ``accumulate`` per replicate).
"""

from __future__ import annotations

import time

import pytest
import torch
from _timing import engine_seconds

from _coco_reference import coco_eval, random_case
from pytest_dnnsafety.engines.detection.matching import BoxMatchEngine

pytest.importorskip("pycocotools")

N_IMAGES = 2_000
BATCH = 256
CLASSES = 4


def engine_map(dets, gts) -> float:
    engine = BoxMatchEngine()
    for start in range(0, N_IMAGES, BATCH):
        stop = min(start + BATCH, N_IMAGES)
        engine.update(dets.images(start, stop), gts.images(start, stop), start=start)
    return engine.evaluate().map


def test_bench_map_engine_vs_pycocotools(benchmark) -> None:
    dets, gts = random_case(7, n_images=N_IMAGES, n_classes=CLASSES, crowded=True)
    ours = benchmark.pedantic(engine_map, args=(dets, gts), rounds=3, iterations=1, warmup_rounds=1)
    engine_s = engine_seconds(benchmark, lambda: engine_map(dets, gts))
    start = time.perf_counter()
    reference, _, _ = coco_eval(dets, gts, CLASSES)
    coco_s = time.perf_counter() - start
    assert ours == pytest.approx(reference, abs=1e-6)
    engine = BoxMatchEngine()
    engine.update(dets, gts)
    start = time.perf_counter()
    boot = engine.evaluate(bootstrap=1000, generator=torch.Generator().manual_seed(0))
    bootstrap_s = time.perf_counter() - start
    benchmark.extra_info.update({
        "images": N_IMAGES, "detections": len(dets), "objects": len(gts), "map": ours,
        "engine_seconds": engine_s, "pycocotools_seconds": coco_s, "ratio_pycocotools_over_engine": coco_s / engine_s,
        "bootstrap_1000_seconds": bootstrap_s, "bootstrap_lower": boot.lower, "torch_threads": torch.get_num_threads(),
    })
    print(f"\nmAP of {N_IMAGES} images ({len(dets)} detections, {len(gts)} objects): engine {engine_s:.3f} s, "
          f"pycocotools {coco_s:.3f} s (x{coco_s / engine_s:.1f}); bootstrap of 1,000 replicates {bootstrap_s:.2f} s")
