"""``sample=N`` rows (pytest_dnnsafety.data.subsample): seeded, proportional per group, any data form restricted."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from pytest_dnnsafety.data.forms import as_tensors, iter_batches
from pytest_dnnsafety.data.subsample import choose, digest, take
from pytest_dnnsafety.data.tasks import DetectionData
from pytest_dnnsafety.errors import DataError


def test_same_seed_same_rows_other_seed_other_rows() -> None:
    a, b, c = choose(100, 10, 7), choose(100, 10, 7), choose(100, 10, 8)
    assert a.indices == b.indices and a.indices != c.indices
    assert list(a.indices) == sorted(set(a.indices)) and len(a.indices) == 10
    assert digest(a.indices) == digest(list(b.indices)) != digest(c.indices)
    assert a.to_details()["stratified_by"] is None


def test_stratified_proportionally_with_largest_remainders() -> None:
    groups = ["a"] * 50 + ["b"] * 30 + ["c"] * 15 + ["d"] * 5
    sub = choose(100, 10, 0, groups)
    counts = Counter(groups[i] for i in sub.indices)
    # floors 5, 3, 1, 0; the tenth row goes to the first of the equal remainders (c before d)
    assert counts == {"a": 5, "b": 3, "c": 2}
    assert sub.groups == {"a": (5, 50), "b": (3, 30), "c": (2, 15), "d": (0, 5)}
    details = sub.to_details("table t")
    assert details["stratified_by"] == "table t" and details["groups"] == 4


def test_all_rows_and_bad_counts() -> None:
    assert choose(5, 5, 1).indices == (0, 1, 2, 3, 4)
    for n in (0, 6, -1):
        with pytest.raises(ValueError):
            choose(5, n, 1)


def test_take_restricts_every_data_form_alike() -> None:
    x = torch.arange(20.0).reshape(10, 2)
    y = torch.arange(10)
    rows = (1, 4, 7)
    want = x[list(rows)]
    forms = [x, (x, y), [x, y], {"x": x, "y": y}, {"x": x.numpy(), "y": y.numpy()},
             torch.utils.data.TensorDataset(x, y),
             torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)]
    for data in forms:
        got = take(data, rows)
        gx, gy = as_tensors(got)
        assert torch.equal(gx.float(), want), type(data)
        if gy is not None:
            assert gy.tolist() == [1, 4, 7]
    loader = take(forms[-1], rows)
    assert loader.batch_size == 2 and [b[0].shape[0] for b in loader] == [2, 1]


def test_detection_data_keeps_each_images_boxes() -> None:
    x = torch.zeros(3, 1, 4, 4)
    data = DetectionData.from_offsets(x, np.array([[0, 0, 1, 1], [1, 1, 2, 2], [0, 0, 3, 3]], dtype=np.float32),
                                      np.array([0, 1, 2]), np.array([0, 1, 1, 3]))
    sub = take(data, (0, 2))
    (bx, boxes), = list(iter_batches(sub, 8))
    assert bx.shape[0] == 2 and boxes.n_images == 2
    assert boxes.labels.tolist() == [0, 1, 2]


def test_an_iterable_dataset_is_refused_with_the_fix() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(2), 0

    with pytest.raises(DataError, match="IterableDataset.*Fix:"):
        take(torch.utils.data.DataLoader(Stream()), (0,), "fixture 'dataset'")
