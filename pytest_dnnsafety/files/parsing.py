"""Checked opening and depth-safe parsing of the files the plugin reads (models, data, scenarios, baseline, ...).

**Opening.** Every file the plugin reads is opened by :func:`open_regular` (or checked by
:func:`not_regular` first): a path that is not a regular file — a FIFO (opening one for reading
blocks until a writer appears: the run would hang), a device (``/dev/zero`` never ends), a socket,
a directory, a symlink loop or a dangling symlink — is refused as :class:`NotRegularFile`, saying
what it is, before anything is read. Symlinks to regular files are followed. The path is checked
with :func:`os.stat` before it is opened, opened without blocking (``O_NONBLOCK``) and checked again
on the open descriptor (:func:`os.fstat`), so a file swapped for a FIFO in between cannot hang the run.

**Parsing.**

``json`` and ``tomllib`` recurse once per level of nested arrays and tables: a file nested a few
thousand levels deep (a "recursion bomb", a few kilobytes of ``[[[[...``) ends them in a raw
:class:`RecursionError` — an INTERNALERROR when it happens while pytest starts. A TOML file can
also build a deep table without any recursion in the parser (``[a.a.a.a...]``), and the recursion
then happens later, in whatever walks the value. :func:`loads_json` and :func:`loads_toml` turn
both into :class:`TooDeep`, a :class:`ValueError` like the parsers' own syntax errors, so every
caller reports it the way it reports a syntax error: naming the file.

No file the plugin reads needs more than a handful of levels (an evidence file about eight);
:data:`MAX_DEPTH` leaves ample room and stays far below Python's recursion limit.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import stat
from pathlib import Path
from typing import IO, Any

__all__ = [
    "MAX_DEPTH", "TooDeep", "check_depth", "loads_json", "loads_toml",
    "NotRegularFile", "not_regular", "open_regular", "open_text", "data_budget", "format_bytes", "read_bounded",
    "read_json_file",
]


# ------------------------------------------------------------------------------------ opening


class NotRegularFile(Exception):
    """``path`` is not a regular file (nor a symlink to one); ``what`` says what it is instead."""

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        self.path = Path(path)
        self.what = what
        super().__init__(f"{self.path} is {what}, not a regular file")


def _mode_kind(mode: int) -> str:
    """What a non-regular ``st_mode`` is, for a message."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe; reading it would wait for a writer forever)"
    if stat.S_ISCHR(mode):
        return "a character device (reading it may never end)"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return f"a special file (mode {stat.filemode(mode)})"


def not_regular(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` is a regular file or a symlink to one; otherwise what it is.

    Nothing is opened. Raises :class:`FileNotFoundError` when nothing is at ``path`` (a dangling
    symlink is described instead: it names its missing target).
    """
    try:
        st = os.stat(path)  # follows symlinks
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a dangling symlink (to {os.readlink(path)!r}, which does not exist)"
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop (too many levels of symbolic links)"
        raise
    if stat.S_ISREG(st.st_mode):
        return None
    kind = _mode_kind(st.st_mode)
    if os.path.islink(path):
        return f"a symlink to {os.path.realpath(path)}, {kind}"
    return kind


_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_BINARY", 0))


def open_regular(path: str | os.PathLike[str]) -> IO[bytes]:
    """``path`` opened for binary reading, or :class:`NotRegularFile` (see the module docstring).

    :class:`FileNotFoundError` (and other :class:`OSError`) pass through.
    """
    what = not_regular(path)
    if what is not None:
        raise NotRegularFile(path, what)
    fd = os.open(path, _OPEN_FLAGS)  # O_NONBLOCK: a FIFO swapped in after the check does not block
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, _mode_kind(mode) + " (it was replaced after it was checked)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_text(path: str | os.PathLike[str], encoding: str = "utf-8", newline: str | None = None) -> IO[str]:
    """:func:`open_regular` as text."""
    return io.TextIOWrapper(open_regular(path), encoding=encoding, newline=newline)


#: Bytes of array data one data file may hold at most (before half the machine's memory caps it).
DATA_BUDGET = 8 << 30


def data_budget() -> int:
    """The most bytes of array data read from one data file: :data:`DATA_BUDGET` or half the physical memory."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        memory = 0
    return min(DATA_BUDGET, memory // 2) if memory > 0 else DATA_BUDGET


def format_bytes(size: int) -> str:
    """``12,345 bytes`` or ``10.0 GiB (10,737,418,240 bytes)``."""
    if size < 1 << 20:
        return f"{size:,} bytes"
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit} ({size:,} bytes)"
    return f"{size:,} bytes"  # pragma: no cover


# ------------------------------------------------------------------------------------ parsing

#: The deepest nesting of arrays and tables (objects) accepted in a file the plugin reads.
MAX_DEPTH = 100


class TooDeep(ValueError):
    """A JSON or TOML document nested deeper than :data:`MAX_DEPTH` levels."""

    def __init__(self, limit: int = MAX_DEPTH) -> None:
        super().__init__(f"arrays or tables are nested more than {limit} levels deep (a file this plugin reads "
                         f"never needs that many; this one may be damaged or built to crash the parser)")


def check_depth(value: Any, limit: int = MAX_DEPTH) -> Any:
    """``value`` unchanged, or :class:`TooDeep` when its lists/tuples/dicts nest deeper than ``limit``.

    Iterative (an explicit stack): it never recurses itself.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if children is None:
            continue
        if depth > limit:
            raise TooDeep(limit)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return value


def loads_json(text: str | bytes, limit: int = MAX_DEPTH) -> Any:
    """``json.loads`` that raises :class:`TooDeep` (a ValueError) instead of RecursionError or a deep value."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(limit) from None
    return check_depth(value, limit)


def loads_toml(text: str, limit: int = MAX_DEPTH) -> dict[str, Any]:
    """``tomllib.loads`` (``tomli`` before Python 3.11) that raises :class:`TooDeep` instead of RecursionError.

    Syntax errors stay ``TOMLDecodeError`` (also a ValueError).
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise TooDeep(limit) from None
    return check_depth(value, limit)


# ------------------------------------------------------------------------------------ reading whole files


def read_bounded(path: Path, what: str, too_large_fix: str) -> bytes:
    """Every byte of ``path``, read once by :func:`open_regular`: a file larger than :func:`data_budget` is refused
    from its size before anything is read (``too_large_fix`` says what to do), as is one that grows past it while
    being read. Parse and fingerprint these bytes, so the evidence names exactly what was evaluated. Every problem
    is a :class:`~pytest_dnnsafety.errors.DataError` naming ``what`` and the path."""
    from pytest_dnnsafety.errors import DataError

    budget = data_budget()
    try:
        with open_regular(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > budget:
                raise DataError(f"{what}: {path} is {format_bytes(size)}, more than the read budget of "
                                f"{format_bytes(budget)} for one data file; refused before reading. Fix: {too_large_fix}")
            raw = handle.read(budget + 1)
    except FileNotFoundError:
        raise DataError(f"{what}: {path} does not exist. Fix: check the path (a setting's relative path is resolved "
                        "against the ini file's folder).") from None
    except NotRegularFile as exc:
        raise DataError(f"{what}: {exc}; refused before reading it. Fix: point the setting at a regular file.") from None
    if len(raw) > budget:
        raise DataError(f"{what}: {path} grew past the read budget of {format_bytes(budget)} while being read. "
                        "Fix: let whatever writes it finish first.")
    return raw


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_json_file(path: Path, what: str, too_large_fix: str) -> tuple[Any, str]:
    """``(the parsed value, "sha256:<hex> of the bytes parsed")`` of a JSON file read by :func:`read_bounded`:
    ``NaN`` and ``Infinity`` refused (not JSON numbers), nesting limited to :data:`MAX_DEPTH` levels; every
    problem a :class:`~pytest_dnnsafety.errors.DataError` naming ``what`` and the path."""
    from pytest_dnnsafety.errors import DataError

    raw = read_bounded(path, what, too_large_fix)
    try:
        try:
            value = json.loads(raw, parse_constant=_refuse_constant)
        except RecursionError:
            raise TooDeep(MAX_DEPTH) from None
        check_depth(value, MAX_DEPTH)
    except TooDeep as exc:
        raise DataError(f"{what}: {path}: {exc}.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{what}: {path} is not valid JSON ({exc}). Fix: write it with json.dump (NaN and "
                        "Infinity are not JSON numbers: give finite values).") from None
    return value, "sha256:" + hashlib.sha256(raw).hexdigest()
