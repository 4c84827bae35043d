"""The gate mechanism: definitions, the registry, and validation of markers at collection.

A gate is ``@pytest.mark.<marker>(threshold, **options)`` on a test. Each marker has one
:class:`GateDef` saying which metric it measures, how the value is compared (``>=`` or ``<=``),
which options it takes (typed and range-checked :class:`Param`) and which fixtures it reads (a
keyword may name another fixture, e.g. ``scenarios="night_scenarios"``). Gate definitions are
collected per run in a :class:`GateRegistry` through the ``pytest_dnnsafety_register_gates`` hook
(built-in families, ``conftest.py`` files and installed plugins alike).

:func:`parse_marker` runs at collection and raises :class:`MarkerError` naming the test, the
marker, the argument and the fix. Evaluation lives in :mod:`.evaluation`. No torch import here.
"""

from __future__ import annotations

import math
import sys
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

from pytest_dnnsafety.settings import SETTINGS, TASK_NAMES, Settings, parse_setting
from pytest_dnnsafety.errors import ConfigError, DnnSafetyError, MarkerError
from pytest_dnnsafety.gates.checks import in_range
from pytest_dnnsafety.results import Measurement

__all__ = [
    "REQUIRED", "COMMON_SETTINGS", "REGRESSION_KEYWORDS", "Param", "GateDef", "GateSpec", "GateContext",
    "GateRegistry", "GateDefinitionError", "FamilyDeclaration", "parse_marker", "resolve_optional",
]


class _Required:
    def __repr__(self) -> str:
        return "..."


#: Default of a keyword the user must give (e.g. ``layer=...``).
REQUIRED: Any = _Required()

#: Settings every gate accepts as a marker keyword (they win over CLI, env and ini).
COMMON_SETTINGS = ("seed", "device", "batch_size", "task", "max_seconds", "sample")

#: Regression limits every gate accepts against a stored baseline: op -> keyword.
REGRESSION_KEYWORDS = {">=": "max_drop", "<=": "max_rise"}

#: Marker keywords no Param may use.
_RESERVED = {"threshold", *COMMON_SETTINGS, *REGRESSION_KEYWORDS.values()}


class GateDefinitionError(DnnSafetyError, ValueError):
    """A :class:`GateDef` is malformed, or its marker name is registered twice."""


# ------------------------------------------------------------------------------------- reusable checks


@dataclass(frozen=True)
class Param:
    """One keyword option of a gate marker: its name, accepted types, default, check and fix text.

    ``check(value)`` returns None when the value is fine, else a short problem ("... is outside
    [1, 3]"); ``doc`` is the fix shown in the collection error. ``default=REQUIRED`` makes the
    keyword mandatory.
    """

    name: str
    types: tuple[type, ...]
    default: Any
    check: Callable[[Any], str | None] | None = None
    doc: str = ""

    def validate(self, value: Any) -> str | None:
        if isinstance(value, bool) and bool not in self.types:
            return f"expected {self._type_names()}, got a bool"
        if not isinstance(value, self.types):
            return f"expected {self._type_names()}, got {type(value).__name__} {value!r}"
        return self.check(value) if self.check else None

    def _type_names(self) -> str:
        names = {int: "int", float: "float", str: "str", dict: "dict", bool: "bool", type(None): "None"}
        return " or ".join(names.get(t, t.__name__) for t in self.types)


#: measure(spec, fixtures by role, context) -> Measurement
MeasureFn = Callable[["GateSpec", Mapping[str, Any], "GateContext"], Measurement]


@dataclass(frozen=True)
class GateDef:
    """The definition of one gate marker.

    ``measure(spec, fixtures, ctx)`` computes the metric and returns a
    :class:`~pytest_dnnsafety.results.Measurement`; ``spec.options`` holds the validated keyword
    values, ``fixtures`` the fixture values by role (the keys of ``fixtures`` below), ``ctx`` the
    resolved seed, device, batch size and the session cache. It may raise: a
    :class:`~pytest_dnnsafety.errors.DnnSafetyError` (message naming cause and fix) or any other
    exception makes the gate an *error*, never a pass.
    """

    marker: str
    metric: str
    op: str  # ">=" or "<="
    threshold_range: tuple[float, float]
    params: tuple[Param, ...]
    fixtures: Mapping[str, str]  # keyword (role) -> default fixture name
    measure: MeasureFn
    doc: str
    #: role -> option: the role's fixture is requested only when that option is set (not None);
    #: ``"!option"`` inverts it: requested only when the option is *not* set (a fallback source)
    conditional: Mapping[str, str] = field(default_factory=dict)
    #: role -> setting name (e.g. ``{"data": "data"}``): an *optional* role. Its fixture is requested
    #: only when the user named it by marker keyword, the setting is configured (not its default),
    #: or a non-plugin fixture of that name is visible to the test (see :func:`resolve_optional`).
    #: The measure function finds the role in its fixture mapping only when it was requested.
    optional: Mapping[str, str] = field(default_factory=dict)
    #: ``layers(options)`` -> the names (``model.named_modules()``) of the layers the gate reads from its
    #: ``model`` and ``data`` fixtures: the session captures every declared layer of one (model, data) pair
    #: in one forward pass (:class:`~pytest_dnnsafety.engines.core.capture.ActivationCache`). None: the gate reads
    #: no layer the session can know before it runs. Called at collection with the validated options;
    #: raising or returning anything but strings is a collection error naming the gate.
    layers: Callable[[Mapping[str, Any]], Iterable[str]] | None = None
    #: the value is a wall-clock timing of this process, which no two processes repeat: under torchrun
    #: every rank takes rank 0's verdict (:func:`~pytest_dnnsafety.runtime.torchrun.agree_on_verdict`)
    timed: bool = False
    #: under torchrun the gate splits its batches across the ranks and all-reduces its engine's states
    #: (:meth:`GateContext.shard`); otherwise every rank evaluates it whole
    shards: bool = False
    #: the tasks (:data:`~pytest_dnnsafety.settings.TASK_NAMES`) the gate can measure; a gate whose model or
    #: data have another task (setting ``task``, marker keyword ``task=``, or inferred from the data) is an
    #: error naming the task and the fix, before ``measure`` runs (``ctx.task`` holds the resolved task)
    tasks: tuple[str, ...] = ("single-label",)
    #: ``(model role, data role)``: a *relative* gate (it compares the model with itself), which needs a model that
    #: gives a signal on that data — a classifier shown better than chance, a detector with a detection, a
    #: multi-label model that predicts a class (:mod:`~pytest_dnnsafety.engines.core.signal`). Checked on the
    #: session's shared pass before ``measure`` runs; without a signal the gate is inconclusive, naming the numbers.
    #: None: not checked
    signal: tuple[str, str] | None = None
    #: ``together(options)`` -> None, or ``(keyword, problem, fix)``: a check of the validated keywords *together*
    #: (each :class:`Param` checks its own value), run at collection so that a combination that cannot work is a
    #: collection error naming the marker, the keyword and the fix, before any work
    together: Callable[[Mapping[str, Any]], tuple[str, str, str] | None] | None = None
    #: ``cost(options, workload)`` -> :class:`~pytest_dnnsafety.gates.cost.Cost`: the gate's work before it runs, in
    #: single-input model forwards (a gradient step counts 3) plus its engine's own seconds, from the validated
    #: options and the :class:`~pytest_dnnsafety.gates.cost.Workload` (inputs, input shape, batch size). The evaluation
    #: multiplies the forwards by a probed time per forward, shows the estimate and refuses a gate estimated above
    #: ``max_seconds``. None: one pass over the data
    cost: Callable[[Mapping[str, Any], Any], Any] | None = None
    #: the gate reads only its model's outputs on its ``data`` role, through the shared pass (:func:`.shared.outputs_for`):
    #: recorded predictions (:class:`~pytest_dnnsafety.files.predictions.RecordedPredictions`) can stand in for the
    #: model. False (the default): the gate needs the model itself (inputs it makes, layers, gradients), and is refused
    #: when only recorded predictions are given (run on the real model when one is given with them)
    outputs_only: bool = False

    @property
    def regression_keyword(self) -> str:
        """``max_drop`` for a ``>=`` gate, ``max_rise`` for a ``<=`` gate."""
        return REGRESSION_KEYWORDS[self.op]

    def signature(self) -> str:
        parts = ["threshold"]
        parts += [f"{p.name}={p.default!r}" for p in self.params]
        parts += [f"{kw}={name!r}" for kw, name in self.fixtures.items()]
        return f"{self.marker}({', '.join(parts)})"

    def problems(self) -> list[str]:
        """What is wrong with this definition (empty when it is usable)."""
        out: list[str] = []
        if not isinstance(self.marker, str) or not self.marker.isidentifier() or self.marker.startswith("_"):
            out.append(f"marker {self.marker!r} must be a Python identifier not starting with '_'")
        if not isinstance(self.metric, str) or not self.metric:
            out.append(f"metric {self.metric!r} must be a non-empty string")
        if self.op not in REGRESSION_KEYWORDS:
            out.append(f"op {self.op!r} must be '>=' or '<='")
        rng = self.threshold_range
        if (not isinstance(rng, (tuple, list)) or len(rng) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in rng)
                or rng[0] > rng[1]):
            out.append(f"threshold_range {rng!r} must be (low, high) numbers with low <= high")
        if not callable(self.measure):
            out.append("measure must be callable as measure(spec, fixtures, ctx) -> Measurement")
        if not isinstance(self.fixtures, Mapping) or not all(
                isinstance(k, str) and k.isidentifier() and isinstance(v, str) and v.isidentifier()
                for k, v in self.fixtures.items()):
            out.append(f"fixtures {self.fixtures!r} must map role keywords to fixture names (identifiers)")
        if not isinstance(self.params, tuple):
            out.append(f"params must be a tuple of Param, got {type(self.params).__name__}")
        seen: set[str] = set()
        for param in self.params if isinstance(self.params, tuple) else ():
            if not isinstance(param, Param):
                out.append(f"params must hold Param objects, got {param!r}")
                continue
            if not isinstance(param.name, str) or not param.name.isidentifier():
                out.append(f"Param name {param.name!r} must be an identifier")
            elif param.name in _RESERVED or param.name in self.fixtures or param.name in seen:
                out.append(f"Param {param.name!r} clashes with a fixture keyword, another Param or a keyword every "
                           f"gate takes ({', '.join(sorted(_RESERVED))})")
            seen.add(param.name)
            if (not isinstance(param.types, tuple) or not param.types
                    or not all(isinstance(t, type) for t in param.types)):
                out.append(f"Param {param.name!r}: types {param.types!r} must be a non-empty tuple of types")
            elif param.default is not REQUIRED and param.validate(param.default) is not None:
                out.append(f"Param {param.name!r}: default {param.default!r}: {param.validate(param.default)}")
        if (not isinstance(self.tasks, tuple) or not self.tasks
                or not all(task in TASK_NAMES for task in self.tasks)):
            out.append(f"tasks {self.tasks!r} must be a non-empty tuple of {', '.join(TASK_NAMES)}")
        for role in (*self.conditional, *self.optional):
            if role not in self.fixtures:
                out.append(f"conditional/optional role {role!r} is not one of the fixtures {sorted(self.fixtures)}")
        for role, option in self.conditional.items():
            if option.removeprefix("!") not in seen:
                out.append(f"conditional role {role!r} names {option!r}, which is not a Param")
        for role, setting in self.optional.items():
            if setting not in SETTINGS:
                out.append(f"optional role {role!r} names {setting!r}, which is not a setting")
        if self.signal is not None and (not isinstance(self.signal, tuple) or len(self.signal) != 2
                                        or not isinstance(self.fixtures, Mapping)
                                        or not all(role in self.fixtures for role in self.signal)):
            out.append(f"signal {self.signal!r} must be None or (model role, data role), roles of the fixtures "
                       f"{sorted(self.fixtures)}")
        if self.layers is not None and not callable(self.layers):
            out.append(f"layers must be None or callable as layers(options) -> layer names, got {self.layers!r}")
        if self.cost is not None and not callable(self.cost):
            out.append(f"cost must be None or callable as cost(options, workload) -> Cost, got {self.cost!r}")
        for flag in ("timed", "shards", "outputs_only"):
            if not isinstance(getattr(self, flag), bool):
                out.append(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        return out

    def read_layers(self, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The layer names the declared ``layers(options)`` gives (``()`` when none is declared).

        Raises :class:`GateDefinitionError` naming this gate when the function raises or gives
        anything but an iterable of non-empty strings.
        """
        if self.layers is None:
            return ()
        fix = ("Fix the GateDef: layers(options) must return the names of the layers the gate reads (str, as in "
               "model.named_modules()), or leave layers=None")
        try:
            names = self.layers(options)
            got = (names,) if isinstance(names, str) else tuple(names)
        except Exception as exc:  # noqa: BLE001 - the user's function: named in the error
            raise GateDefinitionError(f"gate {self.marker!r}: its layers(options) raised {type(exc).__name__}: "
                                      f"{exc}. {fix}") from None
        bad = [name for name in got if not isinstance(name, str) or not name]
        if bad:
            raise GateDefinitionError(f"gate {self.marker!r}: its layers(options) gave {bad[0]!r}, not a layer name. "
                                      f"{fix}")
        return tuple(dict.fromkeys(got))


def _caller_source(depth: int = 2) -> str:
    """``module (file)`` of the code that called the registry, for duplicate-marker errors."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "unknown"
    name = frame.f_globals.get("__name__", "?")
    path = frame.f_globals.get("__file__")
    return f"{name} ({path})" if path else str(name)


class FamilyDeclaration(Protocol):
    """What :meth:`GateRegistry.add_family` reads of a :class:`~pytest_dnnsafety.gates.family.Family` (its module
    imports this one, so the registry names only its shape)."""

    @property
    def name(self) -> str: ...
    @property
    def title(self) -> str: ...
    @property
    def page(self) -> str: ...
    @property
    def order(self) -> int: ...
    @property
    def gates(self) -> Sequence[GateDef]: ...
    @property
    def plots(self) -> Mapping[str, Callable[..., Any]]: ...
    def problems(self) -> list[str]: ...


class GateRegistry(MutableMapping):
    """The gate markers of one run: marker name -> :class:`GateDef`, each with where it came from.

    ``pytest_dnnsafety_register_gates(registry)`` implementations call :meth:`add_family` (a family's
    gates and plots) or :meth:`add` (one gate). A marker name registered twice (by different
    definitions) is an error naming both sources, and so is a family name or a plot's details key. It
    is a mapping (``registry["max_pmi_ub"]``, ``in``, iteration in registration order);
    :attr:`families` and :attr:`plots` are what its families declared.
    """

    def __init__(self, on_add: Callable[[GateDef], None] | None = None) -> None:
        self._gates: dict[str, GateDef] = {}
        self._sources: dict[str, str] = {}
        self._families: dict[str, tuple[FamilyDeclaration, str]] = {}  # name -> (family, source)
        self._on_add = on_add

    def add(self, gate: GateDef, *, source: str | None = None) -> GateDef:
        """Register one gate; refuses a malformed definition and a marker name already taken."""
        if not isinstance(gate, GateDef):
            raise GateDefinitionError(f"registry.add() takes a pytest_dnnsafety.GateDef, got {type(gate).__name__}")
        source = source or _caller_source()
        problems = gate.problems()
        if problems:
            raise GateDefinitionError(
                f"gate {gate.marker!r} from {source} is malformed: " + "; ".join(problems) + ". Fix the GateDef.")
        known = self._gates.get(gate.marker)
        if known is gate:
            return gate
        if known is not None:
            raise GateDefinitionError(
                f"gate marker {gate.marker!r} is registered twice: by {self._sources[gate.marker]} and by {source}. "
                "Fix: give one of them another marker name (or unregister one plugin with -p no:NAME).")
        self._gates[gate.marker] = gate
        self._sources[gate.marker] = source
        if self._on_add is not None:
            self._on_add(gate)
        return gate

    def add_family(self, family: FamilyDeclaration, *, source: str | None = None) -> FamilyDeclaration:
        """Register a family: each of its gates as :meth:`add` does, and its plots; the same family twice is a no-op.

        A malformed family, or a family name or plot key taken by another family, is an error naming both sources.
        """
        source = source or _caller_source()
        if not all(hasattr(family, a) for a in ("name", "title", "page", "order", "gates", "plots", "problems")):
            raise GateDefinitionError(f"registry.add_family() takes a pytest_dnnsafety.Family, got "
                                      f"{type(family).__name__} (from {source})")
        problems = family.problems()
        if problems:
            raise GateDefinitionError(f"gate family {family.name!r} from {source} is malformed: " + "; ".join(problems)
                                      + ". Fix the Family.")
        known = self._families.get(family.name)
        if known is not None and known[0] is family:
            return family
        if known is not None:
            raise GateDefinitionError(
                f"gate family {family.name!r} is registered twice: by {known[1]} and by {source}. "
                "Fix: give one of them another name (or unregister one plugin with -p no:NAME).")
        for other, other_source in self._families.values():
            clash = [key for key, plot in family.plots.items() if other.plots.get(key, plot) is not plot]
            if clash:
                raise GateDefinitionError(f"plot {clash[0]!r} of gate family {family.name!r} from {source} is drawn "
                                          f"differently by gate family {other.name!r} from {other_source}. Fix: key "
                                          "the plot by another details key.")
        for gate in family.gates:
            self.add(gate, source=source)
        self._families[family.name] = (family, source)
        return family

    @property
    def families(self) -> dict[str, FamilyDeclaration]:
        """The registered families by name, in their ``order`` (then by name): the docs navigation's order."""
        ordered = sorted(self._families.values(), key=lambda pair: (pair[0].order, pair[0].name))
        return {family.name: family for family, _ in ordered}

    @property
    def plots(self) -> dict[str, Callable[..., Any]]:
        """The HTML report's plot table: details key -> plot function, from the families in :attr:`families` order."""
        return {key: plot for family in self.families.values() for key, plot in family.plots.items()}

    def get(self, marker: str, default: Any = None) -> Any:  # type: ignore[override]
        return self._gates.get(marker, default)

    def source(self, marker: str) -> str:
        """Where the gate ``marker`` was registered from (``module (file)``)."""
        return self._sources[marker]

    def __getitem__(self, marker: str) -> GateDef:
        return self._gates[marker]

    def __setitem__(self, marker: str, gate: GateDef) -> None:
        """Set or replace a definition (kept for ``GATES.update(saved)``); :meth:`add` refuses duplicates."""
        if not isinstance(gate, GateDef) or gate.marker != marker:
            raise GateDefinitionError(f"registry[{marker!r}] must be a GateDef with marker {marker!r}")
        self._gates[marker] = gate
        self._sources.setdefault(marker, _caller_source())

    def __delitem__(self, marker: str) -> None:
        del self._gates[marker]
        self._sources.pop(marker, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._gates)

    def __len__(self) -> int:
        return len(self._gates)

    def __repr__(self) -> str:
        return f"GateRegistry({list(self._gates)})"


#: The process-wide registry of the built-in gates (and those added with ``register_gate``), re-exported as
#: :data:`pytest_dnnsafety.gates.GATES`, which fills it when imported; defined here so that this module never
#: imports its package (no import cycle).
GATES = GateRegistry()


@dataclass(frozen=True)
class GateSpec:
    """A validated gate marker on one test."""

    marker: str
    threshold: float
    options: Mapping[str, Any]
    fixtures: Mapping[str, str]  # role -> fixture name to request
    settings: Mapping[str, Any] = field(default_factory=dict)  # marker overrides of COMMON_SETTINGS
    #: optional roles not (yet) requested: role -> default fixture name (see GateDef.optional)
    optional: Mapping[str, str] = field(default_factory=dict)
    #: ``max_drop`` (``>=`` gates) or ``max_rise`` (``<=`` gates): the change allowed against a baseline
    regression_limit: float | None = None
    #: the definition this spec was parsed against
    gate: GateDef | None = field(default=None, compare=False, repr=False)
    #: the layers the gate reads, from its definition's ``layers(options)`` (see :attr:`GateDef.layers`)
    layers: tuple[str, ...] = ()

    @property
    def definition(self) -> GateDef:
        return self.gate if self.gate is not None else GATES[self.marker]

    def plan_entry(self) -> dict[str, Any]:
        """What the controller must know about this gate before it runs (plain JSON)."""
        gate = self.definition
        return {"marker": self.marker, "metric": gate.metric, "op": gate.op, "threshold": self.threshold}


@dataclass
class GateContext:
    """What a gate may use besides its fixtures: resolved settings for this gate and the session's services.

    ``cache`` is the session-wide store the services live in. :meth:`memo` memoises a result keyed
    by the *objects* it was computed from (a model, a data set) and plain values; :meth:`shard` is
    this torchrun rank's share of a data set's batches.
    """

    settings: Settings
    seed: int
    device: str
    batch_size: int
    cache: dict[str, Any] = field(default_factory=dict)
    #: the model's task (``single-label``, ``multi-label``, ``detection``), resolved before ``measure`` runs
    task: str = "single-label"
    #: the ``task`` setting as resolved for this gate (marker keyword, CLI, env, ini or default ``auto``)
    task_setting: Any = None
    #: the ``max_seconds`` setting as resolved for this gate (a :class:`~pytest_dnnsafety.settings.Resolved`; value 0 or
    #: None: no limit)
    max_seconds: Any = None
    #: the ``sample`` setting as resolved for this gate (value None: all the data)
    sample: Any = None

    def memo(self, name: str, objects: tuple[Any, ...], values: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        """``compute()``'s result, computed once per session for these ``objects`` and ``values``.

        ``objects`` are compared by identity (a model or data set need not be hashable) and kept
        alive with the result, so their identity cannot be reused by other objects while the
        session lives; ``values`` must be hashable and are compared by equality. An exception is
        memoised too (every gate asking again gets the same error without recomputing).
        """
        store: dict[Any, tuple[tuple[Any, ...], Any, BaseException | None]] = self.cache.setdefault("memo", {})
        key = (name, tuple(id(obj) for obj in objects), values)
        if key in store:
            _, value, error = store[key]
            if error is not None:
                raise error
            return value
        try:
            value = compute()
        except Exception as exc:
            store[key] = (objects, None, exc)
            raise
        store[key] = (objects, value, None)
        return value

    def shard(self, data: Any) -> Any:
        """This torchrun rank's :class:`~pytest_dnnsafety.runtime.torchrun.Shard` of ``data`` batched by the gate's batch
        size, or None to evaluate it whole (not distributed, or the data cannot be cut; see
        :func:`pytest_dnnsafety.runtime.torchrun.batch_shard`)."""
        from pytest_dnnsafety.runtime import torchrun as ranks

        return ranks.batch_shard(data, self.batch_size)


def resolve_optional(spec: GateSpec, settings: Settings, overridden: Callable[[str], bool]) -> GateSpec:
    """The spec with each optional role requested when its setting is configured or its fixture overridden.

    ``overridden(fixture_name)`` tells whether a non-plugin fixture of that name is visible to the test.
    """
    if not spec.optional:
        return spec
    fixtures = dict(spec.fixtures)
    rest: dict[str, str] = {}
    for role, fixture in spec.optional.items():
        setting = spec.definition.optional[role]
        if settings.get(setting).source != "default" or overridden(fixture):
            fixtures[role] = fixture
        else:
            rest[role] = fixture
    return replace(spec, fixtures=fixtures, optional=rest)


# ------------------------------------------------------------------------------------- validation


def parse_marker(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], where: str,
                 registry: Mapping[str, GateDef] | None = None) -> GateSpec:
    """Validate one gate marker's arguments; ``where`` names the test for the error message."""
    gate = (GATES if registry is None else registry)[name]

    def fail(argument: str, problem: str, fix: str) -> MarkerError:
        return MarkerError(f"{where}: @pytest.mark.{name}: argument {argument}: {problem}. Fix: {fix}.")

    kwargs = dict(kwargs)
    if len(args) > 1:
        raise fail("*args", f"takes one positional argument (the threshold), got {len(args)}",
                   f"pass options by keyword: {gate.signature()}")
    if args and "threshold" in kwargs:
        raise fail("threshold", "given both positionally and by keyword", "give it once")
    if not args and "threshold" not in kwargs:
        raise fail("threshold", "missing", f"write @pytest.mark.{gate.signature()}")
    threshold = args[0] if args else kwargs.pop("threshold")
    lo, hi = gate.threshold_range
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise fail("threshold", f"expected a number, got {type(threshold).__name__} {threshold!r}",
                   f"use a number in [{lo}, {hi}]")
    problem = in_range(lo, hi)(threshold)
    if problem:
        raise fail("threshold", problem, f"use a number in [{lo}, {hi}]")

    params = {p.name: p for p in gate.params}
    options: dict[str, Any] = {}
    fixtures = dict(gate.fixtures)
    overrides: dict[str, Any] = {}
    limit: float | None = None
    own_limit = gate.regression_keyword
    for key, value in kwargs.items():
        if key in params:
            problem = params[key].validate(value)
            if problem:
                raise fail(key, problem, params[key].doc or f"see {gate.signature()}")
            options[key] = value
        elif key in gate.fixtures:
            if not isinstance(value, str) or not value.isidentifier():
                raise fail(key, f"must name a fixture (an identifier string), got {value!r}",
                           f"write {key}=\"my_fixture\" and define that fixture")
            fixtures[key] = value
        elif key in COMMON_SETTINGS:
            try:
                parsed = parse_setting(key, value, f"marker @pytest.mark.{name}({key}=...)")
            except ConfigError as exc:
                raise fail(key, str(exc).split(". Fix: ")[0], str(exc).split(". Fix: ")[-1].rstrip(".")) from None
            if key == "task" and parsed != "auto" and parsed not in gate.tasks:
                raise fail(key, f"{name} does not support task {parsed!r}",
                           f"{name} measures {', '.join(gate.tasks)} models; use a gate made for {parsed} models")
            overrides[key] = value
        elif key == own_limit:
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)
                    or value < 0 or math.isinf(value)):
                raise fail(key, f"expected a non-negative finite number, got {value!r}",
                           f"give the largest {'drop' if gate.op == '>=' else 'rise'} of {gate.metric} allowed "
                           f"against the baseline, in the metric's units, e.g. {key}=0.02")
            limit = float(value)
        elif key in REGRESSION_KEYWORDS.values():
            kind = "must reach its threshold (>=)" if gate.op == ">=" else "must stay below its threshold (<=)"
            raise fail(key, f"{name} {kind}, so a regression is a {'drop' if gate.op == '>=' else 'rise'}",
                       f"use {own_limit}=... instead")
        else:
            allowed = [*sorted([*params, *gate.fixtures, *COMMON_SETTINGS]), own_limit]
            raise fail(key, "unknown keyword", f"use one of {', '.join(allowed)}")
    for param in gate.params:
        if param.name not in options and param.default is REQUIRED:
            raise fail(param.name, "missing", f"write @pytest.mark.{gate.signature()}; {param.doc}")
        options.setdefault(param.name, param.default)
    for role, option in gate.conditional.items():
        wanted = options.get(option[1:]) is None if option.startswith("!") else options.get(option) is not None
        if not wanted and role not in kwargs:
            fixtures.pop(role)
    # An optional role named by keyword is requested; otherwise the plugin decides per test
    # (resolve_optional), once it knows the settings and the fixtures visible to the test.
    optional = {role: fixtures.pop(role) for role in gate.optional if role not in kwargs and role in fixtures}
    try:
        combined = gate.together(options) if gate.together is not None else None
    except Exception as exc:  # noqa: BLE001 - a user gate's function: named in the error, never INTERNALERROR
        raise MarkerError(f"{where}: @pytest.mark.{name}: gate {gate.marker!r}: its together(options) raised "
                          f"{type(exc).__name__}: {exc}. Fix the GateDef: together(options) returns None or "
                          "(keyword, problem, fix)") from None
    if combined is not None:
        raise fail(*combined)
    try:
        layers = gate.read_layers(options)
    except GateDefinitionError as exc:
        raise MarkerError(f"{where}: @pytest.mark.{name}: {exc}") from None
    return GateSpec(name, float(threshold), options, fixtures, overrides, optional, limit, gate, layers)
