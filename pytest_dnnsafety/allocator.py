"""The C allocator under a streamed pass: glibc's dynamic mmap threshold, fixed for the run.

glibc serves an allocation above its *mmap threshold* (128 KiB at start) with its own ``mmap`` and
gives it back on ``free``. The threshold is dynamic: freeing such a block raises it to the block's
size (up to 32 MiB), so from the first freed batch on, every batch-sized tensor comes from the heap
instead, and a heap whose top holds a small live allocation cannot shrink. A pass that streams its
data batch by batch then shows a peak RSS that can grow with the number of batches although nothing
keeps them (measured on the streaming acceptance project: 299 → 532 MiB for 2,000 → 20,000 images of
3×32×32, the plugin holding 1 KiB per input). Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``, the
same as the ``MALLOC_MMAP_THRESHOLD_`` environment variable) turns the adjustment off: a batch's
memory goes back to the system when the batch is freed, and the peak no longer depends on the data
size (×1.00–1.07 with 10× the images).

:func:`fix_mmap_threshold` is called once when the plugin configures a run. It does nothing off
glibc, when ``MALLOC_MMAP_THRESHOLD_`` is set (the user chose), or when ``DNNSAFETY_KEEP_MALLOC`` is
set to a non-empty value (the opt-out). The cost: each batch-sized allocation is a fresh ``mmap``
(page faults of the batch's size, small next to a forward pass).

No torch and no pytest import here.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["fix_mmap_threshold", "THRESHOLD", "OPT_OUT_ENV"]

#: glibc's M_MMAP_THRESHOLD parameter of mallopt (malloc.h).
_M_MMAP_THRESHOLD = -3
#: The fixed threshold: glibc's own initial value.
THRESHOLD = 128 * 1024
#: Set to a non-empty value to leave the allocator alone.
OPT_OUT_ENV = "DNNSAFETY_KEEP_MALLOC"

_done: bool | None = None


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at :data:`THRESHOLD` (once per process); True when it was set."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT_ENV) or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it (musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = mallopt(_M_MMAP_THRESHOLD, THRESHOLD) == 1
    return _done
