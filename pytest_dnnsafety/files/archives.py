"""Inspect model and data archives before torch or NumPy reads them: nothing unpickles unchecked.

* :func:`check_torch_file` walks every pickle of a ``torch.save`` file opcode by opcode
  (:func:`pickletools.genops`; nothing is executed) and refuses any global outside the tensor
  allow-list of torch's ``weights_only`` loader (:class:`Refused`).
* :mod:`.pt2_archive` builds the ``.pt2`` check on these pieces.
* :func:`weights_only_forced` makes every ``torch.load`` inside it use the weights-only unpickler,
  also where torch itself passes ``weights_only=False`` (``torch.export.load``'s fallback), and
  turns off the plain ``pickle.loads`` of torch's ``.pt2`` reader (opaque object constants).
* :func:`verify_crcs` checks every zip member (torch's zip reader does not), and
  :func:`describe_file` says what a file that is not of the expected kind actually is
  (:class:`NotValid`), so a damaged file is never reported as "holds pickled objects".

Used by :mod:`.loading`; no pytest import.
"""

from __future__ import annotations

import _compat_pickle
import io
import os
import pickle
import pickletools
import re
import threading
import zipfile
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

from pytest_dnnsafety.files.parsing import open_regular

__all__ = [
    "NotValid", "Refused", "check_torch_file", "weights_only_forced", "verify_crcs",
    "describe_bytes", "describe_file", "describe_zip", "open_zip", "read_member", "zip_kind", "first_line", "listing",
]


# ------------------------------------------------------------------------------ file inspection


class NotValid(Exception):
    """The file is not a well-formed file of the expected kind; the message says what was found."""


class Refused(Exception):
    """A well-formed file that would make torch unpickle (or run) something outside the allow-list."""

    def __init__(self, member: str, names: Sequence[str], reason: str = "", verb: str = "unpickle") -> None:
        self.member = member
        self.names = list(names)
        self.reason = reason
        self.verb = verb  # "refused to <verb> <file>"
        super().__init__(self.listing())

    def listing(self) -> str:
        """What was refused, for "it holds …" in a message."""
        return self.reason or f"a pickle referencing {listing(self.names)} (in {self.member})"


#: Globals that torch's ``weights_only`` unpickler accepts by default (torch 2.13,
#: ``torch/_weights_only_unpickler.py:_get_allowed_globals``): tensor rebuilders, a few containers
#: and value types. Written out here, not read from torch, so ``add_safe_globals`` elsewhere in
#: the process cannot widen it.
_SAFE_GLOBALS = frozenset({
    "collections.OrderedDict", "collections.Counter",
    "torch.nn.parameter.Parameter", "torch.serialization._get_layout", "torch.Size", "torch.Tensor",
    "torch.device", "_codecs.encode", "builtins.bytearray", "builtins.set", "builtins.complex",
    "torch.storage.TypedStorage", "torch.storage.UntypedStorage",
    "torch.per_tensor_affine", "torch.per_tensor_symmetric", "torch.per_channel_affine",
    "torch.per_channel_symmetric", "torch.per_channel_affine_float_qparams",
    "torch._tensor._rebuild_from_type_v2",
    *(f"torch._utils._rebuild_{name}" for name in (
        "parameter", "parameter_with_state", "qtensor", "tensor", "tensor_v2", "tensor_v3",
        "sparse_tensor", "meta_tensor_no_storage", "nested_tensor", "wrapper_subclass",
        "device_tensor_from_numpy", "device_tensor_from_cpu_tensor")),
})
#: Legacy typed storage and tensor classes (``torch.FloatStorage``, ``torch.cuda.HalfTensor``, …).
_TYPED_CLASS_RE = re.compile(
    r"^torch\.(?:cuda\.)?(?:Float|Double|Half|BFloat16|Long|Int|Short|Char|Byte|Bool|ComplexFloat|"
    r"ComplexDouble|QUInt8|QInt8|QInt32|QUInt4x2|QUInt2x4)(?:Storage|Tensor)$"
)
_DTYPE_RE = re.compile(r"^torch\.([a-z][a-z0-9_]*)$")
_TORCH_MAGIC = 0x1950A86A20F9469CFC6C  # first pickle of a legacy (non-zip) torch.save file
_STRING_OPS = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
                         "SHORT_BINUNICODE", "BINUNICODE8"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_UNKNOWN = object()


def _is_safe_global(ref: str) -> bool:
    """Whether ``module.name`` is on the tensor allow-list."""
    if ref in _SAFE_GLOBALS or _TYPED_CLASS_RE.match(ref):
        return True
    match = _DTYPE_RE.match(ref)  # torch.float32, torch.bfloat16, torch.uint4, ...
    return bool(match) and isinstance(getattr(torch, match.group(1), None), torch.dtype)


def _global_name(module: str, name: str) -> str:
    """``module.name`` after Python 2 name fixes (the unpickler applies them for protocol < 3)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _scan_pickle(stream: IO[bytes]) -> tuple[list[str], bool]:
    """Walk one pickle from ``stream`` without executing it.

    Returns the globals it would import that are not on the allow-list (plus opcodes that reach
    objects the scan cannot name), and whether the pickle is the legacy torch.save magic number.
    Every way a pickle can reach a callable goes through GLOBAL, STACK_GLOBAL, INST or the
    copyreg extension registry (EXT1/2/4), so checking those covers REDUCE, NEWOBJ, OBJ and BUILD.
    Raises :class:`ValueError` for a malformed pickle.
    """
    refused: list[str] = []
    magic = False
    top: deque[Any] = deque(maxlen=2)  # the two topmost stack values, where a string push made them
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(stream):
        name = op.name
        if name in _STRING_OPS:
            top.append(arg.decode("utf-8", "replace") if isinstance(arg, bytes) else arg)
            continue
        if name in _GET_OPS:
            top.append(memo.get(arg, _UNKNOWN))
            continue
        if name == "MEMOIZE" or name in _PUT_OPS:  # store the top of the stack; the stack is unchanged
            memo[len(memo) if name == "MEMOIZE" else arg] = top[-1] if top else _UNKNOWN
            continue
        ref: str | None = None
        if name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            ref = _global_name(module, attr)
        elif name == "STACK_GLOBAL":
            operands = list(top)
            if len(operands) == 2 and all(isinstance(value, str) for value in operands):
                ref = f"{operands[0]}.{operands[1]}"
            else:
                refused.append("a STACK_GLOBAL whose module and name are not plain strings")
        elif name in ("EXT1", "EXT2", "EXT4"):
            refused.append(f"copyreg extension code {arg}")
        elif name in ("INT", "LONG", "LONG1", "LONG4") and arg == _TORCH_MAGIC:
            magic = True  # however it is spelled: the unpickler compares the value
        if ref is not None and not _is_safe_global(ref) and ref not in refused:
            refused.append(ref)
        top.clear()
        top.append(_UNKNOWN)
    return refused, magic


def _scan_pickles(data: bytes | IO[bytes], label: str) -> list[str]:
    """Refused globals in a pickle blob: one pickle, or the five of a legacy torch.save file.

    Raises :class:`NotValid` when the pickle is malformed or truncated.
    """
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        refused, magic = _scan_pickle(stream)
        if magic:  # legacy torch.save: magic, protocol, sys info, the object, the storage keys
            for _ in range(4):
                refused += [ref for ref in _scan_pickle(stream)[0] if ref not in refused]
    except ValueError as exc:
        raise NotValid(f"a damaged or truncated pickle ({label}: {exc})") from None
    return refused


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (torch's often start with a newline)."""
    return next((line.strip().rstrip(":") for line in str(exc).splitlines() if line.strip()), "")


def describe_bytes(head: bytes, size: int) -> str:
    """What a file starting with ``head`` looks like, for 'found …' in error messages."""
    if size == 0:
        return "an empty file (0 bytes)"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy array"
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        return "a Python pickle"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "a truncated or damaged zip archive (it has no readable end-of-archive record)"
    if head.startswith(b"\x89HDF"):
        return "an HDF5 file"
    if len(head) > 262 and head[257:262] == b"ustar":
        return "a tar archive"
    try:
        text = head[:64].decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    if text and all(char.isprintable() or char in "\r\n\t" for char in text):
        return f"text starting with {text.splitlines()[0][:40]!r}"
    return f"{size} bytes of unrecognised data starting with {head[:8]!r}"


def zip_kind(names: Sequence[str]) -> str | None:
    """Which archive format a zip's member names say it is, if any."""
    relative = [name.split("/", 1)[1] if "/" in name else name for name in names]
    if "archive_format" in relative or "serialized_exported_program.json" in relative:
        return "export"
    if any(name == "constants.pkl" or name.startswith("code/") for name in relative):
        return "torchscript"
    if "data.pkl" in relative:
        return "torch_save"
    if names and all(name.endswith(".npy") for name in names):
        return "npz"
    return None


_ZIP_KIND_NAMES = {
    "export": "a torch.export archive (a model)",
    "torchscript": "a TorchScript archive (a model)",
    "torch_save": "a torch.save archive",
    "npz": "a NumPy .npz archive",
}


class _OwnedZip(zipfile.ZipFile):
    """A :class:`zipfile.ZipFile` over a handle of :func:`open_regular` that closes the handle with it."""

    def __init__(self, handle: IO[bytes]) -> None:
        self._owned = handle
        super().__init__(handle)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._owned.close()


def open_zip(path: Path) -> zipfile.ZipFile:
    """Open ``path`` as a zip archive, or raise :class:`NotValid` saying what it is instead.

    The file is opened by :func:`~.parsing.open_regular` (a FIFO or a device raises
    :class:`~.parsing.NotRegularFile` instead of blocking).
    """
    handle = open_regular(path)
    try:
        return _OwnedZip(handle)
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError):
        handle.seek(0)
        head = handle.read(512)
        size = os.fstat(handle.fileno()).st_size
        handle.close()
        raise NotValid(describe_bytes(head, size)) from None


def describe_file(path: Path) -> str:
    """What ``path`` holds, for 'found …' in error messages."""
    with open_regular(path) as handle:
        head = handle.read(512)
        size = os.fstat(handle.fileno()).st_size
    if head.startswith(b"PK\x03\x04"):
        try:
            with open_zip(path) as archive:
                names = archive.namelist()
        except NotValid:
            return describe_bytes(head, size)
        return describe_zip(names)
    return describe_bytes(head, size)


def describe_zip(names: Sequence[str]) -> str:
    """What a zip archive with these member names is, for 'found …' in error messages."""
    kind = zip_kind(names)
    return _ZIP_KIND_NAMES[kind] if kind else f"a zip archive with members {list(names[:5])}"


def read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """A member's bytes, CRC-checked; a damaged member raises :class:`NotValid`."""
    try:
        with archive.open(info) as handle:
            return handle.read()
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError, NotImplementedError) as exc:
        raise NotValid(
            f"a damaged zip archive (member {info.filename!r}: {type(exc).__name__}: {exc})"
        ) from None


def verify_crcs(archive: zipfile.ZipFile) -> None:
    """Read every member once so that its CRC-32 is checked; a damaged one raises :class:`NotValid`.

    torch's own zip reader does not check CRCs: a flipped byte in a weight loads silently as a
    wrong weight. Members are streamed in 1 MiB chunks, so memory stays flat for large models.
    """
    for info in archive.infolist():
        if info.is_dir():
            continue
        try:
            with archive.open(info) as handle:
                while handle.read(1 << 20):
                    pass
        except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError, NotImplementedError) as exc:
            raise NotValid(
                f"a damaged zip archive (member {info.filename!r}: {type(exc).__name__}: {exc})"
            ) from None


def _scan_torch_save_zip(archive: zipfile.ZipFile, label: str) -> list[str]:
    """Refused globals in every ``.pkl`` member of a torch.save zip archive."""
    refused: list[str] = []
    for info in archive.infolist():  # duplicates included: each copy is scanned
        if info.filename.lower().endswith(".pkl"):  # torch's lookup of data.pkl ignores case
            for ref in _scan_pickles(read_member(archive, info), f"{label}{info.filename}"):
                if ref not in refused:
                    refused.append(f"{ref} (in {label}{info.filename})" if label else ref)
    return refused


def check_torch_file(path: Path, scan: bool) -> list[str]:
    """Check that ``path`` is a well-formed torch.save file; with ``scan``, its refused globals.

    Raises :class:`NotValid` for anything else (empty, random bytes, a damaged or truncated zip,
    a zip of another kind, a malformed pickle).
    """
    with open_regular(path) as handle:
        head = handle.read(512)
        size = os.fstat(handle.fileno()).st_size
    if head.startswith(b"PK\x03\x04"):
        with open_zip(path) as archive:
            kind = zip_kind(archive.namelist())
            if kind != "torch_save":
                raise NotValid(describe_file(path))
            refused = _scan_torch_save_zip(archive, "") if scan else []
            verify_crcs(archive)
            return refused
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        with open_regular(path) as handle:
            return _scan_pickles(handle, path.name) if scan else []
    if size:  # a protocol 0/1 pickle has no header: it is one if it parses as one
        try:
            with open_regular(path) as handle:
                refused = _scan_pickles(handle, path.name)
            return refused if scan else []
        except NotValid:
            pass
    raise NotValid(describe_bytes(head, size))


_FORCE_SAFE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_UNSAFE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
_ENV_LOCK = threading.Lock()


class _NoPlainUnpickling:
    """Stands in for :mod:`pickle` inside torch's ``.pt2`` reader: its ``loads`` refuses.

    ``torch/export/pt2_archive/_package.py`` reads opaque object constants with a bare
    ``pickle.loads``, which no environment variable restricts. :mod:`.pt2_archive` refuses such
    archives before loading; this is the second lock on the same door.
    """

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)

    @staticmethod
    def loads(*args: Any, **kwargs: Any) -> Any:
        raise pickle.UnpicklingError("pickle.loads of an opaque object constant is refused (the file would run "
                                     "code while loading)")


@contextmanager
def weights_only_forced() -> Iterator[None]:
    """Make every ``torch.load`` in the block use the weights-only unpickler.

    torch reads ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` on every call (``torch/serialization.py``) and
    then sets ``weights_only=True`` even where the caller passed ``weights_only=False`` — as
    ``torch.export.load``'s fallbacks do. ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is removed for the
    block (both set is an error in torch), and the ``.pt2`` reader's plain ``pickle.loads`` refuses
    (:class:`_NoPlainUnpickling`). Everything is restored afterwards; a lock keeps two threads
    from interleaving their save and restore.
    """
    try:
        from torch.export.pt2_archive import _package as package
    except ImportError:  # pragma: no cover - a torch without the .pt2 reader
        package = None
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in (_FORCE_SAFE, _FORCE_UNSAFE)}
        module = getattr(package, "pickle", None)
        os.environ[_FORCE_SAFE] = "1"
        os.environ.pop(_FORCE_UNSAFE, None)
        if module is not None:
            package.pickle = _NoPlainUnpickling()
        try:
            yield
        finally:
            if module is not None:
                package.pickle = module
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def listing(refs: Sequence[str]) -> str:
    """At most six refused globals, for a message."""
    return ", ".join(refs[:6]) + (f", … ({len(refs)} in all)" if len(refs) > 6 else "")
