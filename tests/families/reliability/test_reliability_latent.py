"""max_pmi_ub on images (issue 30): no (d, d) covariance, operational inputs read in blocks, the latent route.

The 181 GB allocation: Scott's rule formed the (d, d) data covariance even for diagonal kernels —
150,528² float64 values at 3×224×224 — on every operational profile the fixture built, from a
``.npy`` or a DataLoader factory alike. The fixture now fits no KDE above ``KDE_MAX_DIM`` values
per input (ball cells stream the inputs; ``latent=`` encodes them a batch at a time).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from conftest import GateProject
from pytest_dnnsafety.engines.reliability.latent import (
    KDE_MAX_DIM,
    NpyRows,
    OperationalInputs,
    fit_pca,
    latent_profile,
)
from pytest_dnnsafety.engines.reliability.profile import PCA, OperationalProfile
from pytest_dnnsafety.errors import ConfigError


def test_diagonal_bandwidth_needs_no_covariance_matrix() -> None:
    # 40,000 dimensions: the (d, d) covariance would be 12.8 GB; the per-dimension variances are 320 kB
    x = torch.rand(12, 40_000, dtype=torch.float64)
    profile = OperationalProfile(x)
    expected = x.std(0, unbiased=True) * 12 ** (-1.0 / (40_000 + 4))
    assert torch.allclose(profile.bandwidth, expected)


def test_npy_rows_and_streamed_pca_match_the_held_fit(tmp_path) -> None:
    gen = np.random.default_rng(0)
    x = gen.random((37, 2, 8, 9)).astype(np.float32) * np.linspace(0.2, 2, 144, dtype=np.float32).reshape(2, 8, 9)
    np.save(tmp_path / "x.npy", x)
    rows = NpyRows(tmp_path / "x.npy")
    assert rows.shape == (37, 2, 8, 9) and np.array_equal(rows.rows(5, 9), x[5:9])
    inputs = OperationalInputs(rows)
    assert torch.equal(torch.cat(list(inputs.batches())), torch.from_numpy(x))
    import pytest_dnnsafety.engines.reliability.latent as latent_mod

    old = latent_mod.GRAM_ELEMS
    latent_mod.GRAM_ELEMS = 144 * 5  # blocks of 5 rows: the nested passes, not one block
    try:
        streamed = fit_pca(inputs, 3)
    finally:
        latent_mod.GRAM_ELEMS = old
    held = PCA(3).fit(torch.from_numpy(x))
    assert torch.allclose(streamed.components, held.components, atol=1e-4)
    assert torch.allclose(streamed.explained_variance, held.explained_variance, rtol=1e-4)
    z = streamed.encode(torch.from_numpy(x[:4]))
    assert streamed.decode(z).shape == (4, 2, 8, 9)


def test_latent_profile_holds_encodings_only() -> None:
    x = torch.rand(40, 3, 24, 24)
    profile = latent_profile(OperationalInputs(x), 2, clip=(0, 1))
    assert profile.latent and profile.dim == 2 and profile.inputs is None
    assert profile.input_shape == (3, 24, 24)
    assert profile.decode(profile.points[:3] * 100).max() <= 1.0  # decoded samples clamped to clip


def test_feature_extractor_without_decoder_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="needs an encoder and a decoder.*Fix: latent=<int>"):
        latent_profile(torch.rand(10, 2000), torch.nn.Flatten())


# ---------------------------------------------------------------- through the gate
#: An image data set made per index (never held): ``{side}``² images whose brightness says the class.
IMAGES_CLASS = """
class Images(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1000 + i)
        return ({scale} * torch.rand(3, {side}, {side}, generator=g) + {offset} * (i % 2) + {base}), i % 2
"""

IMAGES = "import torch\n\n" + IMAGES_CLASS.format(side=24, scale=0.2, offset=0.2, base=0.3) + """

def loader():
    return torch.utils.data.DataLoader(Images(60, 1), batch_size=16)
"""

CONFTEST = """
import pytest
import torch

from pmi_latent_images import Images


class Mean(torch.nn.Module):
    \"\"\"Class 1 when the image is bright on average.\"\"\"

    def forward(self, x):
        m = x.reshape(x.shape[0], -1).mean(1)
        return torch.stack([0.5 - m, m - 0.5], dim=1)


@pytest.fixture(scope="session")
def model():
    return Mean()


@pytest.fixture(scope="session")
def dataset():
    return torch.utils.data.DataLoader(Images(40, 2), batch_size=16)
"""


@pytest.fixture
def image_project(gate_project: GateProject) -> GateProject:
    gen = np.random.default_rng(0)
    y = np.arange(60) % 2
    x = (0.2 * gen.random((60, 3, 24, 24)) + 0.3 + 0.2 * y[:, None, None, None]).astype(np.float32)
    np.save(gate_project.pytester.path / "op.npy", x)
    gate_project.ini.update({"dnnsafety_operational_data": "op.npy"})
    gate_project.write("pmi_latent_images.py", IMAGES)
    gate_project.write("conftest.py", CONFTEST)
    return gate_project


def _gates(project: GateProject) -> dict:
    return {g["nodeid"].split("::")[1]: g for g in json.loads((project.pytester.path / "e.json").read_text())["gates"]}


@pytest.mark.parametrize("source", ["op.npy", "pmi_latent_images:loader"])
def test_balls_and_the_latent_route_reach_verdicts_on_images(image_project: GateProject, source: str) -> None:
    image_project.ini["dnnsafety_operational_data"] = source
    image_project.tests("""
import pytest

@pytest.mark.max_pmi_ub(0.5, cells="balls", radius=0.01, clip=(0, 1), samples_per_cell=20, bootstrap=0)
def test_balls():
    pass

@pytest.mark.max_pmi_ub(0.5, latent=2, clip=(0, 1), samples_per_cell=20, bootstrap=0, max_cells=20,
                        empty_cell_label="nearest", accept_violated_assumptions=True)
def test_latent():
    pass

@pytest.mark.max_pmi_ub(0.5, samples_per_cell=20, bootstrap=0)
def test_raw_grid():
    pass

@pytest.mark.max_pmi_ub(0.5, cells="balls", latent=2, clip=(0, 1))
def test_latent_balls():
    pass
""")
    result = image_project.run("--dnnsafety-json=e.json")
    gates = _gates(image_project)
    assert gates["test_balls"]["status"] == "passed", gates["test_balls"]
    assert gates["test_balls"]["details"]["cell_kind"] == "balls"
    latent = gates["test_latent"]
    assert latent["status"] == "passed", latent
    assert latent["details"]["latent"] is True and len(latent["details"]["grid_shape"]) == 2
    text = result.stdout.str()
    assert "1,728 values per input" in text and "Fix: cells='balls'" in text and "latent=16" in text
    assert "latent= puts grid cells in a latent space" in text


def test_the_latent_route_fails_a_model_that_swaps_the_classes(image_project: GateProject) -> None:
    """Known answer: the model calls every bright image dark and back; on latent cells labelled from the labelled
    points (the plain truth here) the bound must be far above the threshold: FAIL, never a pass."""
    image_project.write("conftest.py", CONFTEST.replace("torch.stack([0.5 - m, m - 0.5]", "torch.stack([m - 0.5, 0.5 - m]"))
    image_project.ini["dnnsafety_operational_data"] = "pmi_latent_images:loader"
    image_project.tests("""
import pytest

@pytest.mark.max_pmi_ub(0.1, latent=2, clip=(0, 1), samples_per_cell=20, bootstrap=0, max_cells=20,
                        empty_cell_label="nearest", accept_violated_assumptions=True)
def test_latent():
    pass
""")
    result = image_project.run("--dnnsafety-json=e.json")
    gate = _gates(image_project)["test_latent"]
    assert result.ret != 0 and gate["status"] == "failed", gate
    assert gate["value"] > 0.5, gate["summary"]


MEMORY_CONFTEST = "import pytest\nimport torch\n\n" + IMAGES_CLASS.format(side=224, scale=0.25, offset=0.5, base=0.0) + """

class Head(torch.nn.Module):  # a small stand-in: the memory measured is the data handling's
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 7, stride=4)
        self.fc = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


@pytest.fixture(scope="session")
def model():
    torch.manual_seed(0)
    return Head().eval()


@pytest.fixture(scope="session")
def dataset():
    return torch.utils.data.DataLoader(Images(100, 2), batch_size=32)


def loader():
    return torch.utils.data.DataLoader(Images(N, 1), batch_size=32)


def pytest_unconfigure(config):
    peak = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
    open("peak.txt", "w").write(peak.split()[1])
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("source", ["op.npy", "pmi_memory_images:loader"])
def test_peak_memory_at_224_is_bounded(gate_project: GateProject, source: str) -> None:
    """400 operational images of 3x224x224 (241 MB as float32; the old fixture asked for 181 GB), ball cells, in a
    subprocess: peak RSS (VmHWM) under 1.5 GiB, from a .npy file and from a DataLoader factory alike."""
    n = 400
    path = gate_project.pytester.path
    if source == "op.npy":
        arr = np.lib.format.open_memmap(path / "op.npy", mode="w+", dtype=np.float32, shape=(n, 3, 224, 224))
        gen = np.random.default_rng(1)
        for i in range(0, n, 50):
            arr[i : i + 50] = (0.25 * gen.random((50, 3, 224, 224)) + 0.5 * (np.arange(i, i + 50) % 2)[:, None, None,
                                                                                                     None])
        arr.flush()
        del arr
    gate_project.ini["dnnsafety_operational_data"] = source
    gate_project.write("pmi_memory_images.py", MEMORY_CONFTEST.replace("Images(N, 1)", f"Images({n}, 1)"))
    gate_project.write("conftest.py", "from pmi_memory_images import dataset, model, pytest_unconfigure  # noqa\n")
    gate_project.tests("""
import pytest

@pytest.mark.max_pmi_ub(1.0, cells="balls", radius=0.02, clip=(0, 1), samples_per_cell=2, bootstrap=0,
                        accept_violated_assumptions=True)
def test_pmi():
    pass
""")
    result = gate_project.run("--dnnsafety-json=e.json", subprocess=True)
    gate = _gates(gate_project)["test_pmi"]
    assert gate["status"] in ("passed", "failed") and gate["value"] is not None, result.stdout.str()[-2000:]
    peak_gib = int((path / "peak.txt").read_text()) / 2**20
    assert peak_gib < 1.5, f"peak RSS {peak_gib:.2f} GiB"
