"""Incremental k = 2 update of neuron k-activation coverage: only the pairs with a missing pattern get work.

Eq. (2) of Cheng et al. (2018) needs, per pair of neurons and on/off pattern, only whether some input
showed it, never how often. A pair whose four patterns are all occupied can never change again, and on
layer activations almost every pair is complete after the first few thousand inputs; what stays open
are the pairs of rarely (or never, or always) firing neurons and of near-duplicate neurons.
:class:`OpenPairs` keeps the list of open pairs on the engine's device and folds a block of rows into
exactly those that can change:

1. **Owners.** When the list is built each open pair gets an *owner*, the endpoint with more open
   pairs (a rarely firing neuron owns almost all of its pairs). Per owner two flags say whether some
   of its pairs still miss a pattern with the owner on (``need_on``) or off (``need_off``). An owner
   whose needed state does not occur in the block (a dead neuron that stays off, whose pairs only miss
   "on" patterns) cannot change any of its pairs: they are not visited at all.
2. **Counts.** The visited pairs need the co-activation count ``P_vu`` of the block, for owner v and
   partner u. An owner that is always off (on) in the block has ``P_v· = 0`` (``= S``): free. One
   in its minority state (on, or off) in at most 1/32 of the rows gets its row of ``P`` as the sum of
   those rows of B (or S minus it): c additions per such row. The remaining owners (near-duplicates,
   moderately firing neurons) get ``B[:, V]ᵀ B[:, U]`` with U only their pairs' partners — a small
   product instead of the ``c × c`` one.
3. **Fold.** Each visited pair's four flags follow by inclusion–exclusion with the column sums S and
   the row count (as in the dense path); the pairs that gained a cell are written back as 4-byte
   words; the owners' need flags are recomputed from their (all visited) pairs. Complete pairs are
   dropped from the list once they are a quarter of it.

The result is bit-identical to the dense path: the same exact integer counts (float32 holds them,
rows per block < 2**22), the same comparisons, skipped only where no cell can change. While most
pairs are open (the first block) or the product would be large, the engine runs its dense chunked
product instead (and retries the list after 1, 2, 4, … dense blocks).

Host syncs: each block reads back the sizes of the owner and pair selections, the product's rows and
columns and the gained pairs (a handful of syncs per block of rows, plus one count when the list is
rebuilt). They buy skipping almost all of a ``c × c`` product per block; on the CPU they cost nothing.
Bookkeeping over the pair list runs on one intra-op thread (:func:`~pytest_dnnsafety.runtime.threads.host_bound`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from pytest_dnnsafety.runtime import threads

__all__ = ["FULL_WORD", "OpenPairs", "decode_pairs"]

#: A complete pair: its four pattern flags (bools = bytes 1) viewed as one int32 word.
FULL_WORD = 0x01010101

#: Most open pairs the list holds (about 40 bytes per pair: 160 MiB); with more, or with more than half
#: of all pairs open, the engine stays on its dense path.
MAX_OPEN_PAIRS = 1 << 22

#: The list is built only while at most this share of all pairs is open.
OPEN_SHARE = 0.9

#: The list's path runs when the owners whose row of ``P`` must be computed (by sums or a product) are at
#: most this share of c (the dense path computes about c/2 rows' worth: the upper triangle, in chunks).
COVER_SHARE = 0.4

#: Most elements of the owners' block of ``P`` (float32: 128 MiB); a larger one goes dense.
MAX_BLOCK_ELEMS = 1 << 25

#: A neuron in its minority state in at most this share of a block's rows gets its row of ``P`` by
#: adding those rows of B instead of a product row (n·c multiply-adds): c additions per such row.
_FEW_SHARE = 1 / 32

#: Rows of one slice of the cover product (its elements: rows × c ≤ this).
_SLICE_ELEMS = 1 << 22


def decode_pairs(tuples: Tensor, c: int) -> tuple[Tensor, Tensor]:
    """First and second neuron (int64) of pair tuple indices in combinations order, on their device."""
    i_all = torch.arange(c, dtype=torch.int64, device=tuples.device)
    # index of the first pair whose first neuron is i: C(c, 2) - C(c - i, 2)
    firsts = math.comb(c, 2) - (c - i_all) * (c - i_all - 1) // 2
    first = torch.searchsorted(firsts, tuples, right=True) - 1
    second = first + 1 + tuples - firsts[first]
    return first, second


def _needs(words: Tensor, owner_first: Tensor) -> tuple[Tensor, Tensor]:
    """Per pair: is a pattern with its owner off (on) still missing? From the pairs' state words."""
    occ = words.view(torch.bool).reshape(-1, 4)  # bytes in pattern order 00, 01, 10, 11 (endian-free)
    off_mixed = torch.where(owner_first, occ[:, 1], occ[:, 2])  # owner off, other on
    on_mixed = torch.where(owner_first, occ[:, 2], occ[:, 1])  # owner on, other off
    return ~(occ[:, 0] & off_mixed), ~(occ[:, 3] & on_mixed)


@dataclass
class OpenPairs:
    """The open (incomplete) pairs of one ``occupied`` state tensor, valid while it is not changed elsewhere.

    ``tuples`` are row indices of the state (int64, ascending), ``first < second`` their neurons;
    ``owner``/``other`` the same two neurons with the owner first (the endpoint with more open pairs,
    fixed when the list is built), ``owner_first`` whether the owner is ``first``. ``need_on[v]``
    (``need_off[v]``): some open pair owned by v still misses a pattern with v on (off); an owner
    whose needed state does not occur in a block of rows cannot change any of its pairs there.
    The list may still hold pairs that became complete (``done`` of them; they read as occupied and
    are dropped once they are a quarter of the list). ``state`` (a weak reference) and ``version``
    identify the tensor and its in-place version counter the list matches.
    """

    state: weakref.ref[Tensor]
    version: int
    tuples: Tensor
    first: Tensor
    second: Tensor
    owner: Tensor
    other: Tensor
    owner_first: Tensor
    need_on: Tensor
    need_off: Tensor
    done: int = 0

    @classmethod
    def build(cls, occupied: Tensor, c: int) -> OpenPairs | None:
        """The open pairs of ``occupied`` (``(C(c, 2), 4)`` bool, contiguous); None when there are too many."""
        words = occupied.view(torch.int32).reshape(-1)
        with threads.host_bound():
            open_mask = words != FULL_WORD
            n_open = int(open_mask.sum())  # one sync
            if n_open > MAX_OPEN_PAIRS or n_open > OPEN_SHARE * words.numel():
                return None
            tuples = torch.nonzero(open_mask).reshape(-1)
            first, second = decode_pairs(tuples, c)
            degree = torch.bincount(first, minlength=c) + torch.bincount(second, minlength=c)
            owner_first = degree[first] >= degree[second]
            owner = torch.where(owner_first, first, second)
            other = torch.where(owner_first, second, first)
            need_off, need_on = _needs(words.index_select(0, tuples), owner_first)
            zeros = torch.zeros(c, dtype=torch.int32, device=words.device)
            need_on_v = zeros.index_add(0, owner, need_on.to(torch.int32)) > 0
            need_off_v = zeros.index_add(0, owner, need_off.to(torch.int32)) > 0
        return cls(weakref.ref(occupied), occupied._version, tuples, first, second, owner, other, owner_first,
                   need_on_v, need_off_v)

    def matches(self, occupied: Tensor) -> bool:
        """Whether this list still describes ``occupied`` (same tensor, not modified since)."""
        return self.state() is occupied and self.version == occupied._version

    def __len__(self) -> int:
        return int(self.tuples.numel())

    def _compact(self, words: Tensor) -> None:
        keep = torch.nonzero(words.index_select(0, self.tuples) != FULL_WORD).reshape(-1)
        for name in ("tuples", "first", "second", "owner", "other", "owner_first"):
            setattr(self, name, getattr(self, name).index_select(0, keep))
        self.done = 0

    def fold(self, occupied: Tensor, b: Tensor, s: Tensor) -> bool:
        """Fold the rows ``b`` (``(n, c)`` float32 0/1, column sums ``s``) into the open pairs.

        Returns False (and changes nothing) when the product would be too large; the caller then runs
        the dense path and drops this list.
        """
        n_rows, c = b.shape
        n = float(n_rows)
        with threads.host_bound():  # bookkeeping: many short kernels over neurons and pairs
            on_seen, off_seen = s > 0, s < n
            active = (self.need_on & on_seen) | (self.need_off & off_seen)  # owners that can gain a cell
            owners = torch.nonzero(active).reshape(-1)  # sync
            n_owners = int(owners.numel())
            if n_owners == 0:
                self.version = occupied._version
                return True
            mixed = on_seen & off_seen  # neither always off (row of P = 0) nor always on (row = S)
            rows = owners[mixed.index_select(0, owners)]  # sync: the product's height
            if rows.numel() > COVER_SHARE * c or n_owners * c > MAX_BLOCK_ELEMS:
                return False
            pick = torch.nonzero(active.index_select(0, self.owner)).reshape(-1)  # sync: the pairs to visit
            every = pick.numel() == self.tuples.numel()
            sub = {
                name: getattr(self, name) if every else getattr(self, name).index_select(0, pick)
                for name in ("tuples", "first", "second", "owner", "other", "owner_first")
            }
            pos = torch.full((c,), -1, dtype=torch.int64, device=b.device)
            pos[owners] = torch.arange(n_owners, dtype=torch.int64, device=b.device)
            # block[pos[v]] = row v of P: 0 for an always-off neuron, S for an always-on one, else B[:, v]ᵀB
            always_on = (s.index_select(0, owners) == n).unsqueeze(1)
            block = torch.where(always_on, s.unsqueeze(0), torch.zeros((), dtype=s.dtype, device=s.device))
            # a neuron in its minority state (on if it is on in at most half the rows, else off) in only a
            # few rows: its row of P is a sum of those rows of B (or S minus it), no product needed
            minority = torch.minimum(s, n - s).index_select(0, rows)
            few = minority <= _FEW_SHARE * n
            sparse_rows, rows = rows[few], rows[~few]  # syncs
            if sparse_rows.numel():
                on_minor = s.index_select(0, sparse_rows) <= n / 2
                states = b.index_select(1, sparse_rows)
                states = torch.where(on_minor, states, 1 - states)  # 1 where the neuron is in its minority state
                hits = torch.nonzero(states.T)  # (neuron slot, row), sync
                q = torch.zeros((int(sparse_rows.numel()), c), dtype=s.dtype, device=b.device)
                step = max(1, _SLICE_ELEMS // c)
                for lo in range(0, int(hits.shape[0]), step):
                    q.index_add_(0, hits[lo : lo + step, 0], b.index_select(0, hits[lo : lo + step, 1]))
                block.index_copy_(0, pos.index_select(0, sparse_rows), torch.where(on_minor.unsqueeze(1), q, s - q))
            rows_at = pos.index_select(0, rows)
            if rows.numel():  # only the columns of their pairs' other neurons are read
                wanted = torch.zeros(c, dtype=torch.bool, device=b.device)
                wanted[rows] = True
                cols_wanted = torch.zeros(c, dtype=torch.bool, device=b.device)
                cols_wanted[sub["other"][wanted.index_select(0, sub["owner"])]] = True
                cols = torch.nonzero(cols_wanted).reshape(-1)  # sync
                right = b.index_select(1, cols)
        step = max(1, _SLICE_ELEMS // max(1, int(cols.numel()) if rows.numel() else c))
        for lo in range(0, int(rows.numel()), step):
            height = min(step, int(rows.numel()) - lo)
            with threads.sized(n_rows * (height + int(cols.numel()))):  # all threads unless it is small
                part = b.index_select(1, rows[lo : lo + step]).T @ right
                block.index_put_((rows_at[lo : lo + step].unsqueeze(1), cols.unsqueeze(0)), part)

        with threads.host_bound():
            at = pos.index_select(0, sub["owner"]).mul_(c).add_(sub["other"])
            p = block.reshape(-1).index_select(0, at)
            si = s.index_select(0, sub["first"])
            sj = s.index_select(0, sub["second"])
            flags = torch.empty((p.numel(), 4), dtype=torch.bool, device=b.device)
            torch.gt(p, si + sj - n, out=flags[:, 0])  # 00: N - S_i - S_j + P > 0
            torch.lt(p, sj, out=flags[:, 1])  # 01: S_j - P > 0
            torch.lt(p, si, out=flags[:, 2])  # 10: S_i - P > 0
            torch.gt(p, 0, out=flags[:, 3])  # 11: P > 0
            words = occupied.view(torch.int32).reshape(-1)
            before = words.index_select(0, sub["tuples"])
            merged = before | flags.view(torch.int32).reshape(-1)
            changed = torch.nonzero(merged != before).reshape(-1)  # sync; usually few pairs gain a cell
            words.index_copy_(0, sub["tuples"].index_select(0, changed), merged.index_select(0, changed))
            # an active owner has all its pairs in the visit: its needs are recomputed exactly
            need_off, need_on = _needs(merged, sub["owner_first"])
            zeros = torch.zeros(c, dtype=torch.int32, device=b.device)
            self.need_on = torch.where(active, zeros.index_add(0, sub["owner"], need_on.to(torch.int32)) > 0,
                                       self.need_on)
            self.need_off = torch.where(active, zeros.index_add(0, sub["owner"], need_off.to(torch.int32)) > 0,
                                        self.need_off)
            self.done += int(((merged == FULL_WORD) & (before != FULL_WORD)).sum())  # sync
            if 4 * self.done > self.tuples.numel():
                self._compact(words)
        self.version = occupied._version
        return True
