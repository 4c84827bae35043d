"""Issue #21: the scale benchmark project takes every built-in gate family to a verdict in bounded memory.

``benchmarks/scale_project`` is a user project: structured 3x224x224 images under operating
conditions in uint8 shards on disk, read through a ``DataLoader`` with two workers over a
memory-mapped map-style data set, a ResNet-18-style and a ViT-style model and a one-object detector
(the same ResNet backbone, boxes from the images' masks) briefly trained on them, and one test module
per gate family. This test generates the data (``SCALE_TEST_N`` evaluation
images, default 2,000) and trains quick weights once (both cached in the temporary folder, keyed by
the project's source), then runs the project's benchmark runner (``python -m scale_demo.bench``):
one driver that imported torch once forks a child per module, each running a fresh pytest session
with its peak RSS reset, the ResNet gated from its ``.pt2`` export (``--pt2``) and the operational
profile read both from the project's DataLoader factory and from a ``.npy`` file. It asserts that
every built-in marker reached a verdict (passed or failed, never error or inconclusive) and that
every module's peak RSS stayed below 4 GiB.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pytest_dnnsafety.gates import builtin_registry

PROJECT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale_project"
N = int(os.environ.get("SCALE_TEST_N", "2000"))
#: Training images: the project's own 2,000 (2 epochs). With 600 the weights carried too little signal (clean
#: accuracy 0.22 on the attack subset): the adversarial, occlusion and class-bias gates were inconclusive.
TRAIN = 2000
PEAK_RSS_LIMIT_KIB = 4 * 1024 * 1024
#: Subsets smaller than the benchmark's defaults: the suite checks verdicts and memory, not figures.
SUBSETS = ("SCALE_N_ATTACK=64", "SCALE_N_OCCLUSION=8", "SCALE_N_CERTIFIED=2", "SCALE_N_RADIUS=1",
           "SCALE_N_FIT=256", "SCALE_N_PMI=20")
VERDICTS = {"passed", "failed"}


def _env(data: Path, models: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(SCALE_DATA=str(data), SCALE_MODELS=str(models), SCALE_WIDTH="8",
               PYTHONPATH=os.pathsep.join(p for p in [str(PROJECT), env.get("PYTHONPATH", "")] if p))
    return env


def _run(args: list[str], env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=PROJECT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (args, proc.stdout[-3000:], proc.stderr[-3000:])


@pytest.fixture(scope="module")
def cached() -> tuple[Path, Path]:
    """Data and quick weights in the temporary folder, keyed by the project's source and the sizes."""
    source = hashlib.sha256()
    for path in sorted((PROJECT / "scale_demo").glob("*.py")):
        source.update(path.name.encode() + path.read_bytes())
    key = source.hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"pytest-dnnsafety-scale-{key}-{N}-{TRAIN}"
    if not (root / "done").exists():
        shutil.rmtree(root, ignore_errors=True)
        env = _env(root / "data", root / "models")
        _run(["scale_demo.data", "--n", str(N), "--train", str(TRAIN), "--out", str(root / "data")], env, 600)
        _run(["scale_demo.train", "--epochs", "2"], env, 900)
        (root / "done").write_text("ok")
    return root / "data", root / "models"


@pytest.mark.slow
def test_every_gate_family_reaches_a_verdict_at_scale(cached: tuple[Path, Path], tmp_path: Path) -> None:
    data, models = cached
    args = ["scale_demo.bench", "--n", str(N), "--width", "8", "--pt2", "--json", str(tmp_path / "results.json"),
            "--out", str(tmp_path / "bench")]
    for subset in SUBSETS:
        args += ["--subset", subset]
    _run(args, _env(data, models), 1200)
    result = json.loads((tmp_path / "results.json").read_text())
    gates = result["gates"]
    assert {g["marker"] for g in gates} == set(builtin_registry()), "every built-in marker has a gate in the project"
    bad = [f"{g['unit']}::{g['test']} {g['marker']}: {g['status']}: {g['summary']}" for g in gates
           if g["status"] not in VERDICTS]
    assert not bad, bad
    assert result["units"]["test_scenarios"]["fixture_sizes"]["dataset"] == N
    assert result["pt2"] and {u for u in result["units"]} >= {"test_reliability", "test_reliability[npy]"}
    accuracy = {g["unit"]: g for g in gates if g["marker"] == "min_scenario_accuracy"}
    assert accuracy["test_scenarios"]["estimated_s"] is not None  # the estimate printed before the gate ran
    for unit, record in result["units"].items():
        assert record["peak_rss_kib"] < PEAK_RSS_LIMIT_KIB, (unit, record["peak_rss_kib"] / 1024, "MiB")
        assert record["workers_peak_rss_kib"] < PEAK_RSS_LIMIT_KIB, (unit, record["workers_peak_rss_kib"] / 1024)


def test_shard_boxes_and_detector_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fast: the detection data's boxes are the masks' tight boxes, read through detection_collate, and the
    detector returns torchvision's format (one detection per image), deterministic in eval mode."""
    import torch

    monkeypatch.syspath_prepend(str(PROJECT))
    from scale_demo.data import ShardBoxes, ShardImages, boxes_loader, generate
    from scale_demo.models import detector

    from pytest_dnnsafety.data.tasks import BoxSet, infer_task

    generate(tmp_path, n=6, train=2)
    data = ShardBoxes(tmp_path / "eval")
    masks = ShardImages(tmp_path / "eval").masks()
    for i in range(len(data)):
        x, target = data[i]
        ys, xs = torch.nonzero(masks[i], as_tuple=True)
        expected = torch.tensor([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]], dtype=torch.float32)
        assert torch.equal(target["boxes"], expected) and target["labels"].dtype == torch.int64
        assert torch.equal(x, ShardImages(tmp_path / "eval")[i][0])
    loader = boxes_loader(tmp_path / "eval", batch_size=4)
    assert infer_task(loader) == "detection"
    (x, y), _ = list(loader)
    assert isinstance(y, BoxSet) and y.boxes.shape == (4, 4) and y.image.tolist() == [0, 1, 2, 3]
    model = detector(width=8)
    with torch.no_grad():
        out, again = model(x), model(x)
    assert len(out) == 4 and all(set(d) == {"boxes", "scores", "labels"} for d in out)
    assert all(d["boxes"].shape == (1, 4) and d["scores"].shape == (1,) and d["labels"].shape == (1,) for d in out)
    assert all(torch.equal(a["boxes"], b["boxes"]) and torch.equal(a["scores"], b["scores"]) for a, b in zip(out, again))
    assert all(bool((d["boxes"][:, 2:] > d["boxes"][:, :2]).all()) for d in out)
