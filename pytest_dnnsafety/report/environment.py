"""The run's environment for the evidence file: versions, device, seed, digests of inputs.

Versions are read from package metadata, so the controller of an xdist run needs no torch import.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

from pytest_dnnsafety._version import __version__

__all__ = ["environment", "file_digest", "package_version"]

#: Settings whose files are fingerprinted in the evidence.
DIGESTED = ("model", "data", "scenarios", "conditions", "operational_data")


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of a file (:func:`~pytest_dnnsafety.files.provenance.file_sha256`: opened as a regular
    file only, streamed in 1 MiB blocks)."""
    from pytest_dnnsafety.files.provenance import file_sha256

    return file_sha256(path)


def _digest_entry(path: Path) -> dict[str, Any]:
    """The ``digest`` of an input file, or None and why: not a regular file (a FIFO would block, a device never
    ends), or larger than the data budget (the loader refused it; hashing it would cost minutes for nothing)."""
    from pytest_dnnsafety.files.parsing import data_budget, format_bytes, not_regular

    what = not_regular(path)
    if what is not None:
        return {"digest": None, "digest_note": f"not hashed: {what}"}
    size, budget = path.stat().st_size, data_budget()
    if size > budget:
        return {"digest": None, "digest_note": f"not hashed: {format_bytes(size)} exceeds the data budget "
                                               f"{format_bytes(budget)}"}
    return {"digest": file_digest(path)}


def _torchrun() -> dict[str, Any]:
    """``world_size`` (torchrun ranks; 1 without torchrun) and the process group's ``backend`` (None without)."""
    from pytest_dnnsafety.runtime import torchrun as ranks

    return ranks.describe()


def _threads(settings: Any, workers: int) -> dict[str, Any]:
    """torch's intra-op threads: the plan this process applied, or (xdist controller) the plan for each worker."""
    from pytest_dnnsafety.runtime import threads

    try:
        applied = threads.applied(settings)
        if applied is not None:
            return {**applied.as_dict(), "torch_threads": threads.torch_threads(), "applied": True}
        planned = threads.plan(settings, busy=None, processes=max(1, workers))
    except Exception as exc:  # a bad setting already failed the run; still write evidence
        return {"error": str(exc)}
    return {**planned.as_dict(), "applied": False,
            "note": "planned for each worker without the load measurement; each worker applies its own plan"}


def environment(settings: Any, devices: Iterable[str], workers: int) -> dict[str, Any]:
    """A JSON-able description of what was evaluated, where and how."""
    inputs: dict[str, Any] = {}
    for name in DIGESTED:
        try:
            resolved = settings.get(name)
        except Exception as exc:  # a bad setting already failed the run; still write evidence
            inputs[name] = {"error": str(exc)}
            continue
        if resolved.value is None:
            continue
        entry: dict[str, Any] = {"spec": str(resolved.value), "source": resolved.source}
        if not resolved.is_factory:
            path = settings.path(resolved)
            entry["path"] = str(path)
            entry.update(_digest_entry(path) if path.exists() or path.is_symlink() else {"digest": None})
        inputs[name] = entry
    device_list = sorted(set(d for d in devices if d))
    return {
        "pytest_dnnsafety": __version__,
        "torch": package_version("torch"),
        "numpy": package_version("numpy"),
        "pytest": package_version("pytest"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": ",".join(device_list) if device_list else str(settings.get("device").value),
        "seed": settings.get("seed").value,
        "workers": workers,
        "threads": _threads(settings, workers),
        **_torchrun(),
        "inputs": inputs,
        "inputs_note": ("the configured input settings and their files' sha256 at the end of the run; what each "
                        "gate actually evaluated (fixture, origin, content digest at load) is in gates[].inputs"),
        "cwd": os.getcwd(),
    }
