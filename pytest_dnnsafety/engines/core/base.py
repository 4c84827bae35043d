"""The engine protocol shared by every metric engine (torchmetrics-style, pure torch).

An engine owns a few *state tensors*, each with a reduce rule that says how two partial
states combine: element-wise (``sum``, ``max``, ``min``, ``or``, ``and``), or as rows that
accumulate along dim 0 (``cat``: every row; ``topk(k, key)``: the k best rows; see
:mod:`pytest_dnnsafety.engines.core.states`). Work is split freely:

* ``update(...)`` folds a batch into the states, on the engine's device, without syncing to
  the host, so it can sit inside a data-loader loop;
* ``merge(other)`` combines two engines of the same class and configuration in-process
  (e.g. the partial results of pytest-xdist workers);
* ``sync(group)`` all-reduces the states over ``torch.distributed`` ranks;
* ``state_payload()`` / ``from_payload()`` turn an engine into plain JSON-able Python values
  and back, which is how state crosses process boundaries that only carry str/int/float/bool;
* ``compute()`` turns the states into a result (it may sync to the host).

This module imports nothing from pytest.
"""

from __future__ import annotations

import abc
import base64
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, cast

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.states import (
    TopK,
    all_gather_rows,
    check_row_default,
    check_rows,
    prune_topk,
    topk,
)

__all__ = ["Engine", "Reduce", "PAYLOAD_VERSION", "TopK", "topk"]

Reduce = Literal["sum", "max", "min", "or", "and", "cat"]
_REDUCES: tuple[str, ...] = ("sum", "max", "min", "or", "and")

#: Version of the layout written by :meth:`Engine.state_payload`.
PAYLOAD_VERSION = 2

_E = TypeVar("_E", bound="Engine")

_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"state dtype {dtype} cannot be serialised; use one of {sorted(_DTYPES)}") from None


def _encode_float(value: float) -> float | str:
    """A float as JSON-able value: non-finite floats become the strings 'nan', 'inf', '-inf'."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _decode_float(value: float | int | str) -> float:
    return float(value)


def _encode_tensor(tensor: Tensor) -> dict[str, object]:
    """A tensor as ``{"dtype", "shape", ...}`` made of plain JSON-able values (one host copy).

    Bool states (coverage tables can hold 10^8 cells) travel bit-packed and base64-encoded
    (``"bits"``); other numpy-representable dtypes as base64 of their little-endian bytes
    (``"bytes"``, exact, non-finite floats included); anything else as a list (``"data"``).
    """
    flat = tensor.detach().reshape(-1).cpu()
    spec: dict[str, object] = {"dtype": _dtype_name(tensor.dtype), "shape": [int(s) for s in tensor.shape]}
    if tensor.dtype == torch.bool:
        spec["bits"] = base64.b64encode(np.packbits(flat.numpy()).tobytes()).decode("ascii")
    elif tensor.dtype in (torch.float16, torch.bfloat16):
        spec["data"] = [_encode_float(float(v)) for v in flat.to(torch.float64).tolist()]
    else:
        spec["bytes"] = base64.b64encode(flat.numpy().astype(flat.numpy().dtype.newbyteorder("<")).tobytes()).decode(
            "ascii")
    return spec


def _decode_tensor(spec: Mapping[str, Any], name: str) -> Tensor:
    try:
        dtype = _DTYPES[str(spec["dtype"])]
        shape = [int(s) for s in spec["shape"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"payload state {name!r} is malformed ({exc!r}); expected keys dtype, shape, data") from None
    numel = math.prod(shape)
    if "data" in spec:
        data = list(spec["data"])
        if dtype.is_floating_point:
            data = [_decode_float(v) for v in data]
        if len(data) != numel:
            raise ValueError(f"payload state {name!r} has {len(data)} values but shape {shape} needs {numel}")
        return torch.tensor(data, dtype=dtype).reshape(shape)
    try:
        if "bits" in spec:
            bits = np.unpackbits(np.frombuffer(base64.b64decode(str(spec["bits"])), dtype=np.uint8))
            if not numel <= bits.size < numel + 8:
                raise ValueError(f"{bits.size} bits for {numel} values")
            return torch.from_numpy(bits[:numel].astype(np.bool_)).reshape(shape)
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype.newbyteorder("<")
        array = np.frombuffer(base64.b64decode(str(spec["bytes"])), dtype=np_dtype)
        if array.size != numel:
            raise ValueError(f"has {array.size} values but shape {shape} needs {numel}")
        return torch.from_numpy(array.astype(np_dtype.newbyteorder("="))).reshape(shape)
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"payload state {name!r} is malformed: {exc}") from None


class Engine(abc.ABC):
    """Base class of the metric engines: state tensors with a reduce rule, and the protocol.

    Subclasses call :meth:`add_state` in ``__init__``, implement :meth:`update` and
    :meth:`compute`, and describe their configuration with :meth:`config` (plain JSON-able
    values, enough to rebuild the engine with :meth:`from_config`).
    """

    #: Registry of concrete engines by qualified name, used by :meth:`from_payload`.
    _registry: ClassVar[dict[str, type[Engine]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Engine._registry[cls._qualified_name()] = cls

    @classmethod
    def _qualified_name(cls) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device: torch.device = torch.device("cpu") if device is None else torch.device(device)
        self._defaults: dict[str, Tensor] = {}
        self._reductions: dict[str, str | TopK] = {}
        self._row_chunks: dict[str, list[Tensor]] = {}  # cat states: appended chunks, joined when read

    # ------------------------------------------------------------------ states
    def add_state(self, name: str, default: Tensor, reduce: Reduce | TopK) -> None:
        """Register a state tensor ``name`` with its default value and its reduce rule.

        ``or`` and ``and`` states must hold booleans or 0/1 integers. ``cat`` and
        :func:`~pytest_dnnsafety.engines.core.states.topk` states hold rows: their default is an
        empty tensor of shape ``(0, *row_shape)`` (``(0, d)`` for topk) whose dtype the rows
        keep, and :meth:`append_state` adds rows to them.
        """
        if not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"state name {name!r} must be a public Python identifier")
        if name in self._defaults or hasattr(type(self), name):
            raise ValueError(f"state {name!r} is already defined on {type(self).__name__}")
        if not isinstance(default, Tensor):
            raise TypeError(f"state {name!r}: default must be a torch.Tensor, got {type(default).__name__}")
        if not isinstance(reduce, TopK) and reduce not in (*_REDUCES, "cat"):
            raise ValueError(
                f"state {name!r}: reduce must be one of {[*_REDUCES, 'cat']} or topk(k, key), got {reduce!r}"
            )
        if reduce in ("or", "and") and (default.dtype.is_floating_point or default.dtype.is_complex):
            raise ValueError(f"state {name!r}: reduce {reduce!r} needs a bool or integer tensor, got {default.dtype}")
        if reduce == "cat" or isinstance(reduce, TopK):
            check_row_default(name, default, reduce)
        _dtype_name(default.dtype)
        self._defaults[name] = default.detach().clone().cpu()
        self._reductions[name] = reduce
        if reduce == "cat":
            self._row_chunks[name] = []
        else:
            setattr(self, name, default.detach().clone().to(self.device))

    def append_state(self, name: str, rows: Tensor) -> None:
        """Add ``rows`` (shape ``(n, *row_shape)``) to the ``cat`` or ``topk`` state ``name``.

        The rows are moved to the engine's device and cast to the state's dtype. A ``cat``
        state keeps them as a chunk (joined when the state is read); a ``topk`` state is pruned
        back to ``k`` rows on the device. Neither syncs to the host.
        """
        rule = self._reductions.get(name)
        if rule != "cat" and not isinstance(rule, TopK):
            kinds = sorted(n for n, r in self._reductions.items() if r == "cat" or isinstance(r, TopK))
            raise ValueError(
                f"append_state: {name!r} is not a cat or topk state of {type(self).__name__}; "
                f"its row states are {kinds}"
            )
        default = self._defaults[name]
        check_rows(name, rows, default)
        rows = rows.detach().to(device=self.device, dtype=default.dtype)
        if rule == "cat":
            self._row_chunks[name].append(rows)
        else:
            assert isinstance(rule, TopK)
            current = cast(Tensor, getattr(self, name))
            setattr(self, name, prune_topk(torch.cat([current, rows]), rule))

    def _read_rows(self, name: str) -> Tensor:
        """A cat state's rows: its chunks joined into one (kept, so the next read is free)."""
        chunks = self._row_chunks[name]
        if not chunks:
            return self._defaults[name].to(self.device, copy=True)
        if len(chunks) > 1:
            chunks[:] = [torch.cat(chunks)]
        return chunks[0]

    if not TYPE_CHECKING:  # hidden from type checkers, so that misspelt attributes still get flagged

        def __getattr__(self, name: str) -> Any:
            chunks = self.__dict__.get("_row_chunks")
            if chunks is not None and name in chunks:
                return self._read_rows(name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        chunks = self.__dict__.get("_row_chunks")
        if chunks and name in chunks:  # assigning a cat state replaces its rows
            check_rows(name, value, self._defaults[name])
            chunks[name] = [value]
        else:
            object.__setattr__(self, name, value)

    @property
    def state_names(self) -> tuple[str, ...]:
        """Names of the registered states, in registration order."""
        return tuple(self._defaults)

    def states(self) -> dict[str, Tensor]:
        """The current state tensors by name (not copies)."""
        return {name: cast(Tensor, getattr(self, name)) for name in self._defaults}

    # ------------------------------------------------------------------ protocol
    @abc.abstractmethod
    def update(self, *args: Any, **kwargs: Any) -> None:
        """Fold one batch into the states (no host sync)."""

    @abc.abstractmethod
    def compute(self) -> Any:
        """Turn the states into a result."""

    def config(self) -> dict[str, Any]:
        """The engine's configuration as plain JSON-able values (keyword arguments of ``__init__``)."""
        return {}

    @classmethod
    def from_config(cls: type[_E], config: Mapping[str, Any], device: torch.device | str | None = None) -> _E:
        """Build a fresh engine from :meth:`config`'s output."""
        return cls(**dict(config), device=device)  # type: ignore[call-arg]

    def reset(self) -> None:
        """Put every state back to its default, on the engine's device."""
        for name, default in self._defaults.items():
            if name in self._row_chunks:
                self._row_chunks[name] = []
            else:
                setattr(self, name, default.clone().to(self.device))

    def to(self: _E, device: torch.device | str) -> _E:
        """Move the states (and subclass buffers, see :meth:`_move_buffers`) to ``device``."""
        self.device = torch.device(device)
        for name in self._defaults:
            if name in self._row_chunks:
                self._row_chunks[name] = [chunk.to(self.device) for chunk in self._row_chunks[name]]
            else:
                setattr(self, name, cast(Tensor, getattr(self, name)).to(self.device))
        self._move_buffers(self.device)
        return self

    def _move_buffers(self, device: torch.device) -> None:
        """Hook for subclasses holding configuration tensors; called by :meth:`to`."""

    def _check_compatible(self, other: Engine) -> None:
        if type(other) is not type(self):
            raise ValueError(
                f"cannot merge {type(other).__name__} into {type(self).__name__}: engines must be of the same class"
            )
        mine, theirs = self.config(), other.config()
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                shown_mine, shown_theirs = _short(mine.get(key)), _short(theirs.get(key))
                raise ValueError(
                    f"cannot merge {type(self).__name__} engines with different {key!r}: "
                    f"{shown_mine} vs {shown_theirs}; build both with the same configuration"
                )
        for name in self._defaults:
            a, b = cast(Tensor, getattr(self, name)), cast(Tensor, getattr(other, name))
            rows = name in self._row_chunks or isinstance(self._reductions[name], TopK)
            if (a.shape[1:] if rows else a.shape) != (b.shape[1:] if rows else b.shape) or a.dtype != b.dtype:
                raise ValueError(
                    f"cannot merge {type(self).__name__} engines: state {name!r} is {tuple(a.shape)}/{a.dtype} "
                    f"here and {tuple(b.shape)}/{b.dtype} there"
                )

    def merge(self: _E, other: Engine) -> _E:
        """Combine ``other``'s states into this engine's (state-wise reduce) and return ``self``.

        ``cat`` states concatenate (this engine's rows, then ``other``'s); ``topk`` states
        concatenate and prune back to ``k``. Raises ``ValueError`` naming the difference when
        the classes or configurations differ.
        """
        self._check_compatible(other)
        for name, rule in self._reductions.items():
            if rule == "cat":
                self._row_chunks[name].extend([chunk.to(self.device) for chunk in other._row_chunks[name]])
                continue
            mine = cast(Tensor, getattr(self, name))
            theirs = cast(Tensor, getattr(other, name)).to(mine.device)
            if isinstance(rule, TopK):
                setattr(self, name, prune_topk(torch.cat([mine, theirs]), rule))
            else:
                setattr(self, name, _reduce_pair(mine, theirs, rule))
        return self

    def sync(self: _E, group: Any = None) -> _E:
        """All-reduce every state over ``torch.distributed`` (a no-op when it is not initialised).

        ``sum``→SUM, ``max``→MAX, ``min``→MIN, ``or``→MAX and ``and``→MIN (booleans travel as uint8).
        ``cat`` states all-gather the ranks' rows (any number per rank, none included) and
        concatenate them in rank order; ``topk`` states all-gather and prune back to ``k``.
        Every rank must call it, with the same states in the same order.
        """
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return self
        ops = {
            "sum": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
            "or": dist.ReduceOp.MAX,
            "and": dist.ReduceOp.MIN,
        }
        for name, rule in self._reductions.items():
            state = cast(Tensor, getattr(self, name))
            if rule == "cat" or isinstance(rule, TopK):
                joined = all_gather_rows(state, group)
                setattr(self, name, prune_topk(joined, rule) if isinstance(rule, TopK) else joined)
                continue
            buffer = state.to(torch.uint8) if state.dtype == torch.bool else state.clone()
            dist.all_reduce(buffer, op=ops[rule], group=group)
            setattr(self, name, buffer.to(state.dtype) if state.dtype == torch.bool else buffer)
        return self

    # ------------------------------------------------------------------ payloads
    def state_payload(self) -> dict[str, object]:
        """Engine class, configuration and states as plain JSON-able Python values."""
        return {
            "engine": self._qualified_name(),
            "version": PAYLOAD_VERSION,
            "config": self.config(),
            "states": {name: _encode_tensor(cast(Tensor, getattr(self, name))) for name in self._defaults},
        }

    @classmethod
    def from_payload(
        cls: type[_E], payload: Mapping[str, Any], device: torch.device | str | None = None
    ) -> _E:
        """Rebuild an engine (configuration and states) from :meth:`state_payload`'s output.

        Called on :class:`Engine` itself, the class is looked up from the payload.
        """
        if not isinstance(payload, Mapping) or "engine" not in payload:
            raise ValueError("engine payload must be a mapping with keys engine, version, config, states")
        if payload.get("version") != PAYLOAD_VERSION:
            raise ValueError(f"engine payload version {payload.get('version')!r} is not {PAYLOAD_VERSION}")
        name = str(payload["engine"])
        target: type[Engine]
        if cls is Engine:
            if name not in Engine._registry:
                raise ValueError(f"engine payload names unknown engine {name!r}; import its module first")
            target = Engine._registry[name]
        else:
            if name != cls._qualified_name():
                raise ValueError(f"engine payload is for {name!r}, not {cls._qualified_name()!r}")
            target = cls
        engine = target.from_config(dict(payload.get("config", {})), device=device)
        states = payload.get("states", {})
        if set(states) != set(engine.state_names):
            raise ValueError(
                f"engine payload states {sorted(states)} do not match {target.__name__}'s {sorted(engine.state_names)}"
            )
        for state_name in engine.state_names:
            value = _decode_tensor(states[state_name], state_name)
            current = cast(Tensor, getattr(engine, state_name))
            rule = engine._reductions[state_name]
            if rule == "cat" or isinstance(rule, TopK):
                if value.dim() != current.dim() or value.shape[1:] != current.shape[1:] or value.dtype != current.dtype:
                    raise ValueError(
                        f"engine payload state {state_name!r} is {tuple(value.shape)}/{value.dtype}, expected rows "
                        f"(n, {', '.join(str(s) for s in current.shape[1:])})/{current.dtype}"
                    )
                if isinstance(rule, TopK):
                    if value.shape[0] > rule.k:
                        raise ValueError(
                            f"engine payload state {state_name!r} has {value.shape[0]} rows; its rule {rule} keeps "
                            f"at most {rule.k}"
                        )
                    value = prune_topk(value, rule)
            elif value.shape != current.shape or value.dtype != current.dtype:
                raise ValueError(
                    f"engine payload state {state_name!r} is {tuple(value.shape)}/{value.dtype}, "
                    f"expected {tuple(current.shape)}/{current.dtype}"
                )
            setattr(engine, state_name, value.to(engine.device))
        return cast(_E, engine)

    def __repr__(self) -> str:
        config = ", ".join(f"{key}={_short(value)}" for key, value in self.config().items())
        return f"{type(self).__name__}({config}, device={str(self.device)!r})"


def _reduce_pair(a: Tensor, b: Tensor, rule: str) -> Tensor:
    if rule == "sum":
        return a + b
    if rule == "max":
        return torch.maximum(a, b)
    if rule == "min":
        return torch.minimum(a, b)
    if rule == "or":
        return a | b if a.dtype == torch.bool else torch.maximum(a, b)
    return a & b if a.dtype == torch.bool else torch.minimum(a, b)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
