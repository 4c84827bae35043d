"""Shared pieces of the hostile-file tests: a payload that writes a marker, and ways to plant it.

``WritesMarker`` is the stand-in for a malicious pickle (its ``__reduce__`` runs ``exec``);
``rewrite_zip`` copies a zip member by member with replacements and additions, which is how the
planted ``.pt2`` and torch.save variants are built from a genuine ``torch.export.save`` file.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from pytest_dnnsafety.settings import SETTINGS, Settings

__all__ = ["WritesMarker", "WithConstant", "make_settings", "torch_save_bytes", "rewrite_zip", "save_export"]


class WritesMarker:
    """Unpickling this runs code: ``exec`` writes ``marker``. The stand-in for a malicious payload."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


class WithConstant(nn.Module):
    """A model with a parameter, a buffer and a tensor constant: every payload kind of a .pt2."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("shift", torch.ones(3))
        self.scale = torch.tensor([1.0, 2.0, 3.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1)) * self.scale + self.shift


def make_settings(root: Path, **ini: Any) -> Settings:
    """Settings with ini options (short names) from ``root/pyproject.toml``, invoked from ``root``."""
    values = {SETTINGS[name].ini: value for name, value in ini.items()}
    return Settings(cli={}, ini=values.get, env={}, ini_file=root / "pyproject.toml", invocation_dir=root)


def torch_save_bytes(obj: Any, legacy: bool = False) -> bytes:
    """``torch.save(obj)`` as bytes (the zip format, or the legacy pickle-stream format)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=not legacy)
    return buffer.getvalue()


def rewrite_zip(src: Path, dst: Path, replace: Callable[[str, bytes], bytes] | None = None,
                add: dict[str, bytes] | list[tuple[str, bytes]] | None = None, at_root: bool = False) -> None:
    """Copy zip ``src`` to ``dst``, passing each member through ``replace`` and adding ``add``.

    ``add`` is a mapping or a list of pairs (a list may repeat a name: duplicate members). Added
    names go under the archive's top folder, or at the zip's root with ``at_root``.
    """
    with zipfile.ZipFile(src) as source, zipfile.ZipFile(dst, "w") as target:
        root = source.namelist()[0].split("/", 1)[0]
        for info in source.infolist():
            data = source.read(info.filename)
            target.writestr(info, replace(info.filename, data) if replace else data)
        for name, data in add.items() if isinstance(add, dict) else add or ():
            target.writestr(name if at_root else f"{root}/{name}", data)


def save_export(path: Path, module: nn.Module | None = None) -> None:
    module = (module or WithConstant()).eval()
    torch.export.save(torch.export.export(module, (torch.zeros(2, 2, 2),)), str(path))


#: A zip's members as (name, bytes), in order.
Members = list[tuple[str, bytes]]


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> Members:
    """The members of a genuine ``torch.export.save`` file (a parameter, a buffer, a constant)."""
    path = tmp_path_factory.mktemp("genuine") / "good.pt2"
    save_export(path)
    with zipfile.ZipFile(path) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]
