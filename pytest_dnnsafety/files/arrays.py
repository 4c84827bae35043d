"""Read ``.npy`` arrays and ``.npz`` archives without unpickling, sized from their headers before any data is read.

Used by :func:`~pytest_dnnsafety.files.loading.read_array_file`: an object dtype is refused
(:class:`~.archives.Refused`), an array whose header declares more bytes than the file (or member) holds
is :class:`~.archives.NotValid` (truncated), and one over the read budget (:func:`~.parsing.data_budget`)
is :class:`TooLarge` — a sparse 10 GiB ``.npy`` is refused in milliseconds. An ``.npz`` member's declared
uncompressed size is checked before anything is decompressed (a zip bomb is refused naming each member,
its size and its compression ratio), and members are decompressed as streams that :mod:`zipfile` stops
at the declared size. No pytest import.
"""

from __future__ import annotations

import io
import math
import os
import zipfile
import zlib
from pathlib import Path
from typing import IO, Any

from pytest_dnnsafety.files.archives import NotValid, Refused, describe_bytes, describe_file, describe_zip, open_zip
from pytest_dnnsafety.files.parsing import format_bytes, open_regular

__all__ = ["LARGE_FIX", "TooLarge", "npy_header", "read_npy", "read_npz"]


class TooLarge(Exception):
    """A data file (or .npz member) declares more array bytes than the read budget; the message says what."""


LARGE_FIX = ("Fix: data this large should stream instead of being read into memory at once: return a "
             "DataLoader from a 'package.module:load' factory (e.g. dnnsafety_data = 'mypkg.data:load'), or "
             "split the file; if the header is wrong, write the file again")


def npy_header(stream: IO[bytes]) -> tuple[tuple[int, ...], Any, bool]:
    """``(shape, dtype, fortran_order)`` from an .npy header (the stream is left after it); ValueError if malformed
    (a negative dimension included). Never reads past the header."""
    import numpy as np

    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        header = getattr(np.lib.format, "_read_array_header", None)  # 3.0: utf-8 field names
        if header is None:
            raise ValueError(f"unsupported .npy format version {version}")
        shape, fortran, dtype = header(stream, version)
    if any(not isinstance(dim, int) or dim < 0 for dim in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    return tuple(shape), dtype, bool(fortran)


def read_npy(stream: IO[bytes], label: str, size: int, budget: int) -> Any:
    """One array from an .npy stream of ``size`` bytes, never unpickling.

    The header is checked before any data is read: an object dtype is refused, and so is a
    shape × itemsize that the stream cannot hold (:class:`NotValid`) or that exceeds ``budget``
    (:class:`TooLarge`).
    """
    import numpy as np

    try:
        shape, dtype, _ = npy_header(stream)
    except (ValueError, EOFError, OSError, SyntaxError) as exc:
        raise NotValid(f"a damaged .npy header in {label} ({type(exc).__name__}: {exc})") from None
    if dtype.hasobject:
        raise Refused(label, [str(dtype)], f"an object array (dtype {dtype}) in {label}")
    declared = math.prod(shape) * dtype.itemsize
    held = size - stream.tell()
    described = f"its header declares shape {shape} of {dtype} ({format_bytes(declared)})"
    if declared > held:
        raise NotValid(f"a truncated or damaged .npy array in {label}: {described} but the file holds {held:,} bytes of data")
    if declared > budget:
        raise TooLarge(f"the array {label}: {described}, more than the read budget of {format_bytes(budget)} "
                        "for one data file; refused from its header, before reading any data")
    stream.seek(0)
    try:
        return np.lib.format.read_array(stream, allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:
        raise NotValid(f"a truncated or damaged .npy array in {label} ({type(exc).__name__}: {exc})") from None


def _zip_of(raw: bytes) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(io.BytesIO(raw))
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError):
        raise NotValid(describe_bytes(raw[:512], len(raw))) from None


#: The most a deflate stream expands (1032:1), with room for a tiny member's headers.
_DEFLATE_RATIO = 1032


def read_npz(path: Path, budget: int, raw: bytes | None = None) -> dict[str, Any]:
    """Every ``.npy`` member of an .npz archive, CRC-checked, keyed as :func:`numpy.load` keys them.

    Every member's declared size is checked before anything is decompressed: one beyond what its
    compression can expand to is a forged archive (:class:`NotValid`), a total over ``budget`` is
    :class:`TooLarge`, naming each member, its size and its compression ratio. Members are then
    decompressed as streams, which :mod:`zipfile` stops at the declared size. ``raw``: the file's bytes, read
    already (:func:`~.parsing.read_bounded`), parsed instead of opening ``path`` again.
    """
    if raw is None:
        with open_regular(path) as handle:
            head = handle.read(512)
            size = os.fstat(handle.fileno()).st_size
    else:
        head, size = raw[:512], len(raw)
    if not head.startswith(b"PK\x03\x04"):
        raise NotValid(describe_bytes(head, size))
    with (open_zip(path) if raw is None else _zip_of(raw)) as archive:
        members = [info for info in archive.infolist() if info.filename.endswith(".npy")]
        if not members:
            if raw is None:
                raise NotValid(describe_file(path))
            raise NotValid(describe_zip(archive.namelist()))

        def shown(info: zipfile.ZipInfo) -> str:
            ratio = f", {info.file_size / max(info.compress_size, 1):,.0f}:1" if info.compress_type else ""
            return (f"{info.filename!r} ({format_bytes(info.file_size)} from {info.compress_size:,} "
                    f"compressed bytes{ratio})")

        for info in members:
            if info.compress_type == zipfile.ZIP_DEFLATED and \
                    info.file_size > _DEFLATE_RATIO * info.compress_size + 1024:
                raise NotValid(f"a forged zip archive: member {shown(info)} declares more than deflate can expand "
                               f"to (at most {_DEFLATE_RATIO}:1)")
        total = sum(info.file_size for info in members)
        if total > budget:
            listed = ", ".join(shown(info) for info in members[:6]) + (", …" if len(members) > 6 else "")
            raise TooLarge(f"its members declare {format_bytes(total)} of arrays in all — {listed} — more than "
                            f"the read budget of {format_bytes(budget)} for one data file; refused before "
                            "decompressing anything (a zip bomb looks like this)")
        arrays = {}
        for info in members:
            try:
                with archive.open(info) as member:
                    arrays[info.filename[:-4]] = read_npy(member, repr(info.filename), info.file_size, budget)
                    while member.read(1 << 20):  # to the end, so that the CRC is checked
                        pass
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError) as exc:
                raise NotValid(
                    f"a damaged zip archive (member {info.filename!r}: {type(exc).__name__}: {exc})"
                ) from None
        return arrays
