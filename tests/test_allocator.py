"""glibc's mmap threshold is fixed for the run (pytest_dnnsafety.allocator), unless the user chose otherwise."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from pytest_dnnsafety import allocator

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

_PROBE = "import pytest_dnnsafety.allocator as a; print(a.fix_mmap_threshold(), a.fix_mmap_threshold())"


def _probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", allocator.OPT_OUT_ENV)}
    clean.update(env)
    return subprocess.run([sys.executable, "-c", _PROBE], env=clean, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="the threshold is a glibc setting")
def test_the_threshold_is_fixed_once_on_glibc() -> None:
    assert _probe() == "True True"


def test_the_user_s_choice_and_the_opt_out_leave_the_allocator_alone() -> None:
    assert _probe(MALLOC_MMAP_THRESHOLD_="1048576") == "False False"
    assert _probe(**{allocator.OPT_OUT_ENV: "1"}) == "False False"


def test_a_configured_run_fixes_it(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    from pytest_dnnsafety import allocator\n"
                        f"    assert allocator._done is {GLIBC}\n")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
