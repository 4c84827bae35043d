"""Freed batches go back to the system during a streamed pass (pytest_dnnsafety.runtime.allocator), unless opted out."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import torch

from pytest_dnnsafety.runtime import allocator
from pytest_dnnsafety.engines.core.runner import Runner

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

_PROBE = "import pytest_dnnsafety.runtime.allocator as a; print(a.release(), a.release())"


def _probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != allocator.OPT_OUT_ENV}
    clean.update(env)
    return subprocess.run([sys.executable, "-c", _PROBE], env=clean, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_release_runs_on_glibc_and_the_opt_out_leaves_the_allocator_alone() -> None:
    assert _probe() == ("True True" if GLIBC else "False False")
    assert _probe(**{allocator.OPT_OUT_ENV: "1"}) == "False False"


def test_the_runner_releases_every_few_batches(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(allocator, "release", lambda: calls.append(1) or True)
    runner = Runner("t", batch_size=1)
    runner.run(torch.zeros(3 * allocator.EVERY + 1, 2), lambda batch: None)
    assert len(calls) == 3
