"""Baselines: compare each gate with the same gate of a stored run (like pytest-benchmark for speed).

A baseline is an evidence file (``schema`` = ``pytest-dnnsafety/1``), written by ``--dnnsafety-json``
or by ``--dnnsafety-save-baseline``. ``--dnnsafety-baseline=PATH`` loads it and every gate is compared
with its stored row (same node id and marker)::

    baseline = Baseline.load(path)                      # ConfigError naming the file and the fix
    comparison = compare(result, baseline.lookup(result.nodeid, result.marker), limit)

What is compared is the number the gate compares with its threshold (the bound when there is one,
else the value). *Worse* means lower for a ``>=`` gate and higher for a ``<=`` gate; a gate has
*regressed* when it is worse than the baseline by more than ``limit`` (the marker's ``max_drop`` for
a ``>=`` gate, ``max_rise`` for a ``<=`` gate). Without a limit nothing regresses, but the change is
still reported.

**What a comparison means.** A baseline measures a change of the thing a gate judges (its
*subject*) against an unchanged yardstick. For a gate that reads a model (neuron coverage,
reliability, ...), the model is the subject: a retrained model with a different digest is exactly
what the comparison is for, while a change of the evaluation data, scenarios, conditions or
operational profile moves the yardstick. For a gate that reads no model (scenario coverage), the
data itself is the subject and the declared condition domains (``dnnsafety_conditions``) are the
yardstick. When the yardstick changed — a role's content ``digest`` or a configured input file's
``sha256`` differs between the stored row and this run — the status is ``inputs-changed``: the
numbers are reported side by side but not judged, and the message names the role and both digests.
``inputs-changed`` wins over ``regressed``. A digest that is unknown on either side (an object the
plugin cannot fingerprint) is not a change; the comparison says so in ``unverified``.

Statuses: ``ok`` (unchanged, or worse within the limit, or worse without a limit), ``improved``,
``regressed``, ``missing`` (the baseline has no such gate, or no number to compare on either side),
``inputs-changed``. Nothing here imports torch or pytest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.results import GateResult, format_number
from pytest_dnnsafety.report.evidence import SCHEMA, write_evidence

__all__ = [
    "Baseline",
    "compare",
    "save_baseline",
    "subject_roles",
    "limit_name",
    "format_change",
    "BASELINE_STATUSES",
    "SUBJECT_ROLES",
    "YARDSTICK_SETTINGS",
]

#: The statuses of a comparison.
BASELINE_STATUSES = ("ok", "improved", "regressed", "missing", "inputs-changed")

#: Roles that hold what a gate judges when present: a change of their content is what a baseline measures.
SUBJECT_ROLES = ("model",)

#: Settings that are part of the yardstick whatever the gate: the declared condition domains.
YARDSTICK_SETTINGS = ("conditions",)

_FIX = ("Fix: point --dnnsafety-baseline (dnnsafety_baseline) at an evidence file written by "
        "--dnnsafety-save-baseline or --dnnsafety-json, or create one by running once with "
        "--dnnsafety-save-baseline={path}.")


def _fail(path: Path, problem: str) -> ConfigError:
    return ConfigError(f"dnnsafety baseline {path}: {problem}. " + _FIX.format(path=path))


def _check_evidence(data: Any) -> str | None:
    """Why ``data`` is not an evidence document of this schema, or None."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    schema = data.get("schema")
    if schema != SCHEMA:
        if isinstance(schema, str) and schema.startswith("pytest-dnnsafety/"):
            return f"schema {schema!r} is not the schema this version reads ({SCHEMA!r}); save the baseline again"
        return f"not a pytest-dnnsafety evidence file (schema {schema!r}, expected {SCHEMA!r})"
    gates = data.get("gates")
    if not isinstance(gates, list):
        return "the 'gates' list is missing"
    for i, row in enumerate(gates):
        if not isinstance(row, dict) or not isinstance(row.get("nodeid"), str) or not isinstance(
                row.get("marker"), str):
            return f"gates[{i}] is not a gate row (needs 'nodeid' and 'marker' strings)"
    env = data.get("environment", {})
    if not isinstance(env, dict):
        return "'environment' is not an object"
    return None


@dataclass
class Baseline:
    """A stored run: its gate rows by (node id, marker), and its environment."""

    path: Path
    gates: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    created: str | None = None

    @classmethod
    def from_evidence(cls, evidence: Mapping[str, Any], path: Path | str = "<memory>") -> "Baseline":
        problem = _check_evidence(evidence)
        if problem:
            raise _fail(Path(path), problem)
        gates: dict[tuple[str, str], dict[str, Any]] = {}
        for row in evidence["gates"]:
            gates.setdefault((row["nodeid"], row["marker"]), row)  # the first of duplicate markers
        return cls(Path(path), gates, dict(evidence.get("environment") or {}), evidence.get("created"))

    @classmethod
    def load(cls, path: Path) -> "Baseline":
        """Read an evidence file; a missing, unreadable or wrong-schema file raises ConfigError."""
        path = Path(path)
        if path.is_dir():
            raise _fail(path, "is a directory, not an evidence file")
        if not path.exists():
            raise _fail(path, "no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise _fail(path, f"cannot be read ({type(exc).__name__}: {exc})") from None
        from pytest_dnnsafety.files.parsing import TooDeep, loads_json

        try:
            data = loads_json(text)
        except TooDeep as exc:
            raise _fail(path, f"is not an evidence file: {exc}") from None
        except json.JSONDecodeError as exc:
            raise _fail(path, f"is not valid JSON ({exc})") from None
        return cls.from_evidence(data, path)

    def lookup(self, nodeid: str, marker: str) -> dict[str, Any] | None:
        """The stored gate row of ``marker`` on test ``nodeid``, or None."""
        return self.gates.get((nodeid, marker))

    def environment_changes(self, env: Mapping[str, Any]) -> list[str]:
        """Human lines for each configured input file (and the seed) that differ from the baseline's run.

        For the terminal: the per-gate comparison already checks what each gate read.
        """
        lines = []
        old_inputs = self.environment.get("inputs") or {}
        new_inputs = env.get("inputs") or {}
        for name in sorted(set(old_inputs) & set(new_inputs)):
            old = (old_inputs.get(name) or {}).get("digest")
            new = (new_inputs.get(name) or {}).get("digest")
            if isinstance(old, str) and isinstance(new, str) and old != new:
                lines.append(f"{name}: {_short(old)} → {_short(new)}")
        if "seed" in self.environment and "seed" in env and self.environment["seed"] != env["seed"]:
            lines.append(f"seed: {self.environment['seed']} → {env['seed']}")
        return lines


def save_baseline(path: Path, evidence: dict[str, Any]) -> Path:
    """Write ``evidence`` (as built by ``build_evidence``) to ``path`` atomically; the schema is the evidence's."""
    problem = _check_evidence(evidence)
    if problem:
        raise ValueError(f"not evidence to save as a baseline: {problem}")
    return write_evidence(Path(path), evidence)


# ------------------------------------------------------------------------------------ comparison


def _number(value: Any) -> float | None:
    """A finite float from a row value (evidence writes non-finite floats as strings), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _compared(row: Mapping[str, Any]) -> float | None:
    bound = _number(row.get("bound"))
    return bound if bound is not None else _number(row.get("value"))


def _short(digest: Any, n: int = 8) -> str:
    if not isinstance(digest, str):
        return str(digest)
    algo, sep, hexpart = digest.partition(":")
    if not sep:
        return digest[:n] + "…" if len(digest) > n else digest
    return f"{algo}:{hexpart[:n]}…" if len(hexpart) > n else digest


def limit_name(op: str) -> str:
    """The marker keyword that limits a regression of a gate with this comparison operator."""
    return "max_rise" if op == "<=" else "max_drop"


def format_change(change: float | None) -> str:
    """A signed change: ``+0.012``, ``−0.033`` (a real minus sign), ``0.000``."""
    if change is None:
        return "-"
    if change == 0:
        return format_number(0.0)
    return ("+" if change > 0 else "−") + format_number(abs(change))


def subject_roles(inputs: Mapping[str, Any]) -> set[str]:
    """The roles whose change a comparison measures: the model when the gate reads one, else all (its data)."""
    subject = {role for role in inputs if role in SUBJECT_ROLES}
    return subject or set(inputs)


def _input_changes(now: Mapping[str, Any], then: Mapping[str, Any],
                   subject: set[str]) -> tuple[list[dict[str, str]], list[str]]:
    """(changes of the yardstick, roles whose digest could not be checked)."""
    changes: list[dict[str, str]] = []
    unverified: list[str] = []
    for role in sorted(set(now) & set(then)):
        a, b = now.get(role), then.get(role)
        if not isinstance(a, dict) or not isinstance(b, dict):
            continue
        if role not in subject:
            new, old = a.get("digest"), b.get("digest")
            if isinstance(new, str) and isinstance(old, str):
                if new != old:
                    changes.append({"role": role, "baseline": old, "current": new})
            else:
                unverified.append(role)
        # The files behind the plugin's fixtures (origin.settings.<setting>.sha256).
        new_settings = ((a.get("origin") or {}).get("settings") or {})
        old_settings = ((b.get("origin") or {}).get("settings") or {})
        for setting in sorted(set(new_settings) & set(old_settings)):
            if role in subject and setting not in YARDSTICK_SETTINGS:
                continue
            new = (new_settings.get(setting) or {}).get("sha256")
            old = (old_settings.get(setting) or {}).get("sha256")
            if isinstance(new, str) and isinstance(old, str) and new != old:
                if not any(c["role"] == role and c.get("setting") is None for c in changes):
                    changes.append({"role": role, "setting": setting, "baseline": old, "current": new})
    return changes, unverified


def compare(result: GateResult, stored: dict[str, Any] | None, limit: float | None, *,
            subject: Iterable[str] | None = None) -> dict[str, Any]:
    """Compare one gate with its stored row; see the module docstring.

    Returns a JSON-able dict: ``status`` (one of :data:`BASELINE_STATUSES`), ``baseline_value`` and
    ``value`` (the compared numbers: bound if present, else value), ``change`` (``value −
    baseline_value``, signed, in the metric's units, or None), ``limit``, ``message`` (one human
    line), and for ``inputs-changed`` the list ``changed`` of ``{role, [setting], baseline, current}``.
    ``subject`` overrides which input roles are the thing judged (default :func:`subject_roles`).
    Call it after ``result.inputs`` is filled in.
    """
    if limit is not None:
        limit = float(limit)
        if not math.isfinite(limit) or limit < 0:
            raise ValueError(f"a baseline limit must be a finite number >= 0, got {limit!r}")
    name = limit_name(result.op)
    value = _number(result.compared)
    out: dict[str, Any] = {"status": "missing", "baseline_value": None, "value": value, "change": None,
                           "limit": limit, "message": ""}
    if stored is None:
        out["message"] = "no such gate in the baseline (new)"
        return out
    base = _compared(stored)
    out["baseline_value"] = base
    if base is None:
        out["message"] = f"the baseline has no number for this gate (it was {stored.get('status', 'not computed')})"
        return out
    if value is None:
        out["message"] = f"no number to compare with the baseline's {format_number(base)} ({result.status})"
        return out
    change = value - base
    tolerance = 1e-9 * max(1.0, abs(base), abs(value))
    if abs(change) <= tolerance:  # float noise, not a change
        change = 0.0
    out["change"] = change
    numbers = f"{format_number(base)} → {format_number(value)} ({format_change(change)}"
    roles = set(subject) if subject is not None else subject_roles(result.inputs or {})
    changes, unverified = _input_changes(result.inputs or {}, stored.get("inputs") or {}, roles)
    if unverified:
        out["unverified"] = unverified
    if changes:
        out["status"] = "inputs-changed"
        out["changed"] = changes
        what = "; ".join(
            f"{c['role']}{' (' + c['setting'] + ' file)' if c.get('setting') else ''} "
            f"{_short(c['baseline'])} → {_short(c['current'])}" for c in changes)
        out["message"] = f"{numbers}): inputs changed since the baseline, not compared: {what}"
        return out
    worse = -change if result.op == ">=" else change
    if limit is not None and worse > limit + tolerance:
        out["status"] = "regressed"
        out["message"] = f"{numbers}, {name} {limit:g}): regressed"
    elif worse < 0:
        out["status"] = "improved"
        out["message"] = f"{numbers}): improved"
    elif worse == 0:
        out["status"] = "ok"
        out["message"] = f"{numbers}): unchanged"
    elif limit is None:
        out["status"] = "ok"
        out["message"] = f"{numbers}, no {name} set): worse, not gated"
    else:
        out["status"] = "ok"
        out["message"] = f"{numbers}, {name} {limit:g}): within {name}"
    return out
