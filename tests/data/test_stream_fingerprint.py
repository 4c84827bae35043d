"""Streamed data fingerprinted (issue #30 §9): an order-sensitive digest of every batch a DataLoader yields."""

from __future__ import annotations

import json

import pytest
import torch

from pytest_dnnsafety.data.fingerprint import StreamDigest, apply_streamed, streamed_record
from pytest_dnnsafety.data.forms import as_tensors, iter_batches


class Rows(torch.utils.data.Dataset):
    """A map-style data set (not a TensorDataset: not fingerprinted at fixture setup)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _data(seed: int = 0, n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 4, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _loader(x: torch.Tensor, y: torch.Tensor, batch_size: int = 4) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Rows(x, y), batch_size=batch_size)


def _digest(loader: torch.utils.data.DataLoader) -> str:
    for _ in iter_batches(loader, 256):
        pass
    record = streamed_record(loader)
    assert record is not None
    return record["digest"]


def test_the_same_data_read_twice_gives_the_same_digest() -> None:
    x, y = _data()
    first, second = _loader(x, y), _loader(x.clone(), y.clone())
    assert _digest(first) == _digest(second)
    _digest(first)  # a second pass over the same loader agrees with the first
    record = streamed_record(first)
    assert record is not None and record["passes"] == 2 and record["passes_agree"]
    assert record["batches"] == 3 and record["rows"] == 10 and record["order"].startswith("index order")
    as_tensors(second)  # materialising a loader is a pass too
    assert streamed_record(second)["passes"] == 2  # type: ignore[index]


def test_the_digest_is_order_sensitive_and_sees_a_changed_value_or_label() -> None:
    x, y = _data()
    base = _digest(_loader(x, y))
    order = torch.arange(9, -1, -1)
    assert _digest(_loader(x[order], y[order])) != base  # the same rows in another order
    changed = x.clone()
    changed[7, 0, 0, 0] += 1e-3
    assert _digest(_loader(changed, y)) != base
    relabelled = y.clone()
    relabelled[0] = (relabelled[0] + 1) % 3
    assert _digest(_loader(x, relabelled)) != base
    assert _digest(_loader(x, y, batch_size=5)) != base  # the batches' shapes are part of what was read


def test_a_pass_stopped_early_records_nothing() -> None:
    x, y = _data()
    loader = _loader(x, y)
    batches = iter_batches(loader, 256)
    next(batches)
    batches.close()
    assert streamed_record(loader) is None


def test_passes_that_read_different_bytes_are_flagged() -> None:
    class Noisy(Rows):
        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.x[i] + torch.rand(()), self.y[i]  # a random transform

    x, y = _data()
    loader = torch.utils.data.DataLoader(Noisy(x, y), batch_size=4)
    first = _digest(loader)
    _digest(loader)
    record = streamed_record(loader)
    assert record is not None and record["digest"] == first and record["passes_agree"] is False
    inputs = {"data": {"fixture": "dataset", "digest": None, "not_fingerprinted": "a DataLoader over Noisy"}}
    apply_streamed(inputs, {"data": loader})
    assert inputs["data"]["digest"] == first and "first pass" in inputs["data"]["digest_of"]


def test_apply_streamed_fills_only_unfingerprinted_streamed_loaders() -> None:
    x, y = _data()
    streamed, unread = _loader(x, y), _loader(x, y)
    _digest(streamed)
    known = {"fixture": "model", "digest": "sha256:" + "0" * 64}
    inputs = {"data": {"fixture": "dataset", "digest": None, "not_fingerprinted": "a DataLoader over Rows"},
              "other": {"fixture": "other", "digest": None, "not_fingerprinted": "a DataLoader over Rows"},
              "model": dict(known)}
    apply_streamed(inputs, {"data": streamed, "other": unread, "model": torch.nn.Linear(2, 2)})
    data = inputs["data"]
    assert data["digest"] == streamed_record(streamed)["digest"]  # type: ignore[index]
    assert "not_fingerprinted" not in data
    assert "in the order read" in data["digest_of"] and data["rows"] == 10
    assert data["streamed"] == {"batches": 3, "rows": 10, "passes": 1, "passes_agree": True,
                                "order": "index order (SequentialSampler)"}
    assert inputs["other"]["digest"] is None and "streamed" not in inputs["other"]  # never read: still says why
    assert inputs["model"] == known
    json.dumps(inputs)


def test_stream_digest_hashes_host_tensors_only() -> None:
    digest = StreamDigest()
    digest.tensor("x", torch.zeros(2, 2, device="meta"))
    assert digest.skipped and "meta" in digest.skipped


EVIDENCE_PROJECT = """
    import pytest
    import torch

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n, shift):
            gen = torch.Generator().manual_seed(0)
            self.x = torch.rand(n, 4, generator=gen) + shift
            self.y = torch.arange(n) % 2

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    @pytest.fixture
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))

    @pytest.fixture
    def dataset():
        import os
        return torch.utils.data.DataLoader(Rows(24, float(os.environ.get("SHIFT", "0"))), batch_size=8)
"""


def test_evidence_names_a_streamed_dataloader_and_a_baseline_sees_it_change(
        gate_project: object, monkeypatch: pytest.MonkeyPatch) -> None:
    project = gate_project
    project.write("conftest.py", EVIDENCE_PROJECT)  # type: ignore[attr-defined]
    project.tests("""
        import pytest

        @pytest.mark.min_neuron_k_activation(0.0, layer="1", k=1)
        def test_k(model, dataset):
            pass
    """)  # type: ignore[attr-defined]
    project.run("--dnnsafety-save-baseline=base.json").assert_outcomes(passed=1)  # type: ignore[attr-defined]
    path = project.pytester.path  # type: ignore[attr-defined]
    stored = json.loads((path / "base.json").read_text())
    data = stored["gates"][0]["inputs"]["data"]
    assert data["type"] == "torch.utils.data.dataloader.DataLoader"
    assert data["digest"].startswith("sha256:") and "not_fingerprinted" not in data
    assert data["streamed"]["rows"] == 24 and data["streamed"]["batches"] == 3
    jsonschema = pytest.importorskip("jsonschema")
    from pytest_dnnsafety.report.schemas import evidence_schema

    jsonschema.Draft202012Validator(evidence_schema()).validate(stored)
    monkeypatch.setenv("SHIFT", "0.5")  # other data behind the same fixture: the baseline says so
    again = project.run("--dnnsafety-baseline=base.json", "--dnnsafety-json=e.json")  # type: ignore[attr-defined]
    again.assert_outcomes(passed=1)
    gate = json.loads((path / "e.json").read_text())["gates"][0]
    assert gate["inputs"]["data"]["digest"] != data["digest"]
    assert gate["baseline"]["status"] == "inputs-changed"
