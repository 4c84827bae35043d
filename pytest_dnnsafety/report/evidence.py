"""The JSON evidence file (``--dnnsafety-json=PATH``) for a safety case.

Layout (``schema`` = ``pytest-dnnsafety/1``)::

    {"schema": ..., "created": ISO-8601, "complete": bool, "environment": {...},
     "summary": {"passed", "failed", "error", "not-evaluated", "inconclusive", "lost", "total"},
     "lost": [nodeid of each test whose gates were lost, ...],
     "shared_passes": [{"model", "data", "layers", "images", "seconds", "images_per_second", "nodeid",
                        "marker", "worker"}, ...],
     "gates": [{"nodeid", "marker", "metric", "value", "bound", "threshold", "op", "passed",
                "status", "summary", "details", "seconds", "startup_seconds",
                "device", "inputs", "baseline"}, ...]}

``summary`` counts gates by status (``lost`` too); ``lost`` lists the tests. ``threshold`` is always
the marker's number (known at collection), also for gates that never ran. ``details.reason`` says
why a gate is not-evaluated or lost; an error has ``details.error_type`` and ``details.error``
(and ``details.traceback`` for an exception that is not the plugin's own). ``inputs`` maps each
role the gate read (``model``, ``data``, ``scenarios``, ...) to what it actually evaluated: the
fixture name, its origin (the plugin's fixture with the settings and the file's sha256 at load,
or a user fixture's file and line), the object's type and a content ``digest`` taken when the
fixture was set up; a ``DataLoader`` that could not be fingerprinted then gets the digest of the bytes of
every batch as it streamed (order-sensitive, ``digest_of`` says so, ``streamed`` holds the pass's batches,
rows, passes and order: :mod:`pytest_dnnsafety.data.fingerprint`). ``environment.inputs`` only lists the
configured settings and their files.

Non-finite floats are written as strings ("nan", "inf") so the file is strict JSON.

``shared_passes``: the session's shared forward passes (one per model, data and torchrun shard, reused by every
gate that reads outputs or activations), each timed as its own entry; a gate's ``seconds`` exclude the pass it
triggered (``details.shared_pass_seconds`` says how long that pass took).

``details.cost_estimate``: the cost the gate was estimated at before it measured (``estimated_seconds``, ``forwards``,
``seconds_per_forward`` from the probe, ``engine_seconds``, ``work``), to compare with its ``seconds``; a gate
refused over ``max_seconds`` is an error with ``details.refused`` and ``details.max_seconds``. ``details.sample``:
the ``sample=`` subsample the gate measured (``n``, ``of``, ``seed``, ``indices_sha256``, ``stratified_by``).

Lifecycle: at session start the path is checked (not a folder, writable) and an evidence file
left by an earlier run is removed, so a run that crashes before its first gate leaves no file rather than an
old one that looks current. While the run goes on, the file is rewritten as gates finish with
``"complete": false`` and the finished gates only (so a CI timeout or a SIGKILL leaves valid evidence of the
gates that finished); at the end it is written with every planned gate and ``"complete": true``. Every write is
atomic (a temporary file in the same folder, fsync'ed, then renamed); a failed write leaves no temporary file
behind (one a SIGKILL interrupted is removed when the next run starts).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import datetime, timezone
from glob import escape as glob_escape
from pathlib import Path
from typing import Any, Sequence

from pytest_dnnsafety.results import STATUSES, GateResult

__all__ = ["SCHEMA", "build_evidence", "write_evidence", "prepare_evidence_path"]

SCHEMA = "pytest-dnnsafety/1"


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def build_evidence(results: Sequence[GateResult], env: dict[str, Any], lost: Sequence[str] = (), *,
                   complete: bool = True, shared_passes: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The evidence dict; ``complete=False`` for a file written while the run goes on (its finished gates only),
    ``shared_passes`` the session's shared forward passes (one dict each, see the schema)."""
    summary = {status: sum(r.status == status for r in results) for status in STATUSES}
    summary["total"] = len(results)
    return _strict({
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "complete": bool(complete),
        "environment": env,
        "summary": summary,
        "lost": list(lost),
        "shared_passes": [dict(entry) for entry in shared_passes],
        "gates": [r.to_dict() for r in results],
    })


def prepare_evidence_path(path: Path) -> None:
    """Check at start that ``path`` can receive the evidence, and remove a stale file there.

    Raises :class:`IsADirectoryError` for a folder and :class:`OSError` when the folder cannot be
    created or written (probed with a temporary file, removed again).
    """
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
    os.close(handle)
    os.unlink(probe)
    if path.exists() or path.is_symlink():
        path.unlink()
    remove_stale_temporaries(path)


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary files of :func:`write_text_atomic` for ``path`` that a killed run left behind."""
    for stale in path.parent.glob(f".{glob_escape(path.name)}.*.tmp"):
        try:
            stale.unlink()
        except OSError:
            pass


def write_evidence(path: Path, evidence: dict[str, Any]) -> Path:
    """Write the evidence atomically (see :func:`write_text_atomic`)."""
    return write_text_atomic(path, json.dumps(evidence, indent=2, sort_keys=False, allow_nan=False) + "\n")


def write_text_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder, then a rename.

    A reader never sees half a file (the temporary file is fsync'ed before the rename, so a killed process or a
    lost machine leaves the old file or the new one), a failed write leaves no temporary file behind, and the file
    gets the usual mode (``0666 & ~umask``, not ``mkstemp``'s 0600): evidence is made to be shared.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())  # the data is on disk before the name points at it
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
