"""The zip layout of a ``.pt2``: one reading for Python's :mod:`zipfile` and torch's reader.

:mod:`.pt2_archive` checks a ``.pt2`` through Python's :mod:`zipfile`; ``torch.export.load`` reads
it with torch's own reader (``torch._C.PyTorchFileReader``, caffe2's miniz-based
``PyTorchStreamReader``). The two find the central directory differently: miniz reads it at the
offset the end-of-central-directory record names (and a zip64 record where the zip64 locator
points), Python's :mod:`zipfile` reads it directly before the end record (and the zip64 record
directly before the locator), shifting every offset by the difference. A file with two central
directories, or data in front of its members, can therefore show Python a clean member list while
torch reads other members: the static check would pass and torch would load what it never saw.

:func:`zip_entries` admits only the layout that ``torch.export.save`` and :mod:`zipfile` write,
in which both readers cannot disagree: the members one after another from the file's first byte
(each a local header, its data and, with flag bit 3, a data descriptor), then the central
directory, exactly where the end record says, then (optionally) a zip64 end record and locator
that point at each other and agree with the end record, then the end record with no comment,
ending the file. Every central entry must match its local header (name, flags, method, and CRC
and sizes where the header carries them), name a printable member, and carry no
encryption, multiple disks or malformed extra field (names: printable ASCII, or UTF-8 with the
UTF-8 flag that torch sets). :func:`torch_reader_problem` then asks
torch's own reader, over the same bytes, which members it lists and where it finds each one.

Pure Python; torch is imported only by :func:`torch_reader_problem`. No pytest import.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

__all__ = ["ZipEntry", "ZipLayoutError", "duplicate_names", "torch_reader_problem", "zip_entries"]

_LOCAL, _CENTRAL, _END = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"
_END64, _LOCATOR64, _DESCRIPTOR = b"PK\x06\x06", b"PK\x06\x07", b"PK\x07\x08"
_END_SIZE, _LOCATOR_SIZE, _END64_SIZE = 22, 20, 56
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
#: Flag bits: 0 encrypted, 6 strong encryption, 13 masked local headers.
_ENCRYPTED = 0x0001 | 0x0040 | 0x2000
_DESCRIPTOR_BIT = 0x0008
_UTF8 = 0x0800


class ZipLayoutError(Exception):
    """The bytes are not a zip that Python's zipfile and torch's reader read the same way; says why."""


@dataclass(frozen=True)
class ZipEntry:
    """One member as its central directory entry describes it."""

    name: str
    offset: int  # of its local header
    flags: int
    method: int
    crc: int
    compressed: int
    size: int


def _unpack(fmt: str, data: bytes, offset: int, what: str) -> tuple[int, ...]:
    end = offset + struct.calcsize(fmt)
    if offset < 0 or end > len(data):
        raise ZipLayoutError(f"{what} at offset {offset} runs past the end of the file ({len(data)} bytes)")
    return struct.unpack_from(fmt, data, offset)


def _extras(extra: bytes, where: str) -> dict[int, bytes]:
    """The extra field's records by id; malformed or repeated records are refused."""
    found: dict[int, bytes] = {}
    position = 0
    while position < len(extra):
        if position + 4 > len(extra):
            raise ZipLayoutError(f"a malformed extra field in {where}")
        kind, length = struct.unpack_from("<HH", extra, position)
        if position + 4 + length > len(extra):
            raise ZipLayoutError(f"a malformed extra field in {where}")
        if kind in found:
            raise ZipLayoutError(f"two extra records of id {kind:#06x} in {where} (zip readers pick different ones)")
        found[kind] = extra[position + 4:position + 4 + length]
        position += 4 + length
    return found


def _end_record(data: bytes) -> tuple[int, int, int, int]:
    """``(entries, cd_size, cd_offset, cd_end)`` from the end record(s) at the file's end."""
    size = len(data)
    end = size - _END_SIZE
    if end < 0 or data[end:end + 4] != _END:
        last = data.rfind(_END, max(0, size - 65_557))
        where = f"at offset {last}, not at the end of the file" if last >= 0 else "nowhere"
        raise ZipLayoutError(f"an end-of-central-directory record {where}, or followed by a comment "
                             "(trailing data and comments can hide a second end record)")
    _, disk, cd_disk, on_disk, entries, cd_size, cd_offset, comment = _unpack("<4s4H2LH", data, end, "the end record")
    outer = data.rfind(_END, max(0, end - 65_535 - _END_SIZE), end)
    while outer >= 0:  # an earlier end record whose comment would reach the file's end hides this one in it
        if outer + _END_SIZE + struct.unpack_from("<H", data, outer + 20)[0] == len(data):
            raise ZipLayoutError(f"an end-of-central-directory record at offset {outer} followed by a comment that "
                                 f"holds a second end record (offset {end}): zip readers pick different ones")
        outer = data.rfind(_END, max(0, end - 65_535 - _END_SIZE), outer)
    if comment:
        raise ZipLayoutError("an archive comment after the end record")  # unreachable: the record ends the file
    if disk or cd_disk or on_disk != entries:
        raise ZipLayoutError("a multi-disk end-of-central-directory record")
    locator = end - _LOCATOR_SIZE
    if locator < 0 or data[locator:locator + 4] != _LOCATOR64:
        if _U16 in (entries,) or _U32 in (cd_size, cd_offset):
            raise ZipLayoutError("an end record that defers to a zip64 record the file does not have")
        return entries, cd_size, cd_offset, end
    _, z64_disk, z64_offset, disks = _unpack("<4sLQL", data, locator, "the zip64 locator")
    record = locator - _END64_SIZE
    if z64_disk or disks > 1:
        raise ZipLayoutError("a multi-disk zip64 locator")
    if z64_offset != record:
        raise ZipLayoutError(f"a zip64 locator naming a zip64 end record at offset {z64_offset}, not directly "
                             f"before it (offset {record}): torch would read one, Python's zipfile the other")
    sig, length, _, _, disk64, cd_disk64, on_disk64, entries64, cd_size64, cd_offset64 = _unpack(
        "<4sQ2H2L4Q", data, record, "the zip64 end record")
    if sig != _END64 or length != _END64_SIZE - 12:
        raise ZipLayoutError(f"no well-formed zip64 end record at offset {record}, where the zip64 locator points")
    if disk64 or cd_disk64 or on_disk64 != entries64:
        raise ZipLayoutError("a multi-disk zip64 end record")
    for short, long, sentinel, what in ((entries, entries64, _U16, "member count"),
                                        (cd_size, cd_size64, _U32, "central directory size"),
                                        (cd_offset, cd_offset64, _U32, "central directory offset")):
        if short not in (long, sentinel):
            raise ZipLayoutError(f"an end record and a zip64 end record that disagree on the {what} "
                                 f"({short} and {long}): torch and Python's zipfile would read different members")
    return entries64, cd_size64, cd_offset64, record


def _central(data: bytes, position: int, index: int) -> tuple[ZipEntry, int]:
    """The central directory entry at ``position`` and where the next one starts."""
    (sig, _, _, flags, method, _, _, crc, compressed, size, name_length, extra_length, comment_length,
     disk, _, _, offset) = _unpack("<4s4H2H3L5H2L", data, position, f"central directory entry {index}")
    if sig != _CENTRAL:
        raise ZipLayoutError(f"no central directory entry at offset {position} (entry {index}), where the "
                             "end record's central directory should continue")
    start = position + 46
    raw = data[start:start + name_length]
    extra = data[start + name_length:start + name_length + extra_length]
    if len(raw) != name_length or len(extra) != extra_length:
        raise ZipLayoutError(f"central directory entry {index} runs past the end of the file")
    try:  # Python's zipfile decodes UTF-8 only with flag bit 11, cp437 otherwise; torch keeps the bytes
        name = raw.decode("utf-8" if flags & _UTF8 else "ascii")
    except UnicodeDecodeError:
        name = ""
    if not name or not name.isprintable():
        raise ZipLayoutError(f"a member name {raw[:80]!r} that is not printable ASCII, or UTF-8 with the UTF-8 "
                             "flag (zip readers decode other names differently)")
    if flags & _ENCRYPTED:
        raise ZipLayoutError(f"an encrypted member {name!r}")
    if method not in (0, 8):
        raise ZipLayoutError(f"member {name!r} compressed with method {method} (only stored and deflated)")
    zip64 = _extras(extra, f"the central entry of {name!r}").get(1)
    wanted = [value == _U32 for value in (size, compressed, offset)]
    if disk == _U16:
        raise ZipLayoutError(f"member {name!r} on a zip64 disk number")
    if zip64 is not None or any(wanted):
        if zip64 is None or len(zip64) != 8 * sum(wanted):
            raise ZipLayoutError(f"member {name!r} with a zip64 extra field that does not match its sizes")
        values = iter(struct.unpack(f"<{sum(wanted)}Q", zip64))
        size, compressed, offset = (next(values) if flag else value
                                    for flag, value in zip(wanted, (size, compressed, offset)))
    if disk:
        raise ZipLayoutError(f"member {name!r} on disk {disk}")
    if method == 0 and compressed != size:
        raise ZipLayoutError(f"stored member {name!r} whose compressed and uncompressed sizes differ")
    entry = ZipEntry(name, offset, flags, method, crc, compressed, size)
    return entry, start + name_length + extra_length + comment_length


def _local(data: bytes, entry: ZipEntry, following: int) -> None:
    """Check the local header, data and descriptor of ``entry`` end exactly at ``following``."""
    sig, _, flags, method, _, _, crc, compressed, size, name_length, extra_length = _unpack(
        "<4s5H3L2H", data, entry.offset, f"the local header of {entry.name!r}")
    if sig != _LOCAL:
        raise ZipLayoutError(f"no local header at offset {entry.offset}, where the central directory puts "
                             f"member {entry.name!r}")
    start = entry.offset + 30
    name = data[start:start + name_length]
    if name != entry.name.encode("utf-8"):
        raise ZipLayoutError(f"member {entry.name!r} whose local header names {name[:80]!r}")
    if flags != entry.flags or method != entry.method:
        raise ZipLayoutError(f"member {entry.name!r} whose local header and central entry disagree on "
                             "flags or compression")
    extras = _extras(data[start + name_length:start + name_length + extra_length],
                     f"the local header of {entry.name!r}")
    if not flags & _DESCRIPTOR_BIT:
        local64 = extras.get(1, b"")
        sizes = struct.unpack_from("<2Q", local64) if len(local64) >= 16 else None
        if (crc != entry.crc
                or (compressed, size) != (entry.compressed, entry.size)
                and not (sizes and (compressed, size) == (_U32, _U32) and sizes == (entry.size, entry.compressed))):
            raise ZipLayoutError(f"member {entry.name!r} whose local header and central entry disagree on its "
                                 "CRC or sizes")
    end = start + name_length + extra_length + entry.compressed
    if end > following:
        raise ZipLayoutError(f"member {entry.name!r} whose data overlaps what follows it")
    if flags & _DESCRIPTOR_BIT and end != following:
        forms = ((b"", "<L2L"), (b"", "<L2Q"), (_DESCRIPTOR, "<L2L"), (_DESCRIPTOR, "<L2Q"))
        expected = (entry.crc, entry.compressed, entry.size)
        if not any(end + len(signature) + struct.calcsize(fmt) == following
                   and data[end:end + len(signature)] == signature
                   and struct.unpack_from(fmt, data, end + len(signature)) == expected
                   for signature, fmt in forms):
            raise ZipLayoutError(f"{following - end} bytes after member {entry.name!r} (offset {end}) that are "
                                 "not its data descriptor: data between members, which one zip reader can see "
                                 "as members and the other not")
    elif end != following:
        raise ZipLayoutError(f"{following - end} bytes of data after member {entry.name!r} (offset {end}), "
                             "between members, which one zip reader can see as members and the other not")


def zip_entries(data: bytes) -> list[ZipEntry]:
    """The members of ``data`` in file order; :class:`ZipLayoutError` unless every reader agrees on them."""
    count, cd_size, cd_offset, cd_end = _end_record(data)
    if cd_offset + cd_size != cd_end:
        python_reads = cd_end - cd_size
        raise ZipLayoutError(
            (f"a second central directory: the end record names one at offset {cd_offset}, Python's zipfile "
             f"reads the one directly before the end record, at offset {python_reads}; torch would read members "
             "Python's zipfile does not see") if 0 <= python_reads != cd_offset and data[python_reads:python_reads
                                                                                    + 4] == _CENTRAL
            else (f"a central directory at offset {cd_offset} ({cd_size} bytes) that does not end where the end "
                  f"record begins (offset {cd_end}); torch and Python's zipfile would read different members"))
    entries: list[ZipEntry] = []
    position = cd_offset
    for index in range(count):
        if position >= cd_end:
            raise ZipLayoutError(f"a central directory of {cd_size} bytes that holds fewer than its {count} entries")
        entry, position = _central(data, position, index)
        entries.append(entry)
    if position != cd_end:
        raise ZipLayoutError(f"{cd_end - position} bytes after the {count} central directory entries, before the "
                             "end record (a second central directory can hide there)")
    expected = 0
    for index, entry in enumerate(entries):
        if entry.offset != expected:
            what = "data before the first member" if index == 0 else "members out of order or data between them"
            raise ZipLayoutError(f"{what}: member {entry.name!r} at offset {entry.offset}, expected {expected}; "
                                 "one zip reader can see members there that the other does not")
        following = entries[index + 1].offset if index + 1 < len(entries) else cd_offset
        if following <= entry.offset:
            raise ZipLayoutError(f"members out of order: {entries[index + 1].name!r} at offset {following} "
                                 f"follows {entry.name!r} at offset {entry.offset}")
        _local(data, entry, following)
        expected = following
    if entries and expected != cd_offset or not entries and cd_offset != 0:
        raise ZipLayoutError(f"data before the central directory at offset {cd_offset}")
    return entries


def duplicate_names(entries: list[ZipEntry]) -> list[str]:
    """Member names held twice, compared as torch looks them up (ignoring case)."""
    seen: set[str] = set()
    twice: list[str] = []
    for entry in entries:
        key = entry.name.lower()
        if key in seen and entry.name not in twice:
            twice.append(entry.name)
        seen.add(key)
    return twice


def torch_reader_problem(data: bytes, entries: list[ZipEntry]) -> str | None:
    """Where torch's own reader, over ``data``, sees other members than ``entries``; None when it agrees.

    A file torch's reader refuses to open is read by ``torch.export.load``'s fallback with Python's
    zipfile — what ``entries`` describe — so that is agreement too.
    """
    import torch

    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        listed = reader.get_all_records()
    except RuntimeError:
        return None
    first = entries[0].name if entries else ""
    root = first.split("/", 1)[0] + "/" if "/" in first else ""
    expected = [entry.name[len(root):] for entry in entries if root and entry.name.startswith(root)]
    if sorted(listed) != sorted(expected):
        extra = sorted(set(listed) - set(expected))[:3]
        return (f"members that torch's reader lists and Python's zipfile does not ({extra})" if extra
                else "a member list that torch's reader and Python's zipfile read differently")
    offsets: dict[str, set[int]] = {}
    for entry in entries:
        offsets.setdefault(entry.name.lower(), set()).add(entry.offset)
    for name in listed:
        try:
            offset = reader.get_record_header_offset(name)
        except RuntimeError:
            return f"member {root + name!r}, which torch's reader lists but cannot find"
        if offset not in offsets.get((root + name).lower(), ()):
            return f"member {root + name!r}, which torch's reader finds at offset {offset}, Python's zipfile elsewhere"
    return None
