"""The backward half of CROWN (Zhang et al. 2018) for :class:`~pytest_dnnsafety.engines.bounds.model.BoundedModel`.

:class:`BoundState` holds one call's ops (from :mod:`.ops`), the IBP bounds of every node
(Gowal et al. 2018), the tightened bounds of the inputs of the nonlinear nodes and their
relaxations, and runs the backward linear bound propagation:

* :meth:`BoundState.lower` — lower bounds of linear functions ``rows·z_t`` of a node ``t``:
  coefficients go backward through the graph in reverse topological order (a node's consumers
  first; residual branches accumulate), through the affine ops' transposes and the nonlinear
  ops' relaxations, and are concretised over the input box as ``A·centre − |A|·radius + bias``.
  Rows shared by the whole batch (identity specs) first go through the affine nodes in front of
  the nonlinearities once, for all samples ("shared phase"); then each batch chunk continues
  with its own relaxations, bounding only the rows that are needed (gathered per sample).
* Intermediate bounds (:meth:`BoundState._bounds`): every ReLU/max-pool input is bounded by CROWN
  back from that node, intersected with IBP; a ReLU output's bounds are the ReLU of its input's.
  Only neurons whose bounds can change a relaxation are bounded: IBP-unstable ReLU inputs (plus
  the possibly-positive ones when the ReLU feeds a max-pool); a max-pool fed directly needs all.
* A node whose only nonlinear ancestor is one ReLU fed by an affine map of the input (the second
  layer's pre-activations) is bounded in closed form (:meth:`BoundState._one_relu_bounds`): the
  same CROWN bounds, computed by pushing the columns of the relaxed Jacobian forward through the
  affine layers instead of thousands of rows backward.
* The affine nodes in front of the first nonlinearity collapse into dense Jacobians when the
  input is small (:meth:`BoundState._dense_tail`).
* A ReLU's transpose multiplies by its lower slope everywhere and redoes only the unstable neurons
  (:meth:`~.ops.ReluOp.back_sparse`, gathered per sample, when they are at most :data:`SPARSE_SHARE`
  of the layer); a convolution's transpose runs on channels-last data on the CPU for images of 16x16
  and up (:data:`~.ops.CHANNELS_LAST_PIXELS`), which the ReLUs keep. Against auto_LiRPA 0.7.1's
  CROWN (ResNet-18 width 4 at 32x32, 1 thread) these took the plugin from 0.45x to 1.25x its speed,
  at equal bounds; 1.30x on a quiet machine (tests/benchmarks/test_bench_crown_reference.py).
* IBP of a specification (:meth:`BoundState.spec_ibp`, :meth:`BoundState.folded_spec_ibp`): the
  spec's rows go back through the affine ops at the end of the graph (the same sweep, stopped at
  the last nonlinearities) and are concretised over those nodes' IBP intervals.

Intermediate neurons are chosen by *refined* IBP (:meth:`BoundState._interval`: intervals
re-propagated from the CROWN bounds already found, not from the input box alone): deep in a
ResNet plain IBP calls nearly every neuron unstable (layer1.1.bn1 of a width-16 ResNet-18 at
ε = 1/255: 15,819 of 16,384) where CROWN leaves a few hundred (359), so the rows, each a
backward pass to the input, are bounded for far fewer neurons. The rows are unit vectors built
per chunk for the union of the neurons the batch needs (never an ``n × n`` identity).

Memory: no coefficient tensor holds more than ``max_elements`` values (chunks over the batch and
over the rows), sized with the batch's parts by :func:`memory_plan` from the ``max_memory``
budget. Pure torch; no pytest import.

Host reads: by default the chunks are sized by the data (how many neurons of each sample are
unstable, how many rows each sample needs), which spares the work on the stable ones but reads
those counts on the host: on an accelerator a few synchronisations per call (one per bounded
intermediate node and chunk of rows). With :data:`HOST_SIZING` ``False`` the chunks are sized
from shapes alone: every row is swept and the rows not needed are masked to ``−inf`` afterwards
(the same bounds up to rounding, no host synchronisation, more arithmetic). Measured on an H100
(digits CNN, verify_robustness of 1024 inputs, warm): 0.14–0.20 s sized by the counts, 0.44–0.50 s
by shapes in batches of 256 (0.60 s and 0.86–1.01 s in batches of 64) — the extra work costs
more than the synchronisations, hence the default.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from pytest_dnnsafety.runtime.allocator import release
from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.engines.bounds.ops import Op, ReluOp, ReshapeOp, _row_dot

__all__ = ["BoundState", "DEFAULT_MAX_MEMORY", "memory_plan"]

#: A dense Jacobian of the affine layers before the first nonlinearity is kept when it has at most this many values.
_DENSE_LIMIT = 1 << 22
#: ... and the input has at most this many values.
_DENSE_INPUTS = 4096
#: CROWN's default working-memory budget (bytes): half for the coefficient tensors, half for the per-input state
#: of the batch (see :func:`memory_plan`). A fixed size rather than a share of the machine's memory, so that a
#: run's memory does not depend on what else is running; 2 GiB fits CI runners (7 GB and up) with the model and
#: the data loader beside it.
DEFAULT_MAX_MEMORY = 2 << 30
#: The work half of the budget over the largest coefficient tensor: a sweep holds a node's pending coefficients,
#: a residual branch's, the relaxation's temporaries and the convolutions' reorders, and glibc's heap fragments
#: around them. Measured (peak RSS growth, ResNet-18-style width 16 at 32x32, CPU): 67 MiB at max_memory=128MiB,
#: 458 MiB at 1GiB; with 16 instead, 1.1 GiB at 512MiB.
WORK_COPIES = 64
#: Values kept per input and per node value of the graph (IBP interval, refined interval, bounds, relaxations, the
#: rows' results and their temporaries).
STATE_COPIES = 12


def memory_plan(max_memory: int, itemsize: int, ops: list[Op] | None = None) -> tuple[int, int]:
    """``(max_elements, inputs per part)`` for a budget of ``max_memory`` bytes.

    Half the budget bounds the coefficient tensors of the backward passes (``max_elements``
    values, :data:`WORK_COPIES` of them alive at once), the other half the per-input state of
    the graph (:data:`STATE_COPIES` values per node value): a batch is bounded in parts of at
    most that many inputs (at least one). Without ``ops`` the second number is 0.
    """
    work = max_memory // 2
    max_elements = max(1, work // (itemsize * WORK_COPIES))
    if ops is None:
        return max_elements, 0
    per_input = sum(op.numel for op in ops) * itemsize * STATE_COPIES
    return max_elements, max(1, (max_memory - work) // per_input)


#: A ReLU goes backward through :meth:`~.ops.ReluOp.back_sparse` (the sign-dependent relaxation on its unstable
#: neurons only) when a sample's unstable neurons are at most this share of its neurons, else the dense way.
SPARSE_SHARE = 0.25
#: Size chunks by data-dependent counts read on the host (True: less work) or by shapes alone (False: no host
#: synchronisation; see the module docstring).
HOST_SIZING: bool = True


class BoundState:
    """One call's ops, IBP bounds, tightened intermediate bounds and relaxations (see the module docstring)."""

    def __init__(self, ops: list[Op], out: int, x_lo: Tensor, x_hi: Tensor, max_elements: int) -> None:
        self.ops, self.out, self.x_lo, self.x_hi = ops, out, x_lo, x_hi
        self.max_elements = max_elements
        self.batch = x_lo.shape[0]
        self.host_sizing = bool(HOST_SIZING)
        self.centre, self.radius = (x_lo + x_hi) / 2, (x_hi - x_lo) / 2
        n = len(self.ops)
        self.consumers: list[list[int]] = [[] for _ in range(n)]
        for i, op in enumerate(self.ops):
            for j in set(op.inputs):
                self.consumers[j].append(i)
        self.ancestors: list[set[int]] = []
        for i, op in enumerate(self.ops):
            self.ancestors.append({i}.union(*(self.ancestors[j] for j in op.inputs)))
        self.ivs: list[tuple[Tensor, Tensor]] = [(x_lo, x_hi)]
        for op in self.ops[1:]:
            self.ivs.append(op.ibp([self.ivs[j] for j in op.inputs]))
        self.bounds: dict[int, tuple[Tensor, Tensor]] = {0: (x_lo, x_hi)}
        self.refined: dict[int, tuple[Tensor, Tensor]] = {}
        self.relaxations: dict[int, tuple[Tensor, ...]] = {}
        #: per ReLU, its unstable neurons' index and relaxation (see ReluOp.back_sparse), or None
        self.sparse: dict[int, tuple[Tensor, ...] | None] = {}
        self.dense = self._dense_tail()
        #: called ``(target node, share of its rows done)`` after each chunk of rows (progress; see crown_ibp.Meter)
        self.meter: Callable[[int, float], None] | None = None

    def _dense_tail(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Dense Jacobians ``(numel_v, n_in)`` and offsets of the affine nodes before any nonlinearity.

        Fills ``self.tail`` (every such node, the input included) and returns the ones the
        backward sweep uses (not the relayouts, whose own transpose is free).
        """
        self.tail: dict[int, tuple[Tensor, Tensor]] = {}
        n_in = math.prod(self.ops[0].out_shape)
        if n_in > _DENSE_INPUTS:
            return {}
        reach = {0}  # the nodes a dense Jacobian would be kept for (decided from shapes before building any)
        for i, op in enumerate(self.ops[1:], 1):
            if op.linear and all(j in reach for j in op.inputs) and op.numel * n_in <= _DENSE_LIMIT:
                reach.add(i)
        if all(isinstance(self.ops[i], ReshapeOp) for i in reach):  # nothing to collapse: spare the n_in² identity
            return {}
        dtype, device = self.centre.dtype, self.centre.device
        basis = {0: torch.eye(n_in, dtype=dtype, device=device).reshape(n_in, *self.ops[0].out_shape)}
        offset = {0: torch.zeros((1, *self.ops[0].out_shape), dtype=dtype, device=device)}
        dense: dict[int, tuple[Tensor, Tensor]] = {}
        for i, op in enumerate(self.ops):
            if i and (not op.linear or any(j not in basis for j in op.inputs) or op.numel * n_in > _DENSE_LIMIT):
                continue
            if i:
                basis[i] = op.forward([basis[j] for j in op.inputs], bias=False)
                offset[i] = op.forward([offset[j] for j in op.inputs])
            self.tail[i] = (basis[i].reshape(n_in, -1).T.contiguous(), offset[i].reshape(-1))
            if i and not isinstance(op, ReshapeOp):
                dense[i] = self.tail[i]
        return dense

    # ------------------------------------------------------------------ specs
    def spec(self, spec: Tensor | None, batch: int | None = None) -> tuple[Tensor, bool]:
        """``spec`` as ``(Bs, K, *out_shape)`` and whether it is shared (Bs = 1); per-sample specs fit ``batch``."""
        batch = self.batch if batch is None else batch
        out_shape = self.ops[self.out].out_shape
        n = math.prod(out_shape)
        dtype, device = self.centre.dtype, self.centre.device
        if spec is None:
            return torch.eye(n, dtype=dtype, device=device).reshape(1, n, *out_shape), True
        spec = torch.as_tensor(spec).detach().to(device=device, dtype=dtype, non_blocking=device.type != "cpu")
        if spec.ndim >= 2 and (tuple(spec.shape[-len(out_shape):]) == out_shape or spec.shape[-1] == n):
            per_row = len(out_shape) if tuple(spec.shape[-len(out_shape):]) == out_shape else 1
            lead = tuple(spec.shape[:spec.ndim - per_row])
            if len(lead) == 1 and lead[0] > 0:  # (K, ...): shared by the batch
                return spec.reshape(1, lead[0], *out_shape), True
            if len(lead) == 2 and lead[0] in (1, batch) and lead[1] > 0:
                return spec.reshape(lead[0], lead[1], *out_shape), lead[0] == 1
        raise DataError(f"spec of shape {tuple(spec.shape)} does not fit {batch} inputs and outputs of "
                        f"per-sample shape {out_shape}; expected (B, K, {n}) or (K, {n}).")

    def spec_ibp(self, spec: Tensor, fold: bool = True) -> tuple[Tensor, Tensor]:
        """IBP bounds ``(B, K)`` of ``spec·output`` (``spec`` ``(Bs, K, *out_shape)``, Bs 1 or B).

        ``fold=False``: from the output's interval (``spec⁺·hi + spec⁻·lo``, the logits bounded, then
        combined). ``fold=True``: that, intersected with :meth:`folded_spec_ibp` (the spec folded
        into the affine layers at the end of the network), so never looser.
        """
        lo, hi = self.ivs[self.out]
        c, r = ((lo + hi) / 2).flatten(1), ((hi - lo) / 2).flatten(1)
        s = spec.flatten(2)
        mid = torch.matmul(s, c.unsqueeze(-1)).squeeze(-1)
        rad = torch.matmul(s.abs(), r.unsqueeze(-1)).squeeze(-1)
        if not fold:
            return mid - rad, mid + rad
        f_lo, f_hi = self.folded_spec_ibp(spec)
        return torch.maximum(mid - rad, f_lo), torch.minimum(mid + rad, f_hi)

    def folded_spec_ibp(self, spec: Tensor) -> tuple[Tensor, Tensor]:
        """IBP bounds ``(B, K)`` of ``spec·output`` with the spec folded into the network's affine tail.

        The rows of ``spec`` go backward through the affine ops at the end of the graph (for a
        classifier: ``C·W`` and ``C·b`` of its last linear layer, with ``C`` the margin spec
        ``e_y − e_j``; through every affine op up to the last nonlinearities, residual sums
        included) and are concretised over the IBP intervals of the nodes where they stop:
        ``A·c + bias ± |A|·r``. As ``|A·W| ≤ |A|·|W|`` this is never looser than bounding the
        outputs first (the "elision of the last layer" of Gowal et al. 2018, §3, and the margin
        specification of auto_LiRPA's IBP); it is the same when the last op is nonlinear (nothing
        to fold). Chunked over the batch and rows within ``max_elements``; no host reads.
        """
        bs, k = spec.shape[:2]
        dtype, device = self.centre.dtype, self.centre.device
        widest = max(self.ops[i].numel for i in self.ancestors[self.out])
        k_chunk = max(1, min(k, self.max_elements // widest))
        # shared rows (bs = 1) go back once for the whole batch; per-sample rows in chunks of samples
        b_chunk = self.batch if bs == 1 else max(1, self.max_elements // (k_chunk * widest))
        mids = torch.empty((self.batch, k), dtype=dtype, device=device)
        rads = torch.empty_like(mids)
        for k0 in range(0, k, k_chunk):
            k1 = min(k, k0 + k_chunk)
            for b0 in range(0, self.batch, b_chunk):
                b1 = min(self.batch, b0 + b_chunk)
                pending = {self.out: spec[:, k0:k1] if bs == 1 else spec[b0:b1, k0:k1]}
                bias = self._sweep(self.out, pending, None, set(), None)  # affine ops only: stops at the frontier
                mid = torch.zeros((b1 - b0, k1 - k0), dtype=dtype, device=device)
                if bias is not None:
                    mid = mid + bias
                rad = torch.zeros_like(mid)
                for j, a in pending.items():  # the frontier: nonlinear nodes, affine nodes feeding one, the input
                    lo, hi = (t[b0:b1] for t in self.ivs[j])
                    mid = mid + _row_dot(a, (lo + hi) / 2)
                    rad = rad + _row_dot(a.abs(), (hi - lo) / 2)
                mids[b0:b1, k0:k1], rads[b0:b1, k0:k1] = mid, rad
        return mids - rads, mids + rads

    # ------------------------------------------------------------------ intermediate bounds
    def _ensure(self, target: int) -> None:
        """Relaxations of every nonlinear ancestor of ``target`` (in topological order)."""
        for i in sorted(self.ancestors[target]):
            op = self.ops[i]
            if op.linear or i in self.relaxations:
                continue
            p = op.inputs[0]
            lo, hi = self._bounds(p)
            self.relaxations[i] = op.relax(lo, hi)
            if isinstance(op, ReluOp) and self.host_sizing:  # the unstable neurons' index (one host read)
                self.sparse[i] = op.unstable_index(self.relaxations[i], SPARSE_SHARE)

    def _interval(self, p: int) -> tuple[Tensor, Tensor]:
        """IBP bounds of ``p`` propagated from the tightest bounds known of its ancestors (refined IBP).

        Interval propagation restarted from every ancestor already bounded by CROWN (and
        intersected with plain IBP): sound, and never looser than :attr:`ivs`. Deep in a network
        plain IBP calls almost every neuron unstable (its looseness compounds layer by layer),
        while one or two affine layers after CROWN-tight bounds leave few: only those need CROWN
        rows (:meth:`_needed`). An entry is computed once; bounds found later are not folded back
        into it (still sound, at most looser; the order of computation is fixed, so is the result).
        """
        if p in self.refined:
            return self.refined[p]
        for i in sorted(self.ancestors[p]):
            if i in self.refined:
                continue
            lo, hi = self.ivs[i]
            if i:
                op = self.ops[i]
                r_lo, r_hi = op.ibp([self.refined[j] for j in op.inputs])
                lo, hi = torch.maximum(r_lo, lo), torch.minimum(r_hi, hi)
            if i in self.bounds:
                b_lo, b_hi = self.bounds[i]
                lo, hi = torch.maximum(b_lo, lo), torch.minimum(b_hi, hi)
            self.refined[i] = (lo, hi)
        return self.refined[p]

    def _bounds(self, p: int) -> tuple[Tensor, Tensor]:
        if p in self.bounds:
            return self.bounds[p]
        op = self.ops[p]
        ibp_lo, ibp_hi = self.ivs[p]
        if isinstance(op, ReluOp):  # bounds of a ReLU's output: ReLU of its input's (tightest possible)
            lo, hi = self._bounds(op.inputs[0])
            result = (torch.maximum(lo.clamp(min=0), ibp_lo), torch.minimum(hi.clamp(min=0), ibp_hi))
        elif (closed := self._one_relu_bounds(p)) is not None:
            lo, hi = closed
            # as in _crown_bounds (the same bounds whichever path is taken, so chunking changes nothing): CROWN
            # for the neurons that need it, the refined interval for the others
            ibp_lo, ibp_hi = self._interval(p)
            lo = torch.maximum(lo.reshape(ibp_lo.shape), ibp_lo)
            hi = torch.minimum(hi.reshape(ibp_hi.shape), ibp_hi)
            needed = self._needed(p)
            if needed is not None:
                needed = needed.reshape(ibp_lo.shape)
                lo, hi = torch.where(needed, lo, ibp_lo), torch.where(needed, hi, ibp_hi)
            result = (lo, hi)
        else:
            result = self._crown_bounds(p)
        self.bounds[p] = result
        if self.meter is not None:  # done, whichever path bounded it (closed form, few rows or none)
            self.meter(p, 1.0)
        if p in self.refined:
            self.refined[p] = result
        release()  # the sweeps' freed coefficient tensors back to the system (glibc keeps them in a fragmented heap)
        return result

    def _crown_bounds(self, p: int) -> tuple[Tensor, Tensor]:
        """CROWN bounds of the neurons of ``p`` that need them (:meth:`_needed`), refined IBP elsewhere.

        The rows are unit vectors ``±e_i``, built chunk by chunk inside :meth:`lower` (never the
        ``n × n`` identity), and only for the neurons some sample of the batch needs (read on the
        host; with :data:`HOST_SIZING` ``False``: all, masked per sample).
        """
        self._ensure(p)  # first the ancestors, so that the refined interval starts from their CROWN bounds
        op = self.ops[p]
        ibp_lo, ibp_hi = self._interval(p)
        shape = ibp_lo.shape
        n = op.numel
        needed = self._needed(p)
        cols = None
        if needed is not None and self.host_sizing:
            cols = torch.nonzero(needed.any(dim=0)).squeeze(1)  # the union over the batch (one host read)
            if cols.numel() == n:
                cols = None
            else:
                needed = needed[:, cols]
        k = n if cols is None else int(cols.numel())
        lo, hi = ibp_lo.flatten(1), ibp_hi.flatten(1)
        if k == 0:
            return ibp_lo, ibp_hi
        dtype, device = ibp_lo.dtype, ibp_lo.device
        index = torch.arange(n, device=device) if cols is None else cols

        def rows(k0: int, k1: int) -> Tensor:  # rows k0:k1 of [e_cols; −e_cols], shared by the batch
            at = torch.arange(k0, k1, device=device)
            out = torch.zeros((1, k1 - k0, n), dtype=dtype, device=device)
            sign = torch.where(at < k, 1.0, -1.0).to(dtype)
            out[0, at - k0, index[at % k]] = sign
            return out.reshape(1, k1 - k0, *op.out_shape)

        mask = None if needed is None else torch.cat([needed, needed], dim=1)
        low = self.lower(p, rows, True, mask, count=2 * k)
        c_lo, c_hi = low[:, :k], -low[:, k:]
        if cols is None:
            lo, hi = torch.maximum(c_lo, lo), torch.minimum(c_hi, hi)
        else:
            lo, hi = lo.clone(), hi.clone()
            lo[:, cols] = torch.maximum(c_lo, lo[:, cols])
            hi[:, cols] = torch.minimum(c_hi, hi[:, cols])
        return lo.reshape(shape), hi.reshape(shape)

    def _one_relu_bounds(self, p: int) -> tuple[Tensor, Tensor] | None:
        """CROWN bounds of ``p = chain(relu(v))`` with ``v = J·x + o`` affine in the input, in closed form.

        With the relaxation ``sl·v ≤ relu(v) ≤ su·v + bu`` and the chain's Jacobian ``C``, CROWN's
        lower bound is ``C·diag(sl)·v + C⁻·(diag(su − sl)·v + bu)`` (``C⁺`` for the upper bound);
        ``C·diag(sl)·J`` is the chain applied to the columns of ``diag(sl)·J`` (a forward pass of
        ``n_in + 1`` "inputs" per sample) and the correction runs over the unstable neurons only.
        Returns None when ``p`` is not of that form (or the Jacobians would not fit the budget).
        """
        anc = self.ancestors[p]
        nonlinear = [i for i in anc if not self.ops[i].linear]
        if len(nonlinear) != 1 or not isinstance(self.ops[nonlinear[0]], ReluOp):
            return None
        r = nonlinear[0]
        q = self.ops[r].inputs[0]
        region = [i for i in sorted(anc) if i != r and r in self.ancestors[i]]
        if q not in self.tail or any(j != r and j not in region for i in region for j in self.ops[i].inputs):
            return None
        jac, off = self.tail[q]
        (n_r, n_in), n_p, s_r = jac.shape, self.ops[p].numel, self.ops[r].out_shape
        widest = max(self.ops[i].numel for i in [r, *region])
        if max(n_p, widest) * max(n_r, n_in + 1) > self.max_elements:
            return None

        def chain(x: Tensor, bias: bool) -> Tensor:
            values = {r: x}
            for i in region:
                values[i] = self.ops[i].forward([values[j] for j in self.ops[i].inputs], bias=bias)
            return values[p].reshape(x.shape[0], -1)

        dtype, device = jac.dtype, jac.device
        cmat = chain(torch.eye(n_r, dtype=dtype, device=device).reshape(n_r, *s_r), False)  # (n_r, n_p): Cᵀ
        cbias = chain(torch.zeros((1, *s_r), dtype=dtype, device=device), True)[0]
        sl, su, bu = (t.flatten(1) for t in self.relaxations[r])
        d = su - sl  # non-zero exactly on the unstable neurons (and bu with it)
        counts = (d != 0).sum(dim=1)
        # the widest set of unstable neurons: read on the host, or (sync-free) every neuron, zero on the stable ones
        top = max(1, int(counts.max())) if self.host_sizing else n_r
        per_sample = max((n_in + 1) * widest, n_p * top, n_p * n_in) * 4
        step = max(1, self.max_elements // per_sample)
        los, his = [], []
        for b0 in range(0, self.batch, step):
            b1 = min(self.batch, b0 + step)
            bc = b1 - b0
            cols = torch.cat([sl[b0:b1, :, None] * jac, (sl[b0:b1] * off)[:, :, None]], dim=2)
            y = chain(cols.transpose(1, 2).reshape(bc * (n_in + 1), *s_r), False).reshape(bc, n_in + 1, n_p)
            # transposed layout: coefficient matrices (Bc, n_in, n_p), rows of the input
            g_mat, g_off = y[:, :n_in], y[:, n_in] + cbias
            lo_mat, hi_mat, lo_off, hi_off = g_mat, g_mat, g_off, g_off
            if not self.host_sizing:  # every neuron: d and bu are zero on the stable ones, which add exact zeros
                d_u = d[b0:b1]
                vec = (d_u[:, :, None] * jac).transpose(1, 2)  # (Bc, n_in, n_r)
                vb = (d_u * off + bu[b0:b1]).unsqueeze(1)  # (Bc, 1, n_r)
                neg, pos = cmat.clamp(max=0), cmat.clamp(min=0)  # (n_r, n_p), shared by the batch
                lo_mat, lo_off = g_mat + vec @ neg, g_off + (vb @ neg).squeeze(1)
                hi_mat, hi_off = g_mat + vec @ pos, g_off + (vb @ pos).squeeze(1)
            elif k := int(counts[b0:b1].max()):
                idx = torch.sort((d[b0:b1] != 0).to(torch.int8), dim=1, descending=True, stable=True).indices[:, :k]
                d_u = d[b0:b1].gather(1, idx)  # zero on padding (stable neurons)
                vec = (d_u[:, :, None] * jac[idx]).transpose(1, 2)  # (Bc, n_in, k)
                vb = (d_u * off[idx] + bu[b0:b1].gather(1, idx)).unsqueeze(1)  # (Bc, 1, k)
                c_u = cmat[idx]  # (Bc, k, n_p): the chain's rows for the unstable neurons
                neg, pos = c_u.clamp(max=0), c_u.clamp(min=0)
                lo_mat, lo_off = torch.baddbmm(g_mat, vec, neg), g_off + (vb @ neg).squeeze(1)
                hi_mat, hi_off = torch.baddbmm(g_mat, vec, pos), g_off + (vb @ pos).squeeze(1)
            c = self.centre[b0:b1].reshape(bc, 1, n_in)
            rad = self.radius[b0:b1].reshape(bc, 1, n_in)
            los.append(lo_off + (c @ lo_mat).squeeze(1) - (rad @ lo_mat.abs()).squeeze(1))
            his.append(hi_off + (c @ hi_mat).squeeze(1) + (rad @ hi_mat.abs()).squeeze(1))
        return torch.cat(los), torch.cat(his)

    def _needed(self, p: int) -> Tensor | None:
        """Which neurons of ``p`` (B, n) need CROWN bounds, or None for all.

        A ReLU consumer needs only IBP-unstable ones; a ReLU whose output feeds a max-pool also
        needs those that may be positive; a direct max-pool (or anything else) needs all.
        """
        lo, hi = (t.flatten(1) for t in self._interval(p))
        mask = torch.zeros_like(lo, dtype=torch.bool)
        for c in self.consumers[p]:
            op = self.ops[c]
            if op.linear:
                continue
            if not isinstance(op, ReluOp):
                return None
            mask |= (lo < 0) & (hi > 0)
            if any(not self.ops[d].linear and not isinstance(self.ops[d], ReluOp) for d in self.consumers[c]):
                mask |= hi > 0
        return mask

    # ------------------------------------------------------------------ backward propagation
    def lower(self, target: int, rows: Tensor | Callable[[int, int], Tensor], shared: bool,
              needed: Tensor | None = None, count: int | None = None) -> Tensor:
        """Lower bounds ``(B, K)`` of ``rows·z_target`` (rows ``(Bs, K, *shape)``, Bs = 1 when ``shared``).

        ``rows`` may be a function ``(k0, k1) -> rows k0:k1`` (shared) with ``count`` = K: the rows
        are then built one chunk at a time. ``needed`` (B, K): bound only these rows (the others
        get −inf); only with shared rows.
        """
        self._ensure(target)
        b = self.batch
        k = int(count) if callable(rows) else rows.shape[1]
        chunk = rows if callable(rows) else (lambda k0, k1: rows[:, k0:k1])
        widest = max(self.ops[i].numel for i in self.ancestors[target])
        budget = self.max_elements
        k_chunk = max(1, min(k, budget // widest))
        dtype, device = self.centre.dtype, self.centre.device
        result = torch.full((b, k), -math.inf, dtype=dtype, device=device)
        for k0 in range(0, k, k_chunk):
            k1 = min(k, k0 + k_chunk)
            if not shared:
                b_chunk = max(1, budget // ((k1 - k0) * widest))
                for b0 in range(0, b, b_chunk):
                    b1 = min(b, b0 + b_chunk)
                    pending = {target: chunk(k0, k1)[b0:b1]}
                    result[b0:b1, k0:k1] = self._sweep(target, pending, None, set(), (b0, b1))
                if self.meter is not None:
                    self.meter(target, k1 / k)
                continue
            pending, bias, done = {target: chunk(k0, k1)}, None, set()
            bias = self._sweep(target, pending, bias, done, None)
            mask = None if needed is None else needed[:, k0:k1]
            # rows needed per sample: read on the host (to gather only those), or (sync-free) all of them
            counts = [k1 - k0] * b if mask is None or not self.host_sizing else mask.sum(dim=1).tolist()
            b0 = 0
            while b0 < b:
                b1, top = b0, 0
                while b1 < b and (b1 == b0 or max(top, counts[b1]) * (b1 + 1 - b0) * widest <= budget):
                    top = max(top, counts[b1])
                    b1 += 1
                if top == 0:
                    b0 = b1
                    continue
                if top == k1 - k0:  # every row: keep the shared coefficients
                    part = dict(pending)
                    low = self._sweep(target, part, bias, set(done), (b0, b1))
                    if mask is not None:  # the rows not needed, as the gather leaves them (chunking changes nothing)
                        low = torch.where(mask[b0:b1], low, torch.full_like(low, -math.inf))
                    result[b0:b1, k0:k1] = low
                else:  # gather each sample's needed rows (needed first, padded with unneeded ones)
                    order = torch.sort(mask[b0:b1].to(torch.int8), dim=1, descending=True, stable=True).indices
                    idx = order[:, :top]
                    part = {j: a[0][idx] for j, a in pending.items()}
                    part_bias = None if bias is None else bias[0][idx]
                    low = self._sweep(target, part, part_bias, set(done), (b0, b1))
                    valid = mask[b0:b1].gather(1, idx)
                    low = torch.where(valid, low, torch.full_like(low, -math.inf))
                    result[b0:b1, k0:k1] = result[b0:b1, k0:k1].scatter(1, idx, low)
                b0 = b1
            if self.meter is not None:
                self.meter(target, k1 / k)
        return result

    def _sweep(self, target: int, pending: dict[int, Tensor], bias: Tensor | None, done: set[int],
               batch: tuple[int, int] | None) -> Tensor:
        """Propagate ``pending`` coefficients backward (reverse topological order) to the input.

        ``batch=None``: the shared phase — only affine nodes whose consumers are all done; returns
        the bias, and ``pending``/``done`` hold the frontier. Else: everything, for samples
        ``batch[0]:batch[1]``; returns the concretised lower bounds ``(Bc, K)``.
        """
        anc = self.ancestors[target]
        for i in sorted(anc, reverse=True):
            if i == 0 or i in done:
                continue
            if any(c in anc and c not in done for c in self.consumers[i]) and i != target:
                if batch is None:
                    continue
                raise AssertionError("reverse topological order violated")  # pragma: no cover
            op = self.ops[i]
            if batch is None and not op.linear:
                continue
            a = pending.pop(i, None)
            done.add(i)
            if a is None:
                continue
            if i in self.dense:
                jac, off = self.dense[i]
                flat = a.flatten(2)
                ins, add = [torch.matmul(flat, jac).reshape(*flat.shape[:2], *self.ops[0].out_shape)], flat @ off
                inputs: tuple[int, ...] = (0,)
            elif op.linear:
                ins, add = op.back(a)
                inputs = op.inputs
            else:
                b0, b1 = batch  # type: ignore[misc]
                relax = tuple(t[b0:b1] for t in self.relaxations[i])
                sparse = self.sparse.get(i)
                if sparse is not None:
                    a_in, add = op.back_sparse(a, relax[0], tuple(t[b0:b1] for t in sparse))  # type: ignore[attr-defined]
                else:
                    a_in, add = op.back_relaxed(a, relax)
                ins, inputs = [a_in], op.inputs
            for j, a_j in zip(inputs, ins):
                pending[j] = a_j if j not in pending else pending[j] + a_j
            if add is not None:
                bias = add if bias is None else bias + add
        if batch is None:
            return bias  # type: ignore[return-value]
        b0, b1 = batch
        k = next(iter(pending.values())).shape[1] if pending else 0
        low = torch.zeros((b1 - b0, k), dtype=self.centre.dtype, device=self.centre.device)
        if bias is not None:
            low = low + bias
        a = pending.get(0)
        if a is not None:
            flat = a.flatten(2)
            c = self.centre[b0:b1].reshape(b1 - b0, -1, 1)
            r = self.radius[b0:b1].reshape(b1 - b0, -1, 1)
            low = low + torch.matmul(flat, c).squeeze(-1) - torch.matmul(flat.abs(), r).squeeze(-1)
        return low
