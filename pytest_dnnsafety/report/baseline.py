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

**Comparable sets.** A gate whose value is measured on a set that can change from run to run declares
it in its details as ``details["comparable_set"] = {"what": ..., "items": [...]}`` (e.g. the DeepInspect
gates with ``unpredicted="exclude"``: the classes never predicted, left out of every pair). Numbers
measured on different sets are not comparable, and a model that stops predicting some classes must never
read as "improved": a change of the set is ``regressed``, whatever the numbers and the limit (a passed
gate then fails); the comparison's ``comparable_set`` holds ``{what, baseline, current}``.

**What cannot be verified is said so.** ``unverifiable`` — never ``ok`` nor ``improved`` — when the stored
row does not record an input this gate read outside its subject (its ``inputs`` removed: the yardstick
cannot be checked; the roles are in ``unverifiable``), when the stored number is not a finite number
(``nan``, ``inf``, ``-inf``, null, or garbage: a bound that is not finite never falls back to the value),
or when this gate declares a comparable set the stored row does not record. The message says what could
not be checked and that ``max_drop``/``max_rise`` is not applied. A baseline file that holds one gate
(node id, marker) twice is refused when it is loaded (a ConfigError naming the file and the gate).

Statuses (:data:`BASELINE_STATUSES`): ``ok`` (unchanged, or worse within the limit, or worse without a
limit), ``improved``, ``regressed``, ``missing`` (the baseline has no such gate, or this run's gate has no
number), ``inputs-changed``, ``unverifiable``. ``inputs-changed`` wins over a changed comparable set,
which wins over ``unverifiable``. Nothing here imports torch or pytest.
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
BASELINE_STATUSES = ("ok", "improved", "regressed", "missing", "inputs-changed", "unverifiable")

#: Roles that hold what a gate judges when present: a change of their content is what a baseline measures.
SUBJECT_ROLES = ("model",)

#: Settings that are part of the yardstick whatever the gate: the declared condition domains.
YARDSTICK_SETTINGS = ("conditions",)

_FIX = ("Fix: point --dnnsafety-baseline (dnnsafety_baseline) at an evidence file written by "
        "--dnnsafety-save-baseline or --dnnsafety-json, or create one by running once with "
        "--dnnsafety-save-baseline={path}.")


_DUPLICATE_FIX = ("Fix: keep one row of each gate in the file, or save the baseline again "
                  "(--dnnsafety-save-baseline={path}); a test that carries the same gate marker twice cannot be "
                  "compared with a baseline: give each gate of a kind its own test (e.g. with parametrize).")


def _fail(path: Path, problem: str, fix: str = _FIX) -> ConfigError:
    return ConfigError(f"dnnsafety baseline {path}: {problem}. " + fix.format(path=path))


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
    if data.get("complete") is False:
        return ("its run did not finish (\"complete\": false: it was killed or timed out, and the file holds only "
                "the gates that finished); save the baseline from a run that finished")
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
        first: dict[tuple[str, str], int] = {}
        for i, row in enumerate(evidence["gates"]):
            key = (row["nodeid"], row["marker"])
            if key in gates:  # which stored row a gate compares with would be a guess
                raise _fail(Path(path), f"gate {row['marker']} of test {row['nodeid']} is stored twice (gates"
                            f"[{first[key]}] and gates[{i}]), so which row it is compared with is ambiguous",
                            fix=_DUPLICATE_FIX)
            gates[key], first[key] = row, i
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


def _compared(row: Mapping[str, Any]) -> tuple[float | None, str | None]:
    """(the stored number a gate is compared with, None) or (None, why the row holds no such number).

    The bound when the row has one (not null), else the value: a bound that is not a finite number never falls
    back to the value (an estimate the gate did not compare)."""
    key = "bound" if row.get("bound") is not None else "value"
    number = _number(row.get(key))
    if number is not None:
        return number, None
    return None, f"{key} {row.get(key)!r} (stored status {row.get('status', 'unknown')!r}) is not a finite number"


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


def _yardstick_roles(now: Mapping[str, Any], subject: set[str]) -> list[str]:
    """The roles of this run whose record a comparison needs: every role outside the subject, and a subject role
    whose plugin fixture read a yardstick setting's file (e.g. the declared condition domains)."""
    roles = []
    for role, record in now.items():
        settings = ((record.get("origin") or {}).get("settings") or {}) if isinstance(record, dict) else {}
        if role not in subject or any(setting in YARDSTICK_SETTINGS for setting in settings):
            roles.append(role)
    return sorted(roles)


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


def _comparable_set(details: Any) -> tuple[str, list[str]] | None:
    """A gate's declared comparable set (``details["comparable_set"]``: ``{"what", "items"}``), else None."""
    declared = details.get("comparable_set") if isinstance(details, Mapping) else None
    if not isinstance(declared, Mapping) or not isinstance(declared.get("items"), list):
        return None
    return str(declared.get("what") or "comparable set"), list(dict.fromkeys(map(str, declared["items"])))


def _set_text(items: list[str], n: int = 12) -> str:
    return ", ".join(items[:n]) + (f", … ({len(items) - n} more)" if len(items) > n else "") if items else "none"


def _set_change(result: GateResult, stored: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(the change of the gate's comparable set, None) when it changed; (None, why it cannot be checked) when the
    stored row does not record it; (None, None) when unchanged or not declared by this gate."""
    now = _comparable_set(result.details)
    if now is None:
        return None, None
    what, items = now
    then = _comparable_set(stored.get("details"))
    if then is None:
        return None, f"the baseline row does not record the {what} (now {_set_text(items)})"
    if set(then[1]) == set(items):
        return None, None
    return {"what": what, "baseline": then[1], "current": items}, None


def compare(result: GateResult, stored: dict[str, Any] | None, limit: float | None, *,
            subject: Iterable[str] | None = None) -> dict[str, Any]:
    """Compare one gate with its stored row; see the module docstring.

    Returns a JSON-able dict: ``status`` (one of :data:`BASELINE_STATUSES`), ``baseline_value`` and
    ``value`` (the compared numbers: bound if present, else value), ``change`` (``value −
    baseline_value``, signed, in the metric's units, or None), ``limit``, ``message`` (one human
    line), for ``inputs-changed`` the list ``changed`` of ``{role, [setting], baseline, current}``, for a
    changed comparable set ``comparable_set`` (``{what, baseline, current}``), and for ``unverifiable`` the
    list ``unverifiable`` of the roles the stored row does not record (when that is the reason).
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
    base, no_number = _compared(stored)
    out["baseline_value"] = base
    change = None
    if base is not None and value is not None:
        change = value - base
        if abs(change) <= 1e-9 * max(1.0, abs(base), abs(value)):  # float noise, not a change
            change = 0.0
    out["change"] = change
    numbers = f"{format_number(base)} → {format_number(value)} ({format_change(change)}"  # closed below
    prefix = f"{numbers}): " if change is not None else ""
    unapplied = f"{name} {limit:g} is not applied" if limit is not None else f"no {name} set"
    now_inputs = result.inputs or {}
    then_inputs = stored.get("inputs")
    then_inputs = then_inputs if isinstance(then_inputs, dict) else {}
    roles = set(subject) if subject is not None else subject_roles(now_inputs)
    changes, unverified = _input_changes(now_inputs, then_inputs, roles)
    if unverified:
        out["unverified"] = unverified
    if changes:
        out["status"] = "inputs-changed"
        out["changed"] = changes
        what = "; ".join(
            f"{c['role']}{' (' + c['setting'] + ' file)' if c.get('setting') else ''} "
            f"{_short(c['baseline'])} → {_short(c['current'])}" for c in changes)
        out["message"] = f"{prefix}inputs changed since the baseline, not compared: {what}"
        return out
    set_change, set_unknown = _set_change(result, stored)
    if set_change is not None:  # values on other classes (or sets) are not comparable: never "improved"
        out["status"] = "regressed"
        out["comparable_set"] = set_change
        out["message"] = (f"{prefix}the {set_change['what']} changed since the baseline: now "
                          f"{_set_text(set_change['current'])}, was {_set_text(set_change['baseline'])}; the value "
                          "is measured on another set, so this is a regression whatever the number")
        return out
    missing_roles = [role for role in _yardstick_roles(now_inputs, roles) if role not in then_inputs]
    why = None
    if missing_roles:
        out["unverifiable"] = missing_roles
        why = (f"the baseline row does not record the input(s) {', '.join(missing_roles)} this gate read, so "
               "whether they changed since the baseline cannot be verified")
    elif no_number is not None:
        why = f"the baseline row's {no_number}, so there is no number to compare with"
    elif set_unknown is not None:
        why = f"{set_unknown}, so whether it changed cannot be verified"
    if why is not None:
        out["status"] = "unverifiable"
        out["message"] = (f"{prefix}{why}; {unapplied}. Fix: save the baseline again "
                          "(--dnnsafety-save-baseline) from a run of this version, and do not edit its rows")
        return out
    if change is None:
        out["message"] = f"no number to compare with the baseline's {format_number(base)} ({result.status})"
        return out
    worse = -change if result.op == ">=" else change
    tolerance = 1e-9 * max(1.0, abs(base), abs(value))
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
