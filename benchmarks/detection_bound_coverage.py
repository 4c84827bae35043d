"""Coverage of the detection gates' bootstrap lower bounds on known-truth populations (docs/gates/detection.md).

For each detector behaviour of ``tests/families/detection/_detection_truth.py`` (image-level difficulty, five
classes) a population of 20,000 images is matched once; its mAP@0.5, mAP@[.5:.95] and recall (score ≥ 0.5,
IoU ≥ 0.5; per class and over all objects) are the truth. Then ``--samples`` samples of each ``--sizes``
images are drawn and each statistic's 95 % lower bound is read by every method from one bootstrap
(``--bootstrap`` replicates, as the gate does). The table gives the share of samples whose bound lay at or
below the truth, with its 95 % Clopper–Pearson interval; acceptance is CP-lower ≥ nominal − 3 points.

    python benchmarks/detection_bound_coverage.py                      # the docs' table (~15 min, 2 cores)
    python benchmarks/detection_bound_coverage.py --scenarios good --sizes 60 --samples 50
    python benchmarks/detection_bound_coverage.py --scenarios overconfident --sizes 1000 --samples 50 --seed 3 \
        --methods percentile wide                                   # one shard of a row (merge the counts)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "families" / "detection"))
from _detection_truth import SCENARIOS, STATISTICS, coverage_run, population, truth  # noqa: E402

METHODS = ("percentile", "bca", "extrapolated", "conservative", "wide")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS))
    ap.add_argument("--sizes", nargs="*", type=int, default=[60, 300])
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--population", type=int, default=20_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--seed", type=int, default=None,
                    help="the samples' seed (default: the sample size); shards of one row run with other seeds")
    args = ap.parse_args(argv)
    methods = tuple(args.methods)
    torch.set_num_threads(args.threads)
    print("| scenario | images | statistic | method | coverage | 95% CP interval | samples | mean estimate / truth |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.scenarios:
        engine = population(SCENARIOS[name], args.population, seed=1)
        values = truth(engine)
        for n in args.sizes:
            t0 = time.time()
            seed = n if args.seed is None else args.seed
            cov = coverage_run(engine, values, n, args.samples, bootstrap=args.bootstrap, seed=seed, methods=methods)
            for stat in STATISTICS:
                for method in methods:
                    if (stat, method) not in cov.covered:
                        continue
                    lo, hi = cov.interval(stat, method)
                    bias = ""
                    if stat in cov.estimate_sum:
                        bias = f"{cov.estimate_sum[stat] / cov.samples:.3f} / {values[stat]:.3f}"
                    flag = "" if lo >= 0.92 else " ✗"
                    print(f"| {name} | {n} | {stat} | {method} | {cov.rate(stat, method):.3f}{flag} | "
                          f"[{lo:.3f}, {hi:.3f}] | {cov.count(stat, method)[1]} | {bias} |", flush=True)
            print(f"<!-- {name} n={n}: {time.time() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
