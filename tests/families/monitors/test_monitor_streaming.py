"""Runtime monitors stream their data (issue #20): a DataLoader over a data set read one input at a time.

The data is :class:`_streaming.StreamingImages` (3x32x32 images generated from the index; indexing it with
a slice or a list raises), batched by a ``DataLoader``. Known answers: every monitor, the lazy fault sets
(:class:`~pytest_dnnsafety.engines.monitors.FaultStream`) and the monitor gates give over the loader
exactly what they give over the same images as tensors batched alike; a fault set is faulted batch by
batch (seeded by the global batch index), so it never exists whole; and a monitor gate's peak memory
does not grow with the data (slow test: 10x the images, < 1.2x the peak RSS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _streaming import StreamingImages, stream_net
from pytest_dnnsafety.engines.core.capture import ActivationCache
from pytest_dnnsafety.engines.monitors import (ODIN, Autoencoder, Energy, FaultStream, Mahalanobis, MonitorView,
                                               fault_stream, fit_monitor)
from pytest_dnnsafety.engines.monitors.faults import apply_fault
from pytest_dnnsafety.engines.monitors.stream import batch_fault_seed

TESTS = Path(__file__).resolve().parents[2]  # tests/: the shared helper modules
BATCH = 16


def _loader(n: int, seed: int = 0) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(StreamingImages(n, seed=seed), batch_size=BATCH)


def _tensors(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    data = StreamingImages(n, seed=seed)
    xs, ys = zip(*(data[i] for i in range(n)))
    return torch.stack(xs), torch.tensor(ys)


class _Blur(torch.nn.Module):
    """A stand-in autoencoder: a 3x3 mean filter (reconstructs smooth images well, noise badly)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


class _Margin:
    """A user monitor (fit/score): minus the top-two logit margin."""

    def fit(self, model, x, y):  # noqa: ANN001 - the user protocol
        self.n = int(x.shape[0])

    def score(self, model, x):  # noqa: ANN001
        with torch.no_grad():
            top = model(x).topk(2, dim=1).values
        return top[:, 1] - top[:, 0]


def _monitors() -> dict[str, object]:
    return {"energy": Energy(), "odin": ODIN(temperature=10.0, epsilon=0.002),
            "maha": Mahalanobis(layer="classifier.1"), "ae": Autoencoder(_Blur()), "margin": _Margin()}


def test_a_fault_stream_is_faulted_per_batch_with_the_global_batch_seed() -> None:
    x, y = _tensors(40)
    stream = fault_stream((x, y), "gaussian_noise", 3, seed=5, batch_size=BATCH)
    assert isinstance(stream, FaultStream) and len(stream.dataset) == 40
    batches = list(stream)
    assert [b[0].shape[0] for b in batches] == [16, 16, 8]
    for index, (xf, yf) in enumerate(batches):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        gen = torch.Generator().manual_seed(batch_fault_seed(5, "gaussian_noise", 3, index))
        torch.testing.assert_close(xf, apply_fault("gaussian_noise", x[rows], 3, generator=gen), rtol=0, atol=0)
        assert torch.equal(yf, y[rows])
    again = torch.cat([b[0] for b in fault_stream((x, y), "gaussian_noise", 3, seed=5, batch_size=BATCH)])
    assert torch.equal(again, torch.cat([b[0] for b in batches]))  # deterministic
    other = torch.cat([b[0] for b in fault_stream((x, y), "gaussian_noise", 3, seed=6, batch_size=BATCH)])
    assert not torch.equal(other, again)


@pytest.mark.parametrize("family", ["gaussian_noise", "shifted_rows", "haze", "fgsm"])
def test_a_fault_stream_over_a_loader_equals_one_over_tensors(family: str) -> None:
    model = stream_net()
    loader, (x, y) = _loader(48), _tensors(48)
    kw = {"seed": 3, "model": model, "batch_size": BATCH}
    streamed = list(fault_stream(loader, family, 4, **kw))  # the data set is never indexed all at once
    whole = list(fault_stream((x, y), family, 4, **kw))
    for (a, ya), (b, yb) in zip(streamed, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert torch.equal(ya, yb)
    # the fixture's materialised form holds the same values
    torch.testing.assert_close(fault_stream(loader, family, 4, **kw).materialise().tensors[0],
                               torch.cat([b for b, _ in whole]), rtol=0, atol=0)


def test_every_monitor_scores_a_streaming_loader_as_it_scores_tensors() -> None:
    model = stream_net()
    fit_x, fit_y = _tensors(64, seed=1)
    loader, (x, y) = _loader(80), _tensors(80)
    noisy = fault_stream(loader, "gaussian_noise", 3, seed=0, batch_size=BATCH)
    noisy_t = fault_stream((x, y), "gaussian_noise", 3, seed=0, batch_size=BATCH)
    cache = ActivationCache()
    for name, monitor in _monitors().items():
        fitted = fit_monitor(monitor, model, (fit_x, fit_y), seed=0, batch_size=BATCH, cache=cache,
                             plan=("classifier.1",))
        for data, same in ((loader, (x, y)), (noisy, noisy_t)):
            got = fitted.score(MonitorView(model, data, batch_size=BATCH, cache=cache, plan=fitted.layers()))
            want = fitted.score(MonitorView(model, same, batch_size=BATCH, cache=cache, plan=fitted.layers()))
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    fitted_on_loader = fit_monitor(Mahalanobis(layer="classifier.1"), model, _loader(64, seed=1), seed=0,
                                   batch_size=BATCH)
    fitted_on_tensors = fit_monitor(Mahalanobis(layer="classifier.1"), model, (fit_x, fit_y), seed=0,
                                    batch_size=BATCH)
    assert fitted_on_loader.threshold == fitted_on_tensors.threshold
    torch.testing.assert_close(fitted_on_loader.precision(), fitted_on_tensors.precision(), rtol=0, atol=0)


def test_a_sorted_subset_view_streams_and_an_unsorted_one_gathers_only_its_rows() -> None:
    model, (x, y) = stream_net(), _tensors(40)
    view = MonitorView(model, _loader(40), batch_size=BATCH)
    rows = torch.tensor([33, 2, 17, 5])
    assert torch.equal(view.subset(rows).inputs(), x[rows])
    batches = list(view.subset(torch.tensor([1, 15, 16, 39])).batches())
    assert [b.shape[0] for b, _ in batches] == [2, 1, 1]  # one per source batch that holds a selected row
    assert torch.equal(torch.cat([l for _, l in batches]), y[[1, 15, 16, 39]])


CONFTEST = """
    import pytest
    import torch
    from _streaming import StreamingImages, stream_net
    from pytest_dnnsafety import ODIN, Autoencoder, Energy, Mahalanobis

    N = {n}


    class Blur(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


    def _tensors(n, seed=0):
        data = StreamingImages(n, seed=seed)
        xs, ys = zip(*(data[i] for i in range(n)))
        return torch.utils.data.TensorDataset(torch.stack(xs), torch.tensor(ys))


    @pytest.fixture(scope="session")
    def model():
        return stream_net()


    @pytest.fixture(scope="session")
    def dataset():
        return torch.utils.data.DataLoader(StreamingImages(N), batch_size={batch})


    @pytest.fixture(scope="session")
    def tensors():
        return _tensors(N)


    @pytest.fixture(scope="session")
    def monitor_data():
        return _tensors(64, seed=1)


    @pytest.fixture(scope="session")
    def monitors():
        return {{"energy": Energy(), "odin": ODIN(temperature=10.0, epsilon=0.002),
                 "maha": Mahalanobis(layer="classifier.1"), "ae": Autoencoder(Blur())}}
"""

GATES = {
    "detect": 'min_monitor_detection(-1.0, monitor="energy", faults=["gaussian_noise", "rotation", "fgsm"], '
              'severity=(2, 4), compare=["maha", "ae"])',
    "risk": 'max_monitor_selective_risk(1.0, monitor="odin", faults=["haze", "black_frame"], severity=3)',
    "risk_ae": 'max_monitor_selective_risk(1.0, monitor="ae", faults="impulse_noise", severity=5)',
}


def _write(root: Path, n: int, batch: int, gates: dict[str, str], forms: tuple[str, ...]) -> None:
    """A user project in ``root``: the conftest above, one test per (gate, data form)."""
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\ndnnsafety_seed = "1234"\n'
                                         f'dnnsafety_batch_size = "{batch}"\n')
    (root / "_streaming.py").write_text((TESTS / "_streaming.py").read_text())
    (root / "conftest.py").write_text(textwrap.dedent(CONFTEST).format(n=n, batch=batch))
    body = ["import pytest", ""]
    for form in forms:
        extra = "" if form == "dataset" else f', data="{form}"'
        for name, marker in gates.items():
            body += ["", f"@pytest.mark.{marker[:-1]}{extra})", f"def test_{name}_{form}():", "    pass", ""]
    (root / "test_gates.py").write_text("\n".join(body))


def _gates(path: Path) -> dict[str, dict]:
    return {g["nodeid"].split("::")[-1]: g for g in json.loads(path.read_text())["gates"]}


@pytest.mark.slow
def test_the_monitor_gates_over_a_streaming_loader_equal_the_tensors(pytester: pytest.Pytester) -> None:
    _write(pytester.path, 96, BATCH, GATES, ("dataset", "tensors"))
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", "--dnnsafety-json=evidence.json")
    assert result.ret == 0, result.stdout.str()
    got = _gates(pytester.path / "evidence.json")
    assert len(got) == 2 * len(GATES)
    for name in GATES:
        loader, tensors = got[f"test_{name}_dataset"], got[f"test_{name}_tensors"]
        assert loader["status"] == tensors["status"] == "passed", (loader, tensors)
        assert loader["value"] == tensors["value"], name
        for key in ("faults", "system", "per_set", "ranking", "monitor_threshold"):
            assert loader["details"].get(key) == tensors["details"].get(key), (name, key)


_RSS_CONFTEST = """

    import json
    import resource


    def pytest_unconfigure(config):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        with open("rss.json", "w") as out:
            json.dump({"peak_kib": peak}, out)
"""

TORCHRUN_GATES = {
    "detect": 'min_monitor_detection(-1.0, monitor="energy", faults=["gaussian_noise", "pgd"], severity=(2, 4), '
              'compare=["maha", "odin"])',
    "risk": 'max_monitor_selective_risk(1.0, monitor="ae", faults=["rotation", "black_frame"], severity=3)',
    "cost": 'max_monitor_overhead(1000000.0, monitor="odin", repeats=1)',
}


@pytest.mark.slow
def test_the_monitor_gates_under_two_torchrun_ranks_give_the_single_process_values(tmp_path: Path) -> None:
    """Two gloo ranks score their shards of the streaming loader (and of its fault streams): same verdicts and
    values as one process; the overhead gate is rank 0's."""
    from test_torchrun import GLOO, _clean_env, _torchrun

    if not GLOO:
        pytest.skip("torch.distributed with the gloo backend is not available")
    root = tmp_path / "project"
    root.mkdir()
    _write(root, 75, 8, TORCHRUN_GATES, ("dataset",))  # 10 batches, the last one short
    env = _clean_env(DNNSAFETY_TORCHRUN_TIMEOUT="240",
                     PYTHONPATH=os.pathsep.join([str(root), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    got = {}
    for name in ("one", "two"):
        args = ["-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist", "-q",
                f"--dnnsafety-json={tmp_path / name}.json"]
        if name == "one":
            done = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=root, env=env, capture_output=True,
                                  text=True, timeout=900)
        else:
            done = _torchrun(args, root, env, timeout=900)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        evidence = json.loads((tmp_path / f"{name}.json").read_text())
        assert evidence["environment"]["world_size"] == (1 if name == "one" else 2)
        got[name] = _gates(tmp_path / f"{name}.json")
    assert got["one"].keys() == got["two"].keys() and len(got["one"]) == len(TORCHRUN_GATES)
    for test, single in got["one"].items():
        sharded = got["two"][test]
        assert sharded["status"] == single["status"] == "passed", (sharded["summary"], single["summary"])
        if single["marker"] == "max_monitor_overhead":
            assert sharded["details"]["inputs"] == 75  # rank 0 timed the whole data
            continue
        assert (sharded["value"], sharded["bound"]) == (single["value"], single["bound"]), test
        for key in ("faults", "system", "per_set", "ranking", "monitor_threshold"):
            assert sharded["details"].get(key) == single["details"].get(key), (test, key)
