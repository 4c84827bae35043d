"""The evidence's input digests never block or read without bound (issue #29 §3).

A FIFO given as the data setting used to block the evidence writer at the end of the run (``open`` of a FIFO
waits for a writer), and a sparse 10 GiB file that the loader had refused in milliseconds was hashed for a
minute. The digest is now taken only of a regular file within the data budget; otherwise it is null with a
note saying why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_dnnsafety.report.environment import _digest_entry, file_digest


def test_a_regular_file_is_hashed(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    path.write_bytes(b"abc")
    assert _digest_entry(path) == {"digest": file_digest(path)}
    assert file_digest(path) == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_a_fifo_is_not_opened(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    os.mkfifo(path)
    entry = _digest_entry(path)  # would block forever if it opened the FIFO
    assert entry["digest"] is None and "FIFO" in entry["digest_note"]


def test_a_file_beyond_the_data_budget_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pytest_dnnsafety.files.parsing as parsing

    path = tmp_path / "huge.npy"
    with open(path, "wb") as handle:
        handle.truncate(1 << 20)  # sparse
    monkeypatch.setattr(parsing, "data_budget", lambda: 1 << 10)
    entry = _digest_entry(path)
    assert entry["digest"] is None and "exceeds the data budget" in entry["digest_note"]


def test_a_symlink_loop_is_described(tmp_path: Path) -> None:
    loop = tmp_path / "loop.npz"
    loop.symlink_to(loop)
    entry = _digest_entry(loop)
    assert entry["digest"] is None and "loop" in entry["digest_note"]
