"""Neuron k-activation coverage and the activation-pattern metric (Cheng et al. 2018, §II-B/§II-C).

Both engines take one layer's activations as an ``(N, c)`` tensor: N inputs, c neurons, each
neuron already reduced to one number per input (for a conv layer a neuron is a channel,
reduced over space by the caller, e.g. ``x.amax(dim=(2, 3))``). A neuron is *on* for an input
iff its activation is strictly greater than ``activation_threshold`` (default 0: "ReLU fires"),
so an activation exactly at the threshold is *off*. The comparison happens in the activations'
dtype (the threshold is rounded to it, as ``tensor > float`` does in torch).

**M_neu-k-act, eq. (2).** For every k-tuple of distinct neurons ``i1 < … < ik`` and every on/off
pattern ``s ∈ {0,1}^k`` there is one cell; it is *occupied* when some input shows pattern ``s``
on that tuple::

    M_neu-k-act = (# occupied cells) / (C(c, k) · 2^k)

k = 1 is classic single-layer neuron coverage counted on both sides (2c cells: each neuron seen
on and seen off). :class:`NeuronKActivationEngine` supports k = 1, 2, 3.

State layout (``occupied``, bool, shape ``(C(c, k), 2^k)``, reduce ``or``): row ``t`` is the
t-th k-tuple in :func:`itertools.combinations` order (lexicographic), column ``p`` the pattern
whose bits are the tuple's states with the first neuron most significant
(``p = Σ_m s_m·2^(k-1-m)``, i.e. :func:`itertools.product` order over ``{0,1}^k``), so the
flattened state lists the cells in tuple order, then pattern order. Only the strictly
increasing tuples are stored: 178 MB at k = 3, c = 512, where a dense cube would be 1 GB.
Tuple-major rows let a tuple's 2^k flags travel as one 2^k-byte word (int16/int32/int64 view):
the comparisons write into a ``block × 2^k`` bool tensor, and one gather and one OR of words
move a chunk into the state (on the CPU 30× faster than gathering 2^k separate bool planes).

Counting is by matrix products, never by Python loops over neurons, pairs or triples (only over
chunks of neurons). With ``B ∈ {0,1}^{N×c}`` (float32), column sums ``S`` and ``P = BᵀB``:

* k = 2: the four pattern counts of the pair (i, j) are ``n11 = P_ij``, ``n10 = S_i − P_ij``,
  ``n01 = S_j − P_ij``, ``n00 = N − S_i − S_j + P_ij`` (inclusion–exclusion); a cell is occupied
  iff its count is positive, tested as comparisons (``P_ij < S_i`` etc.).
* k = 3: the 3-way contraction ``T_ijl = Σ_n b_ni·b_nj·b_nl`` is one matmul per chunk of first
  neurons ``I``: ``(B[:, I, None]·B[:, None, J]).reshape(N, m·r)ᵀ @ B[:, J]`` with ``J`` the
  neurons above the chunk (only the upper part of the cube is computed). With ``P`` and ``S`` it
  gives all eight counts by inclusion–exclusion (e.g. ``n100 = S_i − P_ij − P_il + T_ijl``).
  A precomputed index per chunk picks the strictly increasing triples out of the chunk's block
  in combinations order; they fill one contiguous slice of the state.

**Incremental k = 2.** Eq. (2) needs only whether a cell was seen, so a pair whose four cells are
occupied never needs work again. Once at most 90 % of the pairs are open, the engine keeps the list
of open pairs (:mod:`.open_pairs`) and folds later blocks of rows into those alone — an owner neuron
per pair, its row of ``P`` from a small product, from a few added rows of B, or free when it is
always off or on in the block — falling back to the dense chunks whenever that would not pay. The
occupied table is bit-identical either way.

Counts stay exact: float32 holds every integer below 2**24, and rows are processed in chunks of
at most 2**22 (the largest inclusion–exclusion sum is 4N). 0/1 inputs are exact in TF32/bf16
too, so reduced-precision matmul modes on accelerators do not change the result. ``update``
does no host sync (except the optional finiteness check, see ``validate``); ``compute`` does.

Measured on 2 shared CPU cores (``tests/benchmarks/test_bench_neurons.py``; engine build,
update and compute): 256 neurons × 1,000 inputs in 3–4 ms at k = 2 and 0.2–0.35 s at k = 3;
512 × 100,000 at k = 2 in 0.5–1.3 s. A naive per-tuple, per-input Python loop needs about
16 s, 25 min and 2.3 h for the same three jobs (estimated from subsamples). With the open-pair
list, 2,048 layer-like neurons × 100,000 inputs in 1,000-row batches took 9–10 s against 27–28 s for
a plain Gram-matrix implementation (``ratio_gram_over_plugin`` 2.8–3.0, identical tables).

**M_neu-pattern, eq. (3)**: :class:`NeuronPatternEngine` in :mod:`.patterns` (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.neurons.checks import (
    _check_activations,
    _check_threshold,
    _fmt_int,
)
from pytest_dnnsafety.engines.neurons.open_pairs import OpenPairs
from pytest_dnnsafety.errors import ConfigError

__all__ = [
    "MAX_NEURON_CELLS",
    "NeuronCoverageResult",
    "NeuronKActivationEngine",
]

#: Upper bound on ``C(c, k)·2^k`` (the ``occupied`` state holds one bool per cell: 256 MiB).
MAX_NEURON_CELLS = 1 << 28

#: Rows per pass: float32 counts stay exact (4·rows < 2**24) and B (rows × c float32) ≤ 64 MiB.
_MAX_PASS_ROWS = 1 << 22
_PASS_ELEMS = 1 << 24
#: Elements of one chunk block: k = 3 cube ``m × r × r`` (float32 T plus 8 bool flags each; 2**19
#: measured fastest on 2 CPU cores, 2**17..2**21 within 30%), k = 2 ``m × r``.
_CUBE_ELEMS = 1 << 19
_PAIR_ELEMS = 1 << 22
#: Elements of one slab of ``B[:, I, None]·B[:, None, J]`` (rows × m × r, float32).
_SLAB_ELEMS = 1 << 23
#: Widths of the neuron range J are rounded up to this multiple (BLAS runs faster on them).
_ALIGN = 16

#: Largest layer whose per-neuron coverage shares go into the details as ``per_neuron_coverage`` (for plots).
PER_NEURON_PLOT_LIMIT = 4096

#: A tuple's 2^k pattern flags (bools, one byte each) viewed as one machine word.
_WORD = {1: torch.int16, 2: torch.int32, 3: torch.int64}


# ----------------------------------------------------------------------------- chunk plan
@dataclass(frozen=True)
class _Chunk:
    """One chunk of first neurons ``a .. a+m-1``; the other neurons range over ``js .. c-1`` (width r).

    Its tuples fill ``occupied[lo:hi]``; ``index`` (int32, on the engine's device) picks them
    out of the flattened ``(m, r)`` (k = 2) or ``(m, r, r)`` (k = 3) block, in combinations order.
    """

    a: int
    m: int
    js: int
    r: int
    lo: int
    hi: int
    index: Tensor = field(repr=False)


def _tuple_offset(c: int, k: int, i: int) -> int:
    """Index of the first k-tuple whose first neuron is ``i`` (combinations order)."""
    return math.comb(c, k) - math.comb(c - i, k)


def _build_plan(c: int, k: int, device: torch.device) -> list[_Chunk]:
    """Chunks of first neurons covering all tuples, each with its gather index (built on the CPU)."""
    plan: list[_Chunk] = []
    budget = _CUBE_ELEMS if k == 3 else _PAIR_ELEMS
    a = 0
    while a <= c - k:
        width = c - a - 1
        r = min(c, -(-width // _ALIGN) * _ALIGN)
        js = c - r
        per_first = r * r if k == 3 else r
        m = max(1, min(c - k + 1 - a, budget // per_first))
        # For first neuron a+ii the valid "rest" entries of its row of the block are a suffix of
        # one fixed list: second neurons jj ≥ j0 = a+ii+1-js (k = 2: jj itself; k = 3: the strict
        # upper triangle jj < ll in row-major order, whose rows jj ≥ j0 are its last C(r-j0, 2)).
        j0 = torch.arange(m, dtype=torch.int64) + (a + 1 - js)
        if k == 2:
            rest = torch.arange(r, dtype=torch.int64)
            lengths = r - j0
        else:
            jj, ll = torch.triu_indices(r, r, 1, dtype=torch.int64)
            rest = jj * r + ll
            lengths = (r - j0) * (r - j0 - 1) // 2
        starts = rest.numel() - lengths
        owner = torch.repeat_interleave(torch.arange(m, dtype=torch.int64), lengths)
        first_pos = torch.cumsum(lengths, 0) - lengths
        local = torch.arange(owner.numel(), dtype=torch.int64) - first_pos[owner]
        index = (rest[starts[owner] + local] + owner * per_first).to(torch.int32)
        lo, hi = _tuple_offset(c, k, a), _tuple_offset(c, k, a + m)
        if index.numel() != hi - lo:  # pragma: no cover - an internal invariant
            raise RuntimeError(f"chunk plan of c={c}, k={k} at neuron {a} picks {index.numel()} tuples, not {hi - lo}")
        # host-built index: an asynchronous copy, so the first update of a device loop does not wait either
        plan.append(_Chunk(a, m, js, r, lo, hi, index.to(device, non_blocking=True)))
        a += m
    return plan


# ----------------------------------------------------------------------------- k-activation
@dataclass(frozen=True)
class NeuronCoverageResult:
    """Neuron k-activation coverage of one layer (Cheng et al. 2018, §II-B, eq. (2)).

    ``value = covered / total`` with ``total = C(c, k)·2^k``. ``per_neuron[i]`` is the share of
    the ``C(c-1, k-1)·2^k`` cells neuron i takes part in that are occupied. ``least_covered``
    lists up to 10 neurons whose share is below 1, lowest share first (ties by index), as
    ``(neuron, share)``. ``missing_patterns`` lists the first (up to 10) missing cells as
    ``(neurons, states)`` — e.g. ``((3, 17), (0, 1))`` = "no input has n3 off and n17 on" — in
    tuple order (combinations order), then pattern order (``itertools.product`` over {0,1}^k).
    """

    value: float
    covered: int
    total: int
    k: int
    n_neurons: int
    n_inputs: int
    activation_threshold: float
    per_neuron: tuple[float, ...]
    least_covered: tuple[tuple[int, float], ...]
    missing_patterns: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]

    @property
    def missing(self) -> int:
        """Number of missing (unoccupied) cells."""
        return self.total - self.covered

    def detail(self, max_items: int = 3) -> str:
        """``k=2, 130,560/130,816 cells, 1,000 inputs; least covered: n17 0.50, …; missing: n3=0 n17=1, …``."""
        text = (
            f"k={self.k}, {_fmt_int(self.covered)}/{_fmt_int(self.total)} cells, "
            f"{_fmt_int(self.n_inputs)} input{'s' if self.n_inputs != 1 else ''}"
        )
        if self.activation_threshold != 0.0:
            text += f", on > {self.activation_threshold:g}"
        if max_items > 0 and self.least_covered:
            shown = [f"n{i} {share:.2f}" for i, share in self.least_covered[:max_items]]
            more = ", …" if len(self.least_covered) > max_items else ""
            text += f"; least covered: {', '.join(shown)}{more}"
        if max_items > 0 and self.missing_patterns:
            shown = [
                " ".join(f"n{n}={s}" for n, s in zip(neurons, states))
                for neurons, states in self.missing_patterns[:max_items]
            ]
            more = ", …" if self.missing > max_items else ""
            text += f"; missing: {', '.join(shown)}{more}"
        return text

    def summary(self, max_items: int = 3) -> str:
        """One line: ``0.998 (k=2, 130,560/130,816 cells, …)``."""
        return f"{self.value:.3f} ({self.detail(max_items)})"

    def to_details(self) -> dict[str, object]:
        """JSON-able details (plain str/int/float/bool/list/dict only).

        ``per_neuron_coverage`` (for plots; the shares of ``per_neuron``) is left out for layers of
        more than :data:`PER_NEURON_PLOT_LIMIT` neurons.
        """
        details: dict[str, object] = {
            "metric": "neuron_k_activation",
            "value": float(self.value),
            "covered": int(self.covered),
            "total": int(self.total),
            "missing": int(self.missing),
            "k": int(self.k),
            "n_neurons": int(self.n_neurons),
            "n_inputs": int(self.n_inputs),
            "activation_threshold": float(self.activation_threshold),
            "per_neuron": [float(v) for v in self.per_neuron],
            "least_covered": [{"neuron": int(i), "share": float(s)} for i, s in self.least_covered],
            "missing_patterns": [
                {"neurons": [int(n) for n in neurons], "states": [int(s) for s in states]}
                for neurons, states in self.missing_patterns
            ],
        }
        if self.n_neurons <= PER_NEURON_PLOT_LIMIT:
            # per neuron: the share of the on/off patterns of the k-tuples containing it that are covered
            details["per_neuron_coverage"] = [float(v) for v in self.per_neuron]
        return details


class NeuronKActivationEngine(Engine):
    """Neuron k-activation coverage M_neu-k-act (Cheng et al. 2018, §II-B, eq. (2)).

    Args:
        n_neurons: c, the number of neurons (channels) of the layer.
        k: tuple size, 1 ≤ k ≤ min(3, c). k = 1 is on/off coverage of single neurons (2c cells).
        activation_threshold: a neuron is on iff its activation is > this (default 0.0).
        device: where the states live and the products run (default CPU).

    States: ``occupied`` (bool ``(C(c, k), 2^k)``, reduce ``or``; layout in the module docstring)
    and ``n_inputs`` (int64 scalar, reduce ``sum``).

    Cost: k = 2 is one ``c × c`` product per pass of min(2**22, 2**24/c) rows while most pairs are
    open, then, on the CPU, work on the open pairs only (:mod:`.open_pairs`; a few host syncs per pass; on an
    accelerator the dense product stays, with no sync); k = 3 about
    ``N·c³/3`` multiply-adds (chunked) plus one pass over the ``c³/3`` block entries per pass of
    rows. A per-chunk int32 index (4 bytes per tuple) is built on the first update or compute.
    """

    def __init__(
        self,
        n_neurons: int,
        k: int = 2,
        activation_threshold: float = 0.0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(device)
        c = check_count(n_neurons, "n_neurons", 1, maximum=None, fix="pass the layer's number of neurons (channels)")
        k = check_count(k, "k", 1, maximum=3, fix="use k=1 (single neurons), 2 (pairs, the paper's choice) or 3 (triples)")
        if k > c:
            raise ConfigError(
                f"k={k} needs at least {k} neurons but n_neurons={c}; use k ≤ {c} or a wider layer"
            )
        threshold = _check_threshold(activation_threshold)
        n_tuples = math.comb(c, k)
        cells = n_tuples * 2**k
        if cells > MAX_NEURON_CELLS:
            raise ConfigError(
                f"k={k} over n_neurons={c} gives {_fmt_int(cells)} cells (limit {_fmt_int(MAX_NEURON_CELLS)}, "
                f"one byte each); use a smaller k, or measure a subset of the channels"
            )
        self.n_neurons = c
        self.k = k
        self.activation_threshold = threshold
        self.n_tuples = n_tuples
        self.total_cells = cells
        self._plan: list[_Chunk] | None = None
        self._open: OpenPairs | None = None  # k = 2: the incomplete pairs, rebuilt when the state changed
        self._dense_left = 0  # dense blocks to run before the list is built again
        self._dense_wait = 1
        self.add_state("occupied", torch.zeros(n_tuples, 2**k, dtype=torch.bool), reduce="or")
        self.add_state("n_inputs", torch.zeros((), dtype=torch.int64), reduce="sum")

    def config(self) -> dict[str, Any]:
        return {"n_neurons": self.n_neurons, "k": self.k, "activation_threshold": self.activation_threshold}

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], device: torch.device | str | None = None
    ) -> NeuronKActivationEngine:
        return cls(
            int(config["n_neurons"]),
            k=int(config.get("k", 2)),
            activation_threshold=float(config.get("activation_threshold", 0.0)),
            device=device,
        )

    @classmethod
    def of(cls, activations: Tensor, *, k: int = 2, activation_threshold: float = 0.0) -> NeuronKActivationEngine:
        """An engine sized for ``activations`` ``(N, c)``, on their device, with them folded in: one torchrun
        rank's rows of a layer, ready to be merged with the other ranks' (occupied cells ``or``, inputs ``sum``)."""
        engine = cls(activations.shape[1], k=k, activation_threshold=activation_threshold, device=activations.device)
        engine.update(activations)
        return engine

    def _move_buffers(self, device: torch.device) -> None:
        self._plan = None  # rebuilt lazily on the new device
        self._open = None

    def _chunks(self) -> list[_Chunk]:
        if self._plan is None:
            self._plan = _build_plan(self.n_neurons, self.k, self.device)
        return self._plan

    # ------------------------------------------------------------------ update
    def update(self, activations: Tensor, *, validate: bool = True) -> None:
        """Fold a batch of activations ``(N, c)`` into the occupied cells.

        With ``validate`` (default) a finiteness check costs one host sync per call (NaN/inf
        raise :class:`DataError`); pass ``validate=False`` for trusted data in a device loop.
        """
        acts = _check_activations(activations, self.n_neurons, validate, "neuron k-activation")
        n = acts.shape[0]
        if n == 0:
            return
        # asynchronous only towards an accelerator: a device-to-host copy must complete before the CPU reads it
        acts = acts.to(self.device, non_blocking=self.device.type != "cpu")
        self.n_inputs += n
        rows = max(1, min(_MAX_PASS_ROWS, _PASS_ELEMS // self.n_neurons))
        for start in range(0, n, rows):
            chunk = acts[start : start + rows]
            if self.k == 1:
                self._update_k1(chunk > self.activation_threshold)
                continue
            b = torch.empty(chunk.shape, dtype=torch.float32, device=chunk.device)
            torch.gt(chunk, self.activation_threshold, out=b)  # B ∈ {0, 1} written as float32 directly
            if self.k == 2:
                self._update_k2(b)
            else:
                self._update_k3(b)

    def _words(self) -> Tensor:
        """The state viewed as one 2^k-byte word per tuple (OR of words = OR of the bools)."""
        if not self.occupied.is_contiguous():
            self.occupied = self.occupied.contiguous()
        return self.occupied.view(_WORD[self.k]).reshape(-1)

    def _fold(self, ch: _Chunk, flags: Tensor) -> None:
        """OR a chunk's pattern flags (block shape + (2^k,), contiguous) into its slice of the state."""
        words = flags.view(_WORD[self.k]).reshape(-1)
        self._words()[ch.lo : ch.hi] |= words.index_select(0, ch.index)

    def _update_k1(self, on: Tensor) -> None:
        s = on.sum(0)
        self.occupied[:, 1] |= s > 0
        self.occupied[:, 0] |= s < on.shape[0]

    def _update_k2(self, b: Tensor) -> None:
        n = float(b.shape[0])
        s = b.sum(0)
        self._words()  # contiguous state
        pairs = self._open
        if pairs is None or not pairs.matches(self.occupied):
            pairs = self._open = None
            if self._dense_left > 0:  # the open pairs' product was too large lately: no list for now
                self._dense_left -= 1
            elif b.device.type == "cpu":  # the list reads sizes on the host; an accelerator's dense product needs none
                pairs = self._open = OpenPairs.build(self.occupied, self.n_neurons)
        if pairs is not None:
            if pairs.fold(self.occupied, b, s):
                self._dense_wait = 1
                return  # only the open pairs were touched (see .open_pairs)
            self._dense_left = self._dense_wait  # back off: try again after 1, 2, 4, … dense blocks
            self._dense_wait = min(2 * self._dense_wait, 64)
        for ch in self._chunks():
            p = b[:, ch.a : ch.a + ch.m].T @ b[:, ch.js :]  # (m, r) pair co-activation counts
            si = s[ch.a : ch.a + ch.m].unsqueeze(1)
            sj = s[ch.js :].unsqueeze(0)
            flags = torch.empty((ch.m, ch.r, 4), dtype=torch.bool, device=b.device)
            torch.gt(p, si + sj - n, out=flags[..., 0])  # 00: N - S_i - S_j + P > 0
            torch.lt(p, sj, out=flags[..., 1])  # 01: S_j - P > 0
            torch.lt(p, si, out=flags[..., 2])  # 10: S_i - P > 0
            torch.gt(p, 0, out=flags[..., 3])  # 11: P > 0
            self._fold(ch, flags)
        self._open = None  # rebuilt (smaller) on the next block of rows

    def _update_k3(self, b: Tensor) -> None:
        n_rows = b.shape[0]
        n = float(n_rows)
        s = b.sum(0)
        p = b.T @ b
        for ch in self._chunks():
            m, r, js = ch.m, ch.r, ch.js
            first = b[:, ch.a : ch.a + m]
            rest = b[:, js:]
            t = torch.zeros((m * r, r), dtype=torch.float32, device=b.device)
            slab = max(1, _SLAB_ELEMS // (m * r))
            for r0 in range(0, n_rows, slab):
                pairs = (first[r0 : r0 + slab, :, None] * rest[r0 : r0 + slab, None, :]).reshape(-1, m * r)
                t.addmm_(pairs.T, rest[r0 : r0 + slab])
            t = t.reshape(m, r, r)  # T[i, j, l] = # inputs with i, j and l on
            pij = p[ch.a : ch.a + m, js:]  # (m, r): P_ij, and P_il on the last axis
            pjl = p[js:, js:]  # (r, r)
            si = s[ch.a : ch.a + m]
            sj = s[js:]
            p_first = pij.unsqueeze(2)  # P_ij broadcast over l
            p_third = pij.unsqueeze(1)  # P_il broadcast over j
            q = (pij - si.unsqueeze(1)).unsqueeze(2) + p_third  # P_ij + P_il - S_i
            flags = torch.empty((m, r, r, 8), dtype=torch.bool, device=b.device)
            # patterns by bits (s_i s_j s_l); count > 0 written as comparisons with T
            torch.lt(t, q + (n + pjl - sj.unsqueeze(1) - sj.unsqueeze(0)), out=flags[..., 0])  # 000
            torch.gt(t, p_third + (pjl - sj.unsqueeze(0)), out=flags[..., 1])  # 001: S_l - P_il - P_jl + T
            torch.gt(t, p_first + (pjl - sj.unsqueeze(1)), out=flags[..., 2])  # 010: S_j - P_ij - P_jl + T
            torch.lt(t, pjl, out=flags[..., 3])  # 011: P_jl - T
            torch.gt(t, q, out=flags[..., 4])  # 100: S_i - P_ij - P_il + T
            torch.lt(t, p_third, out=flags[..., 5])  # 101: P_il - T
            torch.lt(t, p_first, out=flags[..., 6])  # 110: P_ij - T
            torch.gt(t, 0, out=flags[..., 7])  # 111: T
            self._fold(ch, flags)

    # ------------------------------------------------------------------ compute
    def tuple_counts(self) -> Tensor:
        """Occupied patterns per tuple (uint8, length C(c, k); 2^k means the tuple is complete)."""
        if not self.occupied.is_contiguous():
            self.occupied = self.occupied.contiguous()
        return self.occupied.view(torch.uint8).sum(1, dtype=torch.uint8)

    def per_neuron_occupied(self, per_tuple: Tensor | None = None) -> Tensor:
        """Occupied cells each neuron takes part in (int64, length c); out of ``C(c-1, k-1)·2^k``."""
        per_tuple = self.tuple_counts() if per_tuple is None else per_tuple
        if self.k == 1:
            return per_tuple.to(torch.int64)
        per = torch.zeros(self.n_neurons, dtype=torch.int64, device=self.device)
        for ch in self._chunks():
            shape = (ch.m, ch.r) if self.k == 2 else (ch.m, ch.r, ch.r)
            block = torch.zeros(math.prod(shape), dtype=torch.uint8, device=self.device)
            block.index_copy_(0, ch.index.to(torch.int64), per_tuple[ch.lo : ch.hi])
            block = block.reshape(shape)
            if self.k == 2:
                per[ch.a : ch.a + ch.m] += block.sum(1, dtype=torch.int64)
                per[ch.js :] += block.sum(0, dtype=torch.int64)
            else:
                per[ch.a : ch.a + ch.m] += block.sum((1, 2), dtype=torch.int64)
                per[ch.js :] += block.sum((0, 2), dtype=torch.int64) + block.sum((0, 1), dtype=torch.int64)
        return per

    def tuples_of(self, indices: Tensor) -> Tensor:
        """The neuron tuples (``len × k``, int64) of the given rows of ``occupied`` (tuple indices)."""
        c, k = self.n_neurons, self.k
        t = indices.to(torch.int64).cpu().reshape(-1)
        if k == 1:
            return t.reshape(-1, 1)
        firsts = torch.tensor([_tuple_offset(c, k, i) for i in range(c - k + 2)], dtype=torch.int64)
        i = torch.searchsorted(firsts, t, right=True) - 1
        rem = t - firsts[i]
        if k == 2:
            return torch.stack([i, i + 1 + rem], dim=1)
        # k = 3: rem ranks the pair (j, l) among neurons i+1..c-1; with h(x) = C(x, 2) and
        # x = c - j, the pair's j is the largest with C(c-i-1, 2) - C(c-j, 2) <= rem.
        comb2 = torch.tensor([math.comb(x, 2) for x in range(c + 1)], dtype=torch.int64)
        target = comb2[c - i - 1] - rem
        x = torch.searchsorted(comb2, target, right=False)
        j = c - x
        l = j + 1 + rem - (comb2[c - i - 1] - comb2[c - j])
        return torch.stack([i, j, l], dim=1)

    def missing_cells(
        self, limit: int | None = 10, per_tuple: Tensor | None = None
    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The missing cells as ``(neurons, states)``, tuple order then pattern order; first ``limit``."""
        per_tuple = self.tuple_counts() if per_tuple is None else per_tuple
        holes = torch.nonzero(per_tuple < 2**self.k).reshape(-1)
        if limit is not None:
            holes = holes[:limit]
        if holes.numel() == 0:
            return []
        missing = ~self.occupied[holes].cpu()  # (tuples, patterns)
        pairs = torch.nonzero(missing)  # row-major: tuple order, then pattern order
        if limit is not None:
            pairs = pairs[:limit]
        neurons = self.tuples_of(holes.cpu()[pairs[:, 0]]).tolist()
        k = self.k
        return [
            (tuple(int(v) for v in tup), tuple((int(p) >> (k - 1 - b)) & 1 for b in range(k)))
            for tup, p in zip(neurons, pairs[:, 1].tolist())
        ]

    def compute(self) -> NeuronCoverageResult:
        """Coverage, per-neuron shares and the first missing cells (syncs to the host)."""
        per_tuple = self.tuple_counts()
        covered = int(per_tuple.sum())
        total = self.total_cells
        per_total = math.comb(self.n_neurons - 1, self.k - 1) * 2**self.k
        shares = (self.per_neuron_occupied(per_tuple).to(torch.float64) / per_total).cpu()
        share_list = [float(v) for v in shares.tolist()]
        order = sorted(range(self.n_neurons), key=lambda i: (share_list[i], i))
        least = tuple((i, share_list[i]) for i in order[:10] if share_list[i] < 1.0)
        return NeuronCoverageResult(
            value=covered / total,
            covered=covered,
            total=total,
            k=self.k,
            n_neurons=self.n_neurons,
            n_inputs=int(self.n_inputs),
            activation_threshold=self.activation_threshold,
            per_neuron=tuple(share_list),
            least_covered=least,
            missing_patterns=tuple(self.missing_cells(10, per_tuple)),
        )
