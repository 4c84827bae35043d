"""Measure every gate family of the project: wall time, inputs per second, peak memory.

``python -m scale_demo.bench --n 10000 --width 8 --json results.json --markdown results.md`` generates
the data (``--n`` evaluation images) and trains the models when they are missing, then starts one
driver process that imports torch, pytest and the plugin once and forks a child per test module of
the project (one gate family each, the ViT's gates apart). The child resets its peak RSS
(``/proc/self/clear_refs``), runs the module in a fresh pytest session with ``--dnnsafety-json``, and
records:

* per module: wall seconds, the process's peak RSS (``VmHWM``), the largest ``DataLoader`` worker's
  peak RSS (``RUSAGE_CHILDREN``), on CUDA the peak GPU memory (``torch.cuda.max_memory_allocated``),
  and the rows each model forwarded (queries);
* per gate (from the evidence): verdict, value, threshold, the gate's own seconds, the images its
  data fixture holds and those per second.

So no module inherits the heap an earlier one left behind, and every peak is that module's own. The
JSON holds the environment (Python, torch, plugin, device, CPU threads, load average), the sizes and
the records; the Markdown is a table for the README, each gate's measured seconds beside the estimate
it printed before it ran (``details.cost_estimate``).

A unit ``module[variant]`` runs the module with the variant's environment (:data:`VARIANTS`):
``test_reliability[npy]`` gives the operational profile as a ``.npy`` file instead of the project's
``DataLoader`` factory. ``--pt2`` exports the ResNet (``torch.export``) and gates that file
(``DNNSAFETY_MODEL``); ``--certified-size 224`` runs the certified gates on the ResNet at 224x224.
``--real`` is the production-width preset of issue #30: width 64, ``--pt2``, certified gates at 224x224
(one image for the bounds, two for the safe radius), 200 evaluation images and 200 for every subset.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import project

__all__ = ["UNITS", "SUBSETS", "ensure_data", "ensure_models", "measure", "markdown", "main"]

#: Test modules of the project, each measured in its own forked process, cheapest first.
UNITS = ("test_data", "test_scenarios", "test_neurons", "test_inspection", "test_monitors", "test_robustness",
         "test_interpretation", "test_reliability", "test_reliability[npy]", "test_vit", "test_detection")
#: Environment of a unit variant ``module[variant]`` (``{npy}``: the operational images as a .npy file).
VARIANTS = {"npy": {"DNNSAFETY_OPERATIONAL_DATA": "{npy}"}}
#: ``--real``: the ResNet-18 at its real width and 224x224 everywhere, 200 images per family.
REAL = {"n": 200, "train": 1000, "width": 64, "epochs": 3, "certified_size": 224,
        "subsets": {"SCALE_N_ATTACK": 200, "SCALE_N_OCCLUSION": 200, "SCALE_N_CERTIFIED": 1, "SCALE_N_RADIUS": 2,
                    "SCALE_N_FIT": 200, "SCALE_N_PMI": 200}}
#: Subset sizes (environment variable: default); see tests/conftest.py.
SUBSETS = {"SCALE_N_ATTACK": 500, "SCALE_N_OCCLUSION": 200, "SCALE_N_CERTIFIED": 4, "SCALE_N_RADIUS": 2,
           "SCALE_N_FIT": 1000, "SCALE_N_PMI": 60}
#: Environment the child must not inherit: torchrun's variables, pytest's, and glibc malloc tuning.
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
         "MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "DNNSAFETY_KEEP_MALLOC")

_DRIVER = r'''
import json, os, re, resource, sys, time
import torch  # imported once, before any module runs: every child starts from this process image
import pytest
import pytest_dnnsafety.plugin.hooks, pytest_dnnsafety.gates  # noqa: F401
import scale_demo.data, scale_demo.project  # noqa: F401

units, out, variants = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
for unit in units:
    module, _, variant = unit.partition("[")
    child = os.fork()  # a fresh copy of the clean driver per module: no heap left over from an earlier one
    if child == 0:
        code = 3
        try:
            with open("/proc/self/clear_refs", "w") as reset:  # "5": VmHWM starts again from the current RSS
                reset.write("5")
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            os.environ.update(variants.get(variant.rstrip("]"), {}))
            os.environ["SCALE_RECORD"] = os.path.join(out, unit)
            os.makedirs(os.environ["SCALE_RECORD"], exist_ok=True)
            began = time.perf_counter()
            code = int(pytest.main([f"tests/{module}.py", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
                                    f"--dnnsafety-json={out}/{unit}/evidence.json"]))
            wall = time.perf_counter() - began
            status = open("/proc/self/status").read()
            record = {"code": code, "wall_s": wall,
                      "peak_rss_kib": int(re.search(r"VmHWM:\s+(\d+)", status).group(1)),
                      "workers_peak_rss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                      "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}
            json.dump(record, open(f"{out}/{unit}/process.json", "w"))
        finally:
            sys.stdout.flush()
            os._exit(0 if code in (0, 1) else 2)
    os.waitpid(child, 0)
'''


def ensure_data(n: int, train: int) -> Path:
    """The data folder (``SCALE_DATA`` or ``data/``), generated when it does not hold ``n`` evaluation images."""
    from .data import generate

    folder = project.data_dir()
    meta = folder / "eval" / "meta.json"
    if not meta.exists() or json.loads(meta.read_text())["n"] != n or not (folder / "train" / "meta.json").exists():
        began = time.perf_counter()
        generate(folder, n, train)
        print(f"bench: generated {n} + {train} images in {time.perf_counter() - began:.0f} s", flush=True)
    return folder


def ensure_models(width: int, epochs: int = 2, kinds: tuple[str, ...] = ("resnet", "vit", "resnet_small", "detector")
                  ) -> None:
    """Train the models whose weights are missing (``python -m scale_demo.train``)."""
    from .train import main as train

    missing = [kind for kind in kinds if not project.weights_path(kind, width).exists()]
    if missing:
        train(["--width", str(width), "--epochs", str(epochs), "--models", *missing])


def _environment() -> dict[str, Any]:
    import torch

    import pytest_dnnsafety

    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "pytest_dnnsafety": getattr(pytest_dnnsafety, "__version__", "?"), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "cuda": cuda,
            "load_average_at_start": os.getloadavg()}


def measure(n: int, width: int, out: Path, units: tuple[str, ...] = UNITS, subsets: dict[str, int] | None = None,
            timeout: float | None = None, pt2: bool = False, certified_size: int | None = None) -> dict[str, Any]:
    """Run every unit in a forked child of one driver; the records as a dict (see the module docstring)."""
    from .data import operational_npy
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = {**SUBSETS, **(subsets or {})}
    data = project.data_dir()
    env = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith("PYTEST_")}
    env.update({k: str(v) for k, v in sizes.items()})
    env.update(SCALE_DATA=str(data), SCALE_MODELS=str(project.models_dir()), SCALE_WIDTH=str(width),
               DNNSAFETY_SCENARIOS=str(data / "scenarios.csv"), DNNSAFETY_CONDITIONS=str(data / "conditions.toml"),
               PYTHONPATH=os.pathsep.join(p for p in [str(project.ROOT), env.get("PYTHONPATH", "")] if p))
    if certified_size is not None:
        env["SCALE_CERTIFIED_SIZE"] = str(certified_size)
    if pt2:
        env["DNNSAFETY_MODEL"] = str(project.export(width))
    variants: dict[str, dict[str, str]] = {}
    for unit in units:
        _, _, variant = unit.partition("[")
        variant = variant.rstrip("]")
        if variant:
            os.environ["SCALE_N_PMI"] = str(sizes["SCALE_N_PMI"])
            fill = {"npy": str(operational_npy(data))} if variant == "npy" else {}
            variants[variant] = {k: v.format(**fill) for k, v in VARIANTS[variant].items()}
    result: dict[str, Any] = {"environment": _environment(), "n": n, "width": width, "subsets": sizes,
                              "pt2": pt2, "certified_size": certified_size or project.SMALL, "units": {}, "gates": []}
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(list(units)), str(out), json.dumps(variants)],
                          cwd=project.ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    result["total_wall_s"] = round(time.perf_counter() - began, 1)
    result["environment"]["load_average_at_end"] = os.getloadavg()
    (out / "driver.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"bench driver exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
    collect(result, out, units)
    return result


def collect(result: dict[str, Any], out: Path, units: tuple[str, ...], partial: bool = False) -> dict[str, Any]:
    """Add the records the children left under ``out`` to ``result`` (``partial``: skip units not yet run)."""
    for unit in units:
        folder = out / unit
        if not (folder / "process.json").exists():
            if partial:
                continue
            raise RuntimeError(f"{unit}: the child wrote no record (crashed?); see {out / 'driver.log'}")
        process = json.loads((folder / "process.json").read_text())
        record = json.loads((folder / "record.json").read_text())
        evidence = json.loads((folder / "evidence.json").read_text())
        threads = evidence.get("environment", {}).get("threads")
        rows = record["rows"]
        unit_record = {**process, "queries": rows, "fixture_sizes": record["sizes"], "threads": threads,
                       "device": evidence.get("environment", {}).get("device")}
        unit_record["queries_per_s"] = sum(rows.values()) / process["wall_s"] if process["wall_s"] else None
        result["units"][unit] = unit_record
        for gate in evidence["gates"]:
            fixture = _data_fixture(gate)
            inputs = record["sizes"].get(fixture)
            seconds = gate.get("seconds")
            details = gate.get("details") or {}
            spent = (seconds or 0.0) + (details.get("shared_pass_seconds") or 0.0)  # the pass it triggered too
            estimate = (details.get("cost_estimate") or {}).get("estimated_seconds")
            result["gates"].append({
                "unit": unit, "test": gate["nodeid"].split("::")[-1], "marker": gate["marker"],
                "status": gate["status"], "value": gate.get("value"), "threshold": gate.get("threshold"),
                "op": gate.get("op"), "summary": gate.get("summary"), "seconds": seconds, "estimated_s": estimate,
                "pass_s": details.get("shared_pass_seconds"),
                "data": fixture,
                "inputs": inputs, "inputs_per_s": inputs / spent if inputs and spent else None,
                "unit_wall_s": process["wall_s"], "peak_rss_kib": process["peak_rss_kib"],
                "workers_peak_rss_kib": process["workers_peak_rss_kib"], "gpu_peak_bytes": process["gpu_peak_bytes"],
            })
    return result


def _data_fixture(gate: dict[str, Any]) -> str | None:
    """The data fixture a gate read, from its evidence's ``inputs`` (role ``data``)."""
    inputs = gate.get("inputs") or {}
    data = inputs.get("data") if isinstance(inputs, dict) else None
    if isinstance(data, dict):
        return data.get("fixture") or data.get("name")
    return None


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    threads = sorted({(u.get("threads") or {}).get("threads") for u in result["units"].values()} - {None})
    model = " (.pt2)" if result.get("pt2") else ""
    lines = [f"N = {result['n']} evaluation images (3x224x224), ResNet-18 width {result['width']}{model}, certified "
             f"gates at {result.get('certified_size', project.SMALL)}²; "
             f"{env['device']}, torch {env['torch']}, {env['usable_cores']} usable cores, torch threads {threads}, "
             f"load average {env['load_average_at_start'][0]:.1f} at start, {env['load_average_at_end'][0]:.1f} at "
             f"end; total {result['total_wall_s']:.0f} s.", "",
             "A gate under 0.5 s (with its pass) reused its module's shared computation (or reads no images): no rate. "
             "Workers' peak: the largest DataLoader worker's peak RSS, pages shared with its parent included.", "",
             "Pass s: the shared forward pass the gate triggered (kept out of its own seconds). Estimate s: what "
             "the gate printed before it ran (its cost model × a probed time per forward), which counts that pass; "
             "a gate that reuses a pass estimates it too. Ratio: (gate s + pass s) / estimate s.", "",
             "| module | gate | verdict | data (images) | gate s | pass s | estimate s | ratio | images/s | module wall s | "
             "model rows | peak RSS MiB | workers' peak MiB | GPU peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in result["gates"]:
        gpu = f"{g['gpu_peak_bytes'] / 2**20:.0f}" if g["gpu_peak_bytes"] is not None else "–"
        rate = f"{g['inputs_per_s']:.1f}" if g["inputs_per_s"] and g["seconds"] + (g.get("pass_s") or 0) >= 0.5 else "–"
        rows = sum(result["units"][g["unit"]]["queries"].values())
        estimate = f"{g['estimated_s']:.1f}" if g.get("estimated_s") is not None else "–"
        spent = g["seconds"] + (g.get("pass_s") or 0.0)
        ratio = f"{spent / g['estimated_s']:.2f}" if g.get("estimated_s") and spent >= 0.5 else "–"
        shared = f"{g['pass_s']:.1f}" if g.get("pass_s") else "–"
        lines.append(f"| {g['unit']} | `{g['marker']}` | {g['status']} | {g['data']} ({g['inputs']}) | "
                     f"{g['seconds']:.1f} | {shared} | {estimate} | {ratio} | {rate} | {g['unit_wall_s']:.0f} | {rows} | {g['peak_rss_kib'] / 1024:.0f} | "
                     f"{g['workers_peak_rss_kib'] / 1024:.0f} | {gpu} |")
    if result.get("pt2"):
        lines += ["", "Model rows count the forwards through the loaded `.pt2` module; the shared activation pass runs the "
                  "program's graph with taps on its layers (a copy), which is not counted."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="evaluation images (default 10,000)")
    parser.add_argument("--train", type=int, default=2_000, help="training images when generating (default 2,000)")
    parser.add_argument("--width", type=int, default=8, help="the 224x224 ResNet's width (default 8)")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs when the weights are missing")
    parser.add_argument("--json", type=Path, default=Path("results.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="folder of the per-module evidence (default bench-N/)")
    parser.add_argument("--units", nargs="+", default=list(UNITS), choices=UNITS)
    parser.add_argument("--subset", action="append", default=[], metavar="NAME=N",
                        help=f"override a subset size, e.g. SCALE_N_ATTACK=1000 (defaults {SUBSETS})")
    parser.add_argument("--pt2", action="store_true", help="export the ResNet to .pt2 and gate that file")
    parser.add_argument("--certified-size", type=int, choices=(16, 224), default=None,
                        help="side of the certified gates' images (16: the CIFAR-stem model; 224: the ResNet)")
    parser.add_argument("--real", action="store_true",
                        help=f"the production-width preset (overrides --n, --width, ...): {REAL}")
    parser.add_argument("--collect-only", action="store_true",
                        help="only gather the records an earlier (possibly interrupted) run left in --out")
    args = parser.parse_args(argv)
    if args.real:
        args.n, args.train, args.width, args.epochs = REAL["n"], REAL["train"], REAL["width"], REAL["epochs"]
        args.pt2, args.certified_size = True, REAL["certified_size"]
        args.subset = [f"{k}={v}" for k, v in REAL["subsets"].items()] + args.subset
    subsets = dict(item.split("=", 1) for item in args.subset)
    unknown = set(subsets) - set(SUBSETS)
    if unknown:
        parser.error(f"--subset: unknown {sorted(unknown)}; use {sorted(SUBSETS)}")
    os.environ["SCALE_WIDTH"] = str(args.width)
    out = args.out or Path(f"bench-{args.n}")
    sizes = {**SUBSETS, **{k: int(v) for k, v in subsets.items()}}
    if args.collect_only:
        result = {"environment": {**_environment(), "load_average_at_end": os.getloadavg()}, "n": args.n,
                  "width": args.width, "subsets": sizes, "units": {}, "gates": [], "total_wall_s": float("nan"),
                  "partial": True}
        collect(result, out.resolve(), tuple(args.units), partial=True)
    else:
        ensure_data(args.n, args.train)
        small = args.certified_size != 224  # the CIFAR-stem model serves only 16x16 certified gates
        ensure_models(args.width, args.epochs, ("resnet", "vit", "detector") + (("resnet_small",) if small else ()))
        result = measure(args.n, args.width, out, tuple(args.units), sizes, pt2=args.pt2,
                         certified_size=args.certified_size)
    args.json.write_text(json.dumps(result, indent=1))
    table = markdown(result)
    if args.markdown:
        args.markdown.write_text(table)
    print(table)
    return result


if __name__ == "__main__":
    main()
