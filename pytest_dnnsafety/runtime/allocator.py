"""The C allocator under a streamed pass: freed batches go back to the system.

glibc serves an allocation above its *mmap threshold* with its own ``mmap`` and gives it back on
``free``. The threshold is dynamic: freeing such a block raises it to the block's size (up to
32 MiB), so from the first freed batch on, batch-sized tensors come from the heap instead, and
memory freed inside the heap stays mapped. A pass that streams its data batch by batch then showed
a peak RSS that grew with the number of batches although nothing kept them (the streaming
acceptance project: 299 → 532 MiB for 2,000 → 20,000 images of 3×32×32 in one run of three, the
plugin holding 1 KiB per input).

:func:`release` returns the heap's free pages to the system (glibc's ``malloc_trim(0)``, which also
releases free pages inside the heap); the engine runner calls it every :data:`EVERY` batches, so a
streamed pass's peak RSS stays bounded by a few batches whatever the data size. It costs a walk of
the heap's free lists (well under a millisecond next to a forward pass), touches no tensor and
synchronises no device. Fixing the threshold instead (``mallopt``, or ``MALLOC_MMAP_THRESHOLD_``)
also bounds the peak, but makes every batch-sized allocation a fresh ``mmap`` in the whole process:
measured, it slowed the test suite by a fifth. Off glibc, or with ``DNNSAFETY_KEEP_MALLOC`` set to a
non-empty value, :func:`release` does nothing.

No torch and no pytest import here.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

__all__ = ["release", "EVERY", "OPT_OUT_ENV"]

#: The runner releases free memory every this many batches.
EVERY = 8
#: Set to a non-empty value to leave the allocator alone.
OPT_OUT_ENV = "DNNSAFETY_KEEP_MALLOC"

_trim: Any = None  # glibc's malloc_trim, False when unavailable


def _load() -> Any:
    global _trim
    if _trim is None:
        _trim = False
        if sys.platform.startswith("linux") and not os.environ.get(OPT_OUT_ENV):
            try:
                libc = ctypes.CDLL(None)
                libc.gnu_get_libc_version  # only glibc has malloc_trim
                trim = libc.malloc_trim
                trim.argtypes = [ctypes.c_size_t]
                trim.restype = ctypes.c_int
                _trim = trim
            except (OSError, AttributeError):
                _trim = False
    return _trim


def release() -> bool:
    """Give the C heap's free pages back to the system; True when glibc's ``malloc_trim`` ran."""
    trim = _load()
    if not trim:
        return False
    trim(0)
    return True
