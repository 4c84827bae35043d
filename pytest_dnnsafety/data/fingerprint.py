"""Streamed data fingerprinted: an order-sensitive digest of the bytes of every batch a ``DataLoader`` yields.

A ``DataLoader`` over anything but a ``TensorDataset`` is not fingerprinted when its fixture is set up
(that would need a pass of its own). Instead, every pass that reads it through
:func:`~pytest_dnnsafety.data.forms.iter_batches` (the engines' :class:`~pytest_dnnsafety.engines.core.runner.Runner`,
the shared activation pass, the monitors) feeds each batch's tensors — name, dtype, shape and raw bytes of
``x`` and of the labels, on the host, as they come out of the loader and before any copy to the
device — into a ``sha256``. A pass that reaches the loader's end records its digest on the loader
(:func:`streamed_record`); a pass stopped early (a sharded rank, a first-batch peek) records nothing.
The gate evaluation then puts it in the evidence in place of ``not_fingerprinted``
(:func:`apply_streamed`), so the evidence names the data read and a baseline sees it change, at no
extra pass.

The digest is of the batches in the order they were read: the same files read in another order give
another digest. A loader must read in index order (:func:`~pytest_dnnsafety.data.forms.check_loader_order`),
but a loader over an ``IterableDataset`` reads the dataset's own order, and a random transform changes
the bytes: when two passes over one loader read different bytes, the record says so
(``streamed.passes_agree: false``) and keeps the first pass's digest. Batches that arrive on an accelerator
(a ``collate_fn`` that moves them) are not hashed (that would synchronise the device): the record says why.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["StreamDigest", "digest_stream", "streamed_record", "apply_streamed"]

_STREAMS: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


class StreamDigest:
    """A running ``sha256`` of named tensors, in the order they are fed (see the module docstring)."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256(b"streamed data\n")
        self.batches = 0
        self.rows = 0
        self.skipped: str | None = None

    def tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Feed one tensor: its name, dtype, shape and bytes (a host tensor; one on a device is not hashed)."""
        t = tensor.detach()
        if t.device.type != "cpu":
            self.skipped = self.skipped or f"the batches arrive on {t.device} (hashing them would synchronise it)"
            return
        if t.layout != torch.strided:
            t = t.to_dense()
        header = f"{name}|{str(t.dtype).replace('torch.', '')}|{tuple(t.shape)}|".encode()
        self._hash.update(len(header).to_bytes(8, "little") + header)
        flat = t.reshape(-1).contiguous()
        if flat.numel():
            self._hash.update(memoryview((flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)).numpy()))

    def batch(self, x: torch.Tensor, y: Any) -> None:
        """Feed one batch ``(x, y)``: ``y`` a tensor, a box set (boxes, labels, image) or None."""
        self.tensor("x", x)
        if isinstance(y, torch.Tensor):
            self.tensor("y", y)
        elif y is not None and all(hasattr(y, name) for name in ("boxes", "labels", "image")):
            for name in ("boxes", "labels", "image"):
                self.tensor(f"y.{name}", getattr(y, name))
        self.batches += 1
        self.rows += int(x.shape[0]) if x.ndim else 1

    def hexdigest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


def _order(loader: Any) -> str:
    data = torch.utils.data
    if isinstance(loader.dataset, data.IterableDataset):
        return ("the IterableDataset's own order (not checked: a dataset that shuffles changes the digest from run "
                "to run)")
    sampler = loader.batch_sampler.sampler if loader.batch_sampler is not None else loader.sampler
    return f"index order ({type(sampler).__name__})"


def digest_stream(loader: Any, batches: Iterable[tuple[torch.Tensor, Any]]) -> Iterator[tuple[torch.Tensor, Any]]:
    """``batches`` (the ``(x, y)`` of one pass over ``loader``) unchanged, digested on the way; a pass that reaches
    the end records its digest on ``loader`` (see :func:`streamed_record`)."""
    digest = StreamDigest()
    for x, y in batches:
        digest.batch(x, y)
        yield x, y
    _record(loader, digest)


def _record(loader: Any, digest: StreamDigest) -> None:
    try:
        known = _STREAMS.get(loader)
    except TypeError:  # not weak-referenceable
        return
    if known is None:
        record: dict[str, Any] = {"batches": digest.batches, "rows": digest.rows, "passes": 1, "passes_agree": True,
                                  "order": _order(loader)}
        if digest.skipped:
            record["not_fingerprinted"] = digest.skipped
        else:
            record["digest"] = digest.hexdigest()
        _STREAMS[loader] = record
        return
    known["passes"] += 1
    if not digest.skipped and known.get("digest") not in (None, digest.hexdigest()):
        known["passes_agree"] = False


def streamed_record(loader: Any) -> dict[str, Any] | None:
    """What the complete passes over ``loader`` read: ``{"digest" (or "not_fingerprinted"), "batches", "rows",
    "passes", "passes_agree", "order"}``; None when no pass over it has finished."""
    try:
        record = _STREAMS.get(loader)
    except TypeError:
        return None
    return dict(record) if record is not None else None


def apply_streamed(inputs: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """Fill each input record (role -> record, as in the evidence) whose object was not fingerprinted at setup and
    was streamed since: ``digest`` becomes the streamed digest, ``digest_of`` says what it covers, ``streamed``
    holds the pass's counts and order; ``not_fingerprinted`` is dropped (kept, with the reason, when the batches
    could not be hashed)."""
    for role, record in inputs.items():
        if not isinstance(record, dict) or record.get("digest") is not None or role not in values:
            continue
        if not isinstance(values[role], torch.utils.data.DataLoader):
            continue
        streamed = streamed_record(values[role])
        if streamed is None:
            continue
        digest = streamed.pop("digest", None)
        why = streamed.pop("not_fingerprinted", None)
        record["streamed"] = streamed
        if digest is None:
            record["not_fingerprinted"] = f"streamed, but not hashed: {why}"
            continue
        record.pop("not_fingerprinted", None)
        record["digest"] = digest
        record["digest_of"] = ("the bytes of every batch as the DataLoader streamed them, in the order read (name, "
                               "dtype, shape and bytes of x and the labels per batch)"
                               + ("" if streamed["passes_agree"] else
                                  "; the passes read different bytes (a random transform, or a dataset that "
                                  "shuffles): this is the first pass's digest"))
        record["rows"] = streamed["rows"]
