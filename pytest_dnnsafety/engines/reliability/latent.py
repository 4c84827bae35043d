"""Operational inputs of many dimensions (images): read in blocks, and the latent-space operational profile.

Part of :mod:`pytest_dnnsafety.engines.reliability`. A Gaussian KDE of raw inputs is out of reach
above :data:`KDE_MAX_DIM` values per input (a 3×224×224 image has 150,528): its bandwidth rule,
its grid and its cell masses all grow with the dimension, and the grid's cells are exponential in
it. Such inputs take one of two routes:

* **ball cells** (``cells="balls"``): the empirical profile (no KDE) — the operational inputs are
  :class:`OperationalInputs`, read in blocks (a ``.npy`` file a slice of rows at a time, a
  ``DataLoader`` batch by batch), never held whole
  (:mod:`~pytest_dnnsafety.engines.reliability.streamed`);
* **the latent route** (``latent=``): an encoder maps inputs to ``d`` latent features, the KDE
  and the grid cells live in that space and the model is queried on decoded latent samples
  (:func:`latent_profile`): a PCA of ``k`` components fitted here in passes over the inputs
  (:func:`fit_pca`), or the user's encoder/decoder pair.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.engines.reliability.profile import PCA, OperationalProfile
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.files.arrays import npy_header

__all__ = ["KDE_MAX_DIM", "NpyRows", "OperationalInputs", "fit_pca", "latent_profile", "encoder_pair",
           "high_dimensional_error"]

#: The most values per input a KDE (and grid cells) is fitted on in input space; above it the
#: operational data are :class:`OperationalInputs` (ball cells) or go through ``latent=``.
KDE_MAX_DIM = 1024

#: Values per batch read from a ``.npy`` file (16 MiB of float32: 27 images of 3×224×224).
READ_ELEMS = 1 << 22

#: Values of one held block of the PCA's Gram passes (128 MiB of float32).
GRAM_ELEMS = 1 << 25


def high_dimensional_error(dim: int, what: str) -> ConfigError:
    """The error for a KDE/grid asked on raw inputs of ``dim`` values (above :data:`KDE_MAX_DIM`), naming the fix."""
    return ConfigError(
        f"max_pmi_ub: {what} has {dim:,} values per input; a KDE and grid cells in input space are out of reach "
        f"above {KDE_MAX_DIM:,} (the grid's cells are exponential in the dimension). Fix: cells='balls' (norm "
        f"balls around the operational inputs, the empirical profile, streamed), or latent=16 (a PCA of 16 "
        f"components; or latent='pkg.module:make' returning an encoder/decoder pair) for the KDE and grid cells in "
        f"a latent space (docs/gates/reliability.md, 'Images')")


class NpyRows:
    """A ``.npy`` file read a slice of rows at a time (no memory map: pages read are not held by the process).

    Object arrays (pickles) are refused; Fortran-ordered arrays too (their rows are not contiguous).
    """

    def __init__(self, path: str | Path, what: str = "operational data") -> None:
        self.path, self.what = Path(path), what
        try:
            with open(self.path, "rb") as handle:
                shape, dtype, fortran = npy_header(handle)
                self.offset = handle.tell()
        except (OSError, ValueError, EOFError, SyntaxError) as exc:
            raise DataError(f"{what}: {self.path} is not a readable .npy file: {exc}") from None
        if dtype.hasobject:
            raise DataError(f"{what}: {self.path} holds Python objects; refused. Fix: save a numeric array")
        if fortran and len(shape) > 1:
            raise DataError(f"{what}: {self.path} is Fortran-ordered; its rows cannot be read in slices. Fix: save "
                            f"np.ascontiguousarray(x)")
        if len(shape) < 1 or shape[0] == 0:
            raise DataError(f"{what}: {self.path} holds no inputs (shape {shape})")
        self.shape, self.dtype = tuple(int(v) for v in shape), dtype
        self.row_bytes = int(math.prod(self.shape[1:])) * dtype.itemsize
        size = self.path.stat().st_size
        if size < self.offset + self.shape[0] * self.row_bytes:
            raise DataError(f"{what}: {self.path} declares shape {self.shape} ({self.shape[0] * self.row_bytes:,} "
                            f"bytes) but holds {size - self.offset:,} bytes of data (truncated?)")

    def __len__(self) -> int:
        return self.shape[0]

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start..stop-1`` as a fresh native-endian array."""
        out = np.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        with open(self.path, "rb") as handle:
            handle.seek(self.offset + start * self.row_bytes)
            got = handle.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise DataError(f"{self.what}: {self.path} ends before row {stop} (truncated file)")
        return out if self.dtype.isnative else out.astype(self.dtype.newbyteorder("="))


class OperationalInputs:
    """Operational inputs read in order, a batch at a time: a :class:`NpyRows` file, a ``DataLoader`` (batches
    ``x`` or ``(x, y)``; labels ignored) or held inputs ``(N, …)``. No KDE is fitted on them."""

    def __init__(self, source: Any, what: str = "operational data") -> None:
        self.source, self.what = source, what

    @property
    def streamed(self) -> bool:
        return isinstance(self.source, (NpyRows, torch.utils.data.DataLoader))

    def batches(self) -> Iterator[Tensor]:
        """The inputs in order, a batch ``(b, …)`` at a time (a new pass each call)."""
        src = self.source
        if isinstance(src, torch.utils.data.DataLoader):
            for batch in src:
                x = batch[0] if isinstance(batch, (tuple, list)) else batch["x"] if isinstance(batch, dict) else batch
                yield x.detach() if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
            return
        n = len(src)
        if isinstance(src, NpyRows):
            step = max(1, READ_ELEMS // max(1, int(math.prod(src.shape[1:]))))
            for start in range(0, n, step):
                yield torch.from_numpy(src.rows(start, min(n, start + step)))
            return
        x = src.detach() if isinstance(src, Tensor) else torch.as_tensor(np.asarray(src))
        step = max(1, READ_ELEMS // max(1, int(x[0].numel())))
        for start in range(0, n, step):
            yield x[start : start + step]

    def __repr__(self) -> str:
        return f"OperationalInputs({type(self.source).__name__}, what={self.what!r})"


def _flat(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], -1).to(torch.float32)


def fit_pca(inputs: OperationalInputs, n_components: int) -> PCA:
    """A :class:`PCA` of ``n_components`` fitted in passes over ``inputs``, never holding them whole.

    Exact (the held fit's components, up to float32 rounding): the mean in one pass, the ``(N, N)`` Gram
    matrix of the centred inputs by a block nested loop (blocks of :data:`GRAM_ELEMS` values, about
    ``N·d / GRAM_ELEMS`` passes), its top eigenvectors ``U`` and the components ``V = Xcᵀ U / s`` in one more
    pass. Memory: the Gram matrix, one block and ``d × k`` components.
    """
    total: Tensor | None = None
    n, shape = 0, None
    for x in inputs.batches():
        f = _flat(x).to(torch.float64)
        shape = tuple(x.shape[1:]) if shape is None else shape
        total = f.sum(0) if total is None else total + f.sum(0)
        n += int(f.shape[0])
    if total is None or shape is None:
        raise DataError(f"{inputs.what}: no inputs to fit the latent PCA on")
    d = int(total.shape[0])
    if n_components > min(n, d):
        raise ConfigError(f"latent={n_components}: a PCA has at most min(inputs, values per input) = {min(n, d)} "
                          f"components. Fix: a smaller latent, or more operational data")
    mean = (total / n).to(torch.float32)
    gram = torch.zeros(n, n, dtype=torch.float64)
    rows = max(1, GRAM_ELEMS // d)
    for b0 in range(0, n, rows):  # a held block of rows against a fresh pass over the rows from it on
        block, pos = [], 0
        for x in inputs.batches():
            f = _flat(x)
            lo, hi = max(b0, pos), min(b0 + rows, pos + f.shape[0])
            if lo < hi:
                block.append(f[lo - pos : hi - pos] - mean)
            pos += int(f.shape[0])
            if pos >= b0 + rows:
                break
        held = torch.cat(block)
        b1 = b0 + int(held.shape[0])
        pos = 0
        for x in inputs.batches():
            f = _flat(x)
            stop = pos + int(f.shape[0])
            if stop > b0:
                cut = max(0, b0 - pos)
                part = (held @ (f[cut:] - mean).T).to(torch.float64)
                gram[b0:b1, pos + cut : stop] = part
                gram[pos + cut : stop, b0:b1] = part.T
            pos = stop
    values, vectors = torch.linalg.eigh(gram)
    values, vectors = values.flip(0)[:n_components], vectors.flip(1)[:, :n_components]
    scale = values.clamp_min(1e-300).sqrt()
    comps = torch.zeros(n_components, d, dtype=torch.float64)
    pos = 0
    for x in inputs.batches():
        f = (_flat(x) - mean).to(torch.float64)
        comps += vectors[pos : pos + f.shape[0]].T @ f
        pos += int(f.shape[0])
    comps = comps / scale[:, None]
    signs = torch.sign(comps.gather(1, comps.abs().argmax(1, keepdim=True)))
    signs[signs == 0] = 1
    pca = PCA(n_components)
    pca.components = (comps * signs).to(torch.float32)
    pca.mean = mean
    pca.explained_variance = (values / max(n - 1, 1)).to(torch.float32)
    pca.input_shape = shape
    return pca


def encoder_pair(latent: Any, inputs: OperationalInputs | None = None
                 ) -> tuple[Callable[[Tensor], Any], Callable[[Tensor], Any], int | None]:
    """``(encoder, decoder, components)`` of a ``latent=`` value: an int ``k`` (a PCA fitted on ``inputs``), an
    object with ``encode``/``decode`` (a fitted :class:`PCA`, an autoencoder) or an ``(encoder, decoder)`` pair."""
    if isinstance(latent, int) and not isinstance(latent, bool):
        if inputs is None:
            raise ConfigError("latent=<int> fits a PCA on the operational inputs; none were given")
        pca = fit_pca(inputs, latent)
        return pca.encode, pca.decode, latent
    if hasattr(latent, "encode") and hasattr(latent, "decode"):
        return latent.encode, latent.decode, None
    if isinstance(latent, (tuple, list)) and len(latent) == 2 and all(callable(f) for f in latent):
        return latent[0], latent[1], None
    kind = "a feature extractor without a decoder" if callable(latent) else repr(latent)
    raise ConfigError(
        f"max_pmi_ub: latent={kind}: the latent route samples points in latent grid cells and queries the model on "
        f"their decoded inputs, so it needs an encoder and a decoder. Fix: latent=<int> (a PCA of that many "
        f"components), or a factory returning an object with encode/decode methods (e.g. an autoencoder) or an "
        f"(encoder, decoder) pair")


def latent_profile(data: Any, latent: Any, *, clip: tuple[float, float] | None = None,
                   device: torch.device | str | None = None, bandwidth: Any = "scott") -> OperationalProfile:
    """The operational profile in a latent space: the KDE of the encodings of ``data``, decoded for the model.

    ``data``: :class:`OperationalInputs`, an :class:`OperationalProfile` in input space (its inputs), a
    ``DataLoader`` or held inputs ``(N, …)``. ``latent``: see :func:`encoder_pair`. The inputs are encoded a
    batch at a time (never held whole); decoded samples are clamped to ``clip`` when given.
    """
    if isinstance(data, OperationalProfile):
        if data.latent:
            raise ConfigError("latent= builds a latent profile from input-space operational data, but the profile is "
                              "latent already. Fix: drop latent=, or give the raw operational inputs")
        data = data.inputs
    inputs = data if isinstance(data, OperationalInputs) else OperationalInputs(data)
    encoder, decoder, _ = encoder_pair(latent, inputs)
    dev = torch.device("cpu") if device is None else torch.device(device)
    parts, shape = [], None
    with torch.no_grad():
        for x in inputs.batches():
            shape = tuple(x.shape[1:]) if shape is None else shape
            z = encoder(x.to(dev))
            parts.append((z if isinstance(z, Tensor) else torch.as_tensor(np.asarray(z))).detach()
                         .reshape(x.shape[0], -1).to(dev, torch.float64))
    if not parts or shape is None:
        raise DataError(f"{inputs.what}: no operational inputs to encode")
    lo_hi = None if clip is None else (float(clip[0]), float(clip[1]))

    def decode(z: Tensor) -> Tensor:
        x = decoder(z)
        x = x if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x), device=z.device)
        x = x.reshape(z.shape[0], *shape)
        return x if lo_hi is None else x.clamp(*lo_hi)

    # the KDE of the codes; the raw inputs are not held (profile.inputs is None: ball cells need them)
    profile = OperationalProfile(torch.cat(parts), bandwidth, device=dev)
    profile.encoder, profile.decoder = encoder, decode
    profile._input_shape = tuple(int(v) for v in shape)  # noqa: SLF001
    profile.inputs = None  # type: ignore[assignment]
    return profile
