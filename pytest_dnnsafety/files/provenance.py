"""What a gate evaluated: content fingerprints of fixture values and where the fixtures came from.

The evidence file must name the objects a gate actually read, not only the configured files: a
``conftest.py`` may override ``model`` and return something else entirely. The plugin therefore
records, for each fixture some gate role reads, right after the fixture returned (before any test
can mutate the object):

* :func:`fingerprint` — the object's type and a ``sha256`` over its content:

  - ``torch.nn.Module``: every entry of ``state_dict()`` (parameters and persistent buffers) in
    its order: name, dtype, shape and raw bytes; a ``torch.export`` program's module (a ``.pt2``)
    is marked ``model_format: "torch.export program"`` and adds ``graph_digest``, a ``sha256`` of
    its graph's code (the operations the deployed program runs, which the weights do not show);
  - data: the tensors (``x``, and ``y`` when present) of a tensor, array, ``(x, y)`` pair, dict
    with ``x``/``y``, ``TensorDataset``, or a ``DataLoader`` over a ``TensorDataset`` (the
    underlying tensors; batching and sampling order are not part of the digest); other
    ``DataLoader`` datasets are not fingerprinted (materialising them would be costly), and the
    record says so;
  - ``ScenarioTable``: the conditions (names, domains, restrictions) and the row codes;
  - ``OperationalProfile``: the KDE's points (latent when it has an encoder) and its bandwidth
    (or kernel covariance).

  Anything else is recorded with ``digest: None`` and ``not_fingerprinted: <why>``.
* :func:`fixture_origin` — where the fixture function is defined (file, line, function).
* :func:`setting_origin` — for the plugin's own fixtures, the setting they loaded from (value,
  source, resolved path and the file's ``sha256`` at load time).

Pure functions; torch is imported lazily, inside functions.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from pytest_dnnsafety.files.parsing import NotRegularFile, open_regular

__all__ = ["fingerprint", "fixture_origin", "setting_origin", "type_name", "tensor_digest_update", "file_sha256"]


def type_name(obj: Any) -> str:
    cls = type(obj)
    module = getattr(cls, "__module__", "") or ""
    return cls.__qualname__ if module in ("builtins", "") else f"{module}.{cls.__qualname__}"


def _torch() -> Any:
    import torch

    return torch


def tensor_digest_update(digest: Any, name: str, tensor: Any) -> int:
    """Feed one tensor (name, dtype, shape, bytes) into ``digest``; returns its number of elements."""
    torch = _torch()
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    if t.device.type == "meta":
        raise ValueError(f"tensor {name!r} is on the meta device and holds no data")
    header = f"{name}|{str(t.dtype).replace('torch.', '')}|{tuple(t.shape)}|".encode()
    digest.update(len(header).to_bytes(8, "little") + header)
    flat = t.reshape(-1).contiguous().cpu()
    if flat.numel():
        raw = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
        digest.update(memoryview(raw.numpy()))
    return int(t.numel())


def _tensor_like(value: Any) -> Any:
    """A tensor for a tensor or an array (no copy for a tensor); None for anything else."""
    torch = _torch()
    if isinstance(value, torch.Tensor):
        return value
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch
        return None
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return None
        return torch.from_numpy(np.ascontiguousarray(value))
    return None


def _digest_tensors(named: Iterable[tuple[str, Any]], kind: str) -> dict[str, Any]:
    digest = hashlib.sha256(kind.encode() + b"\n")
    count = values = 0
    for name, tensor in named:
        values += tensor_digest_update(digest, name, tensor)
        count += 1
    return {"digest": "sha256:" + digest.hexdigest(), "tensors": count, "values": values}


def _data_tensors(obj: Any) -> tuple[list[tuple[str, Any]] | None, str]:
    """The named tensors of a data object and a description; (None, why) when not fingerprintable."""
    torch = _torch()
    data = torch.utils.data
    from pytest_dnnsafety.data.tasks import DetectionData

    if isinstance(obj, data.DataLoader):
        inner = obj.dataset
        if isinstance(inner, (data.TensorDataset, DetectionData)):
            tensors, _ = _data_tensors(inner)
            return tensors, ("the DataLoader's dataset tensors; its batching and sampling "
                             "order are not part of the digest")
        return None, (f"a DataLoader over {type_name(inner)}: materialising its batches is not done for the "
                      "evidence; use a TensorDataset underneath to get a digest")
    if isinstance(obj, DetectionData):
        t = obj.targets
        if getattr(obj, "lazy", False):  # COCO data: images streamed from their files, never all read for a digest
            return ([("boxes", t.boxes), ("labels", t.labels), ("offsets", t.offsets())],
                    "the COCO data's targets (boxes, labels, offsets; annotations file "
                    f"{getattr(obj, 'digest', '?')}); its images are read lazily and are not part of the digest")
        return ([("x", obj.x), ("boxes", t.boxes), ("labels", t.labels), ("offsets", t.offsets())],
                "the detection data's images and targets (x, boxes, labels, offsets)")
    if isinstance(obj, data.TensorDataset):
        names = ["x", "y"] + [f"t{i}" for i in range(2, len(obj.tensors))]
        return list(zip(names, obj.tensors)), "the TensorDataset tensors (x, y)"
    single = _tensor_like(obj)
    if single is not None:
        return [("x", single)], "the tensor x"
    if isinstance(obj, Mapping) and "x" in obj:
        pairs = [(key, _tensor_like(obj[key])) for key in ("x", "y") if key in obj and obj[key] is not None]
        if all(t is not None for _, t in pairs):
            return pairs, "the tensors x, y of the dict" if len(pairs) == 2 else "the tensor x of the dict"
    if isinstance(obj, (tuple, list)) and len(obj) in (1, 2):
        pairs = [(key, _tensor_like(value)) for key, value in zip(("x", "y"), obj) if value is not None]
        if pairs and all(t is not None for _, t in pairs):
            return pairs, "the tensors (x, y)" if len(pairs) == 2 else "the tensor x"
    return None, ""


def fingerprint(obj: Any) -> dict[str, Any]:
    """``{"type", "digest", "digest_of", ...}`` of a fixture value; ``digest`` is None with a reason if none."""
    record: dict[str, Any] = {"type": type_name(obj)}
    try:
        record.update(_fingerprint(obj))
    except Exception as exc:  # a fingerprint must never break a test run; the evidence says why
        record.update({"digest": None, "not_fingerprinted": f"fingerprinting raised {type(exc).__name__}: {exc}"})
    return record


def _fingerprint(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {"digest": None, "not_fingerprinted": "the fixture returned None"}
    # Plugin types first: they need torch too, but their module tells without importing torch.
    module = type(obj).__module__ or ""
    if module.startswith("pytest_dnnsafety.scenarios") and hasattr(obj, "codes") and hasattr(obj, "conditions"):
        return _scenario_table(obj)
    if module.startswith("pytest_dnnsafety.engines.reliability.profile") and hasattr(obj, "points"):
        return _profile(obj)
    if module == "pytest_dnnsafety.files.predictions" and hasattr(obj, "sha256"):  # outputs recorded elsewhere
        return {"digest": obj.sha256, "digest_of": f"the recorded predictions file {obj.path}",
                "recorded_predictions": obj.to_details(),
                "model": None if obj.model is None else {"type": type_name(obj.model), **_fingerprint(obj.model)}}
    if isinstance(obj, Mapping) and obj and all(_is_monitor(v) for v in obj.values()):
        return _monitors(obj)
    torch = _torch()
    if isinstance(obj, torch.nn.Module):
        try:
            state = obj.state_dict(keep_vars=True)
        except Exception as exc:
            return {"digest": None, "not_fingerprinted": f"state_dict() raised {type(exc).__name__}: {exc}"}
        out = _digest_tensors(((name, value) for name, value in state.items() if isinstance(value, torch.Tensor)),
                              "torch.nn.Module state_dict")
        out["digest_of"] = "parameters and buffers (state_dict order: name, dtype, shape, bytes)"
        if out["tensors"] == 0:
            out["note"] = "the module has no parameters or buffers"
        from pytest_dnnsafety.files.pt2_taps import is_exported_module

        if is_exported_module(obj):  # the deployed artifact itself: its graph is what runs
            out["model_format"] = "torch.export program"
            out["graph_digest"] = "sha256:" + hashlib.sha256(obj.code.encode()).hexdigest()
        from pytest_dnnsafety.files.onnx_model import is_onnx_model

        if is_onnx_model(obj):  # the deployed artifact: the digest of the .onnx bytes read (weights included)
            out = {"digest": "sha256:" + obj.sha256, "digest_of": "the ONNX file's bytes as read",
                   "model_format": "ONNX", "file": None if obj.path is None else obj.path.name}
        return out
    tensors, what = _data_tensors(obj)
    if tensors is not None:
        out = _digest_tensors(tensors, "data")
        out["digest_of"] = what
        out["rows"] = int(tensors[0][1].shape[0]) if tensors and tensors[0][1].ndim else None
        return out
    if what:
        return {"digest": None, "not_fingerprinted": what}
    if callable(obj):
        return {"digest": None, "not_fingerprinted": f"a {type_name(obj)} is a callable, not a torch.nn.Module; "
                                                      "its weights (if any) cannot be read"}
    return {"digest": None, "not_fingerprinted": f"no fingerprint rule for {type_name(obj)}"}


def _is_monitor(obj: Any) -> bool:
    return callable(getattr(obj, "fit", None)) and callable(getattr(obj, "score", None))


def monitor_state_digest(monitor: Any) -> dict[str, Any]:
    """Fingerprint of a (fitted) runtime monitor: its configuration, threshold and state tensors."""
    digest = hashlib.sha256(b"runtime monitor\n")
    config = monitor.config() if callable(getattr(monitor, "config", None)) else {"type": type_name(monitor)}
    digest.update(json.dumps({"config": config, "threshold": getattr(monitor, "threshold", None)},
                             sort_keys=True, default=str).encode())
    tensors = list(getattr(monitor, "_state_tensors", lambda: ())())
    values = sum(tensor_digest_update(digest, f"state{i}", t) for i, t in enumerate(tensors))
    return {"digest": "sha256:" + digest.hexdigest(), "tensors": len(tensors), "values": values,
            "digest_of": "configuration, threshold and fitted state tensors"}


def _monitors(bank: Mapping[str, Any]) -> dict[str, Any]:
    """A ``monitors`` fixture: each monitor's name, type and configuration (and an autoencoder's weights)."""
    digest = hashlib.sha256(b"runtime monitors\n")
    for name, monitor in bank.items():
        one = monitor_state_digest(monitor)
        digest.update(f"{name}\t{type_name(monitor)}\t{one['digest']}\n".encode())
    return {"digest": "sha256:" + digest.hexdigest(), "monitors": list(map(str, bank)),
            "digest_of": "each monitor's name, type, configuration and state tensors, as the fixture returned them"}


def _scenario_table(table: Any) -> dict[str, Any]:
    conditions = table.conditions
    digest = hashlib.sha256(b"ScenarioTable\n")
    for name in conditions.names:
        digest.update(repr((name, tuple(conditions.domains[name]))).encode() + b"\n")
    for restriction in conditions.restrictions:
        digest.update(repr(sorted((k, tuple(v)) for k, v in restriction.items())).encode() + b"\n")
    tensor_digest_update(digest, "codes", table.codes)
    return {"digest": "sha256:" + digest.hexdigest(),
            "digest_of": "conditions (names, domains, restrictions) and every row's value codes",
            "rows": int(table.codes.shape[0])}


def _profile(profile: Any) -> dict[str, Any]:
    named = [("points", profile.points)]
    bandwidth = getattr(profile, "bandwidth", None)
    named.append(("bandwidth", bandwidth) if bandwidth is not None else ("covariance", profile.covariance))
    out = _digest_tensors(named, "OperationalProfile")
    out["digest_of"] = ("the KDE's points" + (" in its latent space (encoder)" if profile.encoder is not None else "")
                        + " and its bandwidth")
    out["rows"] = int(profile.points.shape[0])
    return out


def fixture_origin(func: Any, rootpath: Path | None = None) -> dict[str, Any]:
    """Where a fixture function is defined: ``{"file", "line", "function"}`` (file relative to rootpath)."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    code = getattr(func, "__code__", None)
    try:
        path = inspect.getsourcefile(func) or (code.co_filename if code else None)
    except TypeError:
        path = None
    shown = path
    if path and rootpath is not None:
        try:
            shown = Path(path).resolve().relative_to(Path(rootpath).resolve()).as_posix()
        except ValueError:
            shown = path
    return {"file": shown, "line": code.co_firstlineno if code else None,
            "function": f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')}"}


def file_sha256(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes, streamed in 1 MiB blocks.

    Opened by :func:`~.parsing.open_regular`: a FIFO or a device raises
    :class:`~.parsing.NotRegularFile` instead of blocking or reading forever.
    """
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def setting_origin(settings: Any, names: Iterable[str], digest: bool = True) -> dict[str, Any]:
    """The settings a plugin fixture loaded from: value, source, path and (``digest``) the file's sha256 now."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            resolved = settings.get(name)
        except Exception as exc:
            out[name] = {"error": str(exc)}
            continue
        if resolved.value is None:
            continue
        entry: dict[str, Any] = {"setting": f"dnnsafety_{name}", "spec": str(resolved.value),
                                 "source": resolved.source}
        if resolved.is_factory:
            entry["factory"] = True
        else:
            path = settings.path(resolved)
            entry["path"] = os.fspath(path)
            if digest:
                try:
                    entry["sha256"] = file_sha256(path)
                except (OSError, NotRegularFile):  # gone, or a FIFO/device: no digest, nothing blocks
                    entry["sha256"] = None
        out[name] = entry
    return out
