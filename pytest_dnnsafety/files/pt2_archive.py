"""Check a ``torch.export`` program (``.pt2``) before :func:`torch.export.load` reads it.

``torch.export.load`` (torch 2.13, ``torch/export/pt2_archive/_package.py`` and
``torch/_export/serde/serialize.py``) runs code from the file in these places, all decided by the
archive's own configs and names, never by what a member looks like:

* ``data/weights/<model>_weights_config.json``: an entry with ``use_pickle`` true is
  ``torch.load(..., weights_only=False)`` of ``data/weights/<path_name>``.
* ``data/constants/<model>_constants_config.json``: by the entry's ``path_name`` prefix,
  ``tensor_`` with ``use_pickle`` is ``torch.load``; ``custom_obj_`` is TorchScript's unpickler
  (``torch._C._pickle_load_obj``); ``opaque_obj_`` is plain :func:`pickle.loads` — of
  ``data/constants/<path_name>``, whatever its last component is called.
* ``data/weights/<model>.pt``, ``data/constants/<model>.pt`` (legacy) and
  ``data/sample_inputs/<model>.pt`` are ``torch.load`` ed; so are the root-level
  ``serialized_*.pt``/``.json`` members of the pre-2.8 format, which ``torch.export.load`` falls
  back to whenever the new reader raises ``RuntimeError`` (a member outside the top folder will do).
* ``models/<model>.json`` (and the legacy ``serialized_exported_program.json``) becomes Python
  in several ways: :mod:`.pt2_program` says which, and what it admits.
* ``data/aotinductor/``: native code, loaded and run.

The check reads the archive with Python's :mod:`zipfile`, torch with its own reader; the two see
the same members only because :mod:`.pt2_zip` first admits nothing but a layout they cannot read
differently, and asks torch's reader where it finds each member. The caller reads the file once
and loads from the bytes that were checked.

Member lookup is torch's (``PyTorchStreamReader``): the path is prefixed by the first member's
folder, matched case-insensitively and without normalisation (``../x`` is a literal name), and
which of duplicate names it returns is miniz's choice (the last, in torch 2.13).
:func:`check_export_archive` therefore scans every member that any lookup could return, refuses
custom and opaque objects and anything that is not a tensor pickle under the ``weights_only``
allow-list (any protocol 0–5, header or not), refuses config paths that are not plain relative
names, and refuses program JSON that :mod:`.pt2_program` finds code in. While the file then
loads, :func:`.archives.weights_only_forced` is a second lock on every pickle path.

Used by :mod:`.loading`; no pytest import.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import zipfile
import zlib
from collections import defaultdict
from pathlib import Path

from torch.export.pt2_archive import constants as pt2

from pytest_dnnsafety.files.archives import (
    _ZIP_KIND_NAMES,
    NotValid,
    Refused,
    _scan_pickles,
    _scan_torch_save_zip,
    describe_bytes,
    listing,
    read_member,
    verify_crcs,
    zip_kind,
)
from pytest_dnnsafety.files.pt2_program import program_problem
from pytest_dnnsafety.files.pt2_zip import (
    ZipLayoutError,
    duplicate_names,
    torch_reader_problem,
    zip_entries,
)

__all__ = ["check_export_archive"]

#: Root-level members of the pre-2.8 archive format, read by ``torch.export.load``'s fallback.
_LEGACY_PICKLED = ("serialized_state_dict.pt", "serialized_state_dict.json", "serialized_constants.pt",
                   "serialized_constants.json", "serialized_example_inputs.pt")
_LEGACY_PROGRAM = "serialized_exported_program.json"
#: A config ``path_name`` as ``torch.export.save`` writes it (``weight_0``, ``tensor_3``): plain
#: relative components, no ``..``, no absolute path, no backslash or control character.
_PLAIN_PATH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*(?:/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*")


class _Records:
    """The members of a ``.pt2`` zip as torch's ``PyTorchStreamReader`` looks them up."""

    def __init__(self, archive: zipfile.ZipFile) -> None:
        self.archive = archive
        self.infos = archive.infolist()
        first = self.infos[0].filename if self.infos else ""
        self.root = first.split("/", 1)[0] + "/" if "/" in first else ""
        self.by_lower: dict[str, list[zipfile.ZipInfo]] = defaultdict(list)
        for info in self.infos:
            self.by_lower[info.filename.lower()].append(info)
        # get_all_records(): names under the first member's folder (case-sensitive), folder removed
        self.listed = [info.filename[len(self.root):] for info in self.infos
                       if self.root and info.filename.startswith(self.root)]

    def lookup(self, name: str) -> list[zipfile.ZipInfo]:
        """Every member torch's case-insensitive lookup of ``name`` could return (duplicates too)."""
        return list(self.by_lower.get((self.root + name).lower(), ())) if self.root else []


def _scan_loaded(records: _Records, info: zipfile.ZipInfo, why: str) -> None:
    """Refuse a member that torch unpickles unless it is a tensor pickle under the allow-list.

    Decided from the bytes alone: a ``torch.save`` zip (every ``.pkl`` inside scanned), a legacy
    tar file (refused), or a pickle stream of any protocol — one that does not parse is refused,
    because an unpickler runs every opcode before the one it cannot read.
    """
    data = read_member(records.archive, info)
    label = info.filename
    if not data:
        return  # torch.load of nothing fails before unpickling; an empty sample-inputs member is "none"
    if data.startswith(b"PK\x03\x04"):
        try:
            nested = zipfile.ZipFile(io.BytesIO(data))
        except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError) as exc:
            raise NotValid(f"a torch.export archive whose member {label!r} ({why}) is a damaged zip "
                           f"archive ({exc})") from None
        with nested:
            refused = _scan_torch_save_zip(nested, f"{label}:")
        if refused:
            raise Refused(label, refused, f"a pickle referencing {listing(refused)} ({why})")
        return
    if _is_tar(data):
        raise Refused(label, [label], f"a legacy tar-format torch file ({label}, {why}), whose pickles "
                                      "torch.load reads")
    try:
        refused = _scan_pickles(data, label)
    except NotValid as exc:
        raise Refused(label, [label], f"bytes that torch would unpickle but that are not a well-formed "
                                      f"pickle ({label}, {why}: {str(exc).split(': ', 1)[-1]}") from None
    if refused:
        raise Refused(label, refused, f"a pickle referencing {listing(refused)} (in {label}, {why})")


def _is_tar(data: bytes) -> bool:
    """Whether ``tarfile`` reads ``data`` (torch.load tries the legacy tar format first)."""
    if len(data) > 262 and data[257:262] == b"ustar":
        return True
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:"):
            return True
    except (tarfile.TarError, EOFError, ValueError, OSError):
        return False


def _config_entries(records: _Records, name: str) -> list[tuple[str, str, bool]]:
    """``(fqn, path_name, use_pickle)`` of every entry in every member that ``name`` resolves to."""
    entries: list[tuple[str, str, bool]] = []
    for info in records.lookup(name):
        try:
            document = json.loads(read_member(records.archive, info).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise NotValid(f"a torch.export archive whose {info.filename!r} is not valid JSON") from None
        config = document.get("config") if isinstance(document, dict) else None
        if not isinstance(config, dict):
            raise NotValid(f"a torch.export archive whose {info.filename!r} has no \"config\" mapping")
        for fqn, entry in config.items():
            path_name = entry.get("path_name") if isinstance(entry, dict) else None
            use_pickle = entry.get("use_pickle") if isinstance(entry, dict) else None
            if not isinstance(path_name, str) or not isinstance(use_pickle, bool):
                raise NotValid(f"a torch.export archive whose {info.filename!r} entry {fqn!r} lacks a string "
                               "\"path_name\" or a true/false \"use_pickle\"")
            if not _PLAIN_PATH.fullmatch(path_name):
                raise NotValid(f"a torch.export archive whose {info.filename!r} entry {fqn!r} has path_name "
                               f"{path_name!r}, which is not a plain name inside the archive (torch.export.save "
                               "writes names such as 'weight_0')")
            entries.append((str(fqn), path_name, use_pickle))
    return entries


def _pickled_member(records: _Records, folder: str, fqn: str, path_name: str, why: str) -> None:
    """Scan the member(s) a pickled payload entry names; one that does not exist is refused."""
    infos = records.lookup(folder + path_name)
    if not infos:
        raise NotValid(f"a torch.export archive whose config entry {fqn!r} names member "
                       f"{records.root + folder + path_name!r}, which the archive does not hold")
    for info in infos:
        _scan_loaded(records, info, why)


def _check_model(records: _Records, model: str, raw: set[str]) -> None:
    """Everything ``_load_exported_programs`` reads for one model name."""
    for name in (f"{pt2.WEIGHTS_DIR}{model}.pt", f"{pt2.CONSTANTS_DIR}{model}.pt",
                 pt2.SAMPLE_INPUTS_FILENAME_FORMAT.format(model)):
        for info in records.lookup(name):
            _scan_loaded(records, info, "torch.load reads it")
    for fqn, path_name, use_pickle in _config_entries(records, pt2.WEIGHTS_CONFIG_FILENAME_FORMAT.format(model)):
        if use_pickle:
            _pickled_member(records, pt2.WEIGHTS_DIR, fqn, path_name, f"weight {fqn!r} with use_pickle")
        else:
            raw.add(records.root + pt2.WEIGHTS_DIR + path_name)
    for fqn, path_name, use_pickle in _config_entries(records, pt2.CONSTANTS_CONFIG_FILENAME_FORMAT.format(model)):
        member = records.root + pt2.CONSTANTS_DIR + path_name
        if path_name.startswith(pt2.CUSTOM_OBJ_FILENAME_PREFIX):
            raise Refused(member, [member], f"a custom object constant {fqn!r} ({member}), which torch "
                                            "unpickles with TorchScript's unpickler, not as a tensor")
        if path_name.startswith(pt2.OPAQUE_OBJ_FILENAME_PREFIX):
            raise Refused(member, [member], f"an opaque object constant {fqn!r} ({member}), which torch "
                                            "unpickles with pickle.loads without any restriction")
        if not path_name.startswith(pt2.TENSOR_CONSTANT_FILENAME_PREFIX):
            raise NotValid(f"a torch.export archive whose constants config entry {fqn!r} has path_name "
                           f"{path_name!r}, a kind of constant torch does not load")
        if use_pickle:
            _pickled_member(records, pt2.CONSTANTS_DIR, fqn, path_name, f"constant {fqn!r} with use_pickle")
        else:
            raw.add(member)
    for info in records.lookup(pt2.MODELS_FILENAME_FORMAT.format(model)):
        _check_program_json(records, info)


def check_export_archive(data: bytes, path: Path) -> None:
    """Refuse a ``.pt2`` archive unless loading it can unpickle only tensors and run no code.

    ``data`` is the file's bytes, read once: the caller loads from the same bytes (``path`` only
    names the file). First the zip layout (:mod:`.pt2_zip`): Python's zipfile, which this check
    reads with, and torch's reader must see the same members at the same places. Raises
    :class:`NotValid` for a file that is not a well-formed torch.export archive and
    :class:`Refused` for one whose layout two zip readers read differently, holding AOTInductor
    code, custom/opaque object constants, a pickle referencing globals outside the allow-list,
    code or unbounded arithmetic in its program JSON, or two members of one name; all name the
    member or what is wrong.
    """
    try:
        archive: zipfile.ZipFile | None = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError):
        archive = None
    try:
        entries = zip_entries(data)
    except ZipLayoutError as exc:
        if archive is None:  # not a zip to either reader: say what it is
            raise NotValid(describe_bytes(data[:512], len(data))) from None
        raise Refused(path.name, [], f"a zip layout that torch's reader and Python's zipfile read differently "
                                     f"({exc})", verb="load") from None
    if archive is None:
        raise NotValid(describe_bytes(data[:512], len(data)))
    with archive:
        names = archive.namelist()
        kind = zip_kind(names)
        if kind != "export":
            raise NotValid(_ZIP_KIND_NAMES[kind] if kind else f"a zip archive with members {names[:5]}")
        if names != [entry.name for entry in entries]:
            raise NotValid("a damaged zip archive (Python's zipfile lists other members than its central directory)")
        verify_crcs(archive)
        problem = torch_reader_problem(data, entries)
        if problem:
            raise Refused(path.name, [], f"a zip archive that torch's reader reads differently from Python's "
                                         f"zipfile: {problem}", verb="load")
        records = _Records(archive)
        native = [name for name in names
                  if (name.split("/", 1)[1] if "/" in name else name).lower().startswith(pt2.AOTINDUCTOR_DIR)]
        if native:
            raise Refused(native[0], native, f"AOTInductor compiled code ({native[0]}), which torch.export.load "
                                              "would load and run as native code", verb="load")
        raw: set[str] = set()
        prefix, suffix = pt2.MODELS_FILENAME_FORMAT.split("{}")
        for name in records.listed:  # model names exactly as _load_exported_programs derives them
            if name.startswith(pt2.MODELS_DIR):
                _check_model(records, name[len(prefix):-len(suffix)], raw)
        for info in records.infos:  # the pre-2.8 format that torch.export.load falls back to
            if info.filename in _LEGACY_PICKLED:
                _scan_loaded(records, info, "torch.export.load's fallback reader torch.loads it")
            elif info.filename == _LEGACY_PROGRAM:
                _check_program_json(records, info)
        for info in records.infos:  # anything else that is a pickle: never read by torch, still refused
            if info.filename not in raw:
                _scan_stray(records, info)
    twice = duplicate_names(entries)  # after the scans, which name what a hostile copy holds
    if twice:
        raise Refused(twice[0], twice, f"two members named {twice[0]!r} (compared ignoring case, as torch looks "
                                       "them up), of which torch's reader and Python's zipfile can pick different "
                                       "ones", verb="load")


def _scan_stray(records: _Records, info: zipfile.ZipInfo) -> None:
    """A member no config or name makes torch read: refused only if it is a pickle with bad globals."""
    data = read_member(records.archive, info)
    if data.startswith(b"PK\x03\x04") or data[:1] == b"\x80":
        _scan_loaded(records, info, "a pickle in the archive")
        return
    try:
        refused = _scan_pickles(data, info.filename) if data else []
    except NotValid:
        return  # not a pickle: JSON, text, raw tensor bytes
    if refused:
        raise Refused(info.filename, refused, f"a pickle referencing {listing(refused)} (in {info.filename})")


def _check_program_json(records: _Records, info: zipfile.ZipInfo) -> None:
    """Refuse a program JSON that holds code: see :func:`.pt2_program.program_problem`."""
    try:
        program = json.loads(read_member(records.archive, info))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise NotValid(f"a torch.export archive whose {info.filename!r} is not valid JSON") from None
    problem = program_problem(program)
    if problem:
        raise Refused(info.filename, [info.filename], f"{problem} in {info.filename}", verb="load")
