"""Load models and data from files or factories, safely (the fixtures built on them: :mod:`pytest_dnnsafety.plugin.fixtures`).

No file is unpickled as arbitrary Python objects unless the user opts in with
``dnnsafety_allow_pickle`` (model files only; data files never):

* a **torch.save** file (state dict, tensor, dict of tensors) is checked statically first: every
  pickle in it is walked opcode by opcode (:func:`pickletools.genops`, nothing is executed) and
  any global outside the tensor allow-list of torch's ``weights_only`` loader is refused; it is then
  read with ``torch.load(weights_only=True)`` under :func:`weights_only_forced`.
* a **torch.export** program (``.pt2``) is read once and loaded from the checked bytes; its zip
  layout must read the same to Python's zipfile and torch's reader (:mod:`.pt2_zip`), and it gets
  the same static check for every pickle in the archive (nested ``torch.save`` archives included); archives that torch would load without any
  restriction (AOTInductor native code, custom/opaque object constants) are refused; and
  :func:`torch.export.load` runs under :func:`weights_only_forced`, because it falls back to an
  unrestricted ``torch.load(weights_only=False)`` when the safe path fails.
* a **TorchScript** archive goes to :func:`torch.jit.load`, whose C++ unpickler resolves a global
  only to a TorchScript type compiled from the archive's ``code/`` (an unknown global such as
  ``posix.system`` is an "Unknown type name" error); it never imports or calls a Python object.
* ``.npy``/``.npz`` data is read with ``allow_pickle=False``; an object array is refused from its
  header, before any of its bytes are read. So is an array whose header declares more bytes than
  the file (or the ``.npz`` member) holds, or more than the read budget
  (:func:`~pytest_dnnsafety.files.parsing.data_budget`): a sparse 10 GiB file is refused in
  milliseconds. An ``.npz`` member's declared size is checked before it is decompressed (a zip
  bomb is refused naming the member), and members are decompressed as streams capped at that size.
* Every path is checked to be a regular file before it is opened
  (:func:`~pytest_dnnsafety.files.parsing.open_regular`): a FIFO, a device, a symlink loop is named
  for what it is, and nothing blocks.

Every member of a zip-based file is CRC-checked before torch sees it: torch's own zip reader
does not check CRCs, so a flipped byte in a weight would otherwise load silently as a wrong weight.
A file that is not a well-formed file of the expected kind (random bytes, empty, truncated, a
damaged zip) is reported as such, naming what was found and never suggesting
``dnnsafety_allow_pickle``; only a well-formed pickle that holds Python objects gets the
"refused to unpickle" message. Every error names the file or factory, the
setting and where it came from, and the fix.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import sys
import warnings
import zipfile
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch

from pytest_dnnsafety.data.tasks import BoxSet, DetectionData
from pytest_dnnsafety.files.archives import (
    NotValid,
    Refused,
    check_torch_file,
    describe_bytes,
    describe_file,
    first_line,
    listing,
    open_zip,
    verify_crcs,
    weights_only_forced,
    zip_kind,
)
from pytest_dnnsafety.settings import Resolved, Settings
from pytest_dnnsafety.files.parsing import NotRegularFile, data_budget, format_bytes, not_regular, open_regular
from pytest_dnnsafety.files.arrays import LARGE_FIX, TooLarge, read_npy, read_npz
from pytest_dnnsafety.files.pt2_program import example_inputs_problem
from pytest_dnnsafety.data.forms import as_tensors, check_loader_order
from pytest_dnnsafety.errors import ConfigError, DataError, DnnSafetyError, ModelLoadError

__all__ = [
    "import_factory",
    "load_model",
    "load_dataset",
    "load_operational_data",
    "read_array_file",
    "existing_file",
    "call_factory",
]


def import_factory(spec: str, source: str, search_dir: Path | None = None) -> Callable[..., Any]:
    """Import ``package.module:attr.path`` and return the attribute (a callable)."""
    module_name, _, attr_path = spec.partition(":")
    if search_dir is not None and str(search_dir) not in sys.path:
        # The ini file's folder, last on the path: user packages next to pyproject.toml import.
        sys.path.append(str(search_dir))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{spec!r} (from {source}): cannot import module {module_name!r}: {exc}. Fix: make the "
            "module importable (install it, or add its folder to `pythonpath` in your pytest ini)."
        ) from exc
    except Exception as exc:  # the user's module itself raised while importing
        raise ConfigError(
            f"{spec!r} (from {source}): importing module {module_name!r} raised "
            f"{type(exc).__name__}: {exc}. Fix: the error is in that module."
        ) from exc
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{spec!r} (from {source}): module {module_name!r} has no attribute {attr_path!r}. "
                "Fix: name an existing callable."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{spec!r} (from {source}): {attr_path!r} is not callable.")
    return obj


def call_factory(
    resolved: Resolved, settings: Settings, returns: str, error: type[DnnSafetyError]
) -> Any:
    """Import the ``package.module:callable`` in ``resolved`` and call it with no arguments.

    An exception inside the user's factory becomes ``error``, naming the factory, the setting and
    its source, the exception's type and message; the original is chained as ``__cause__``.
    """
    factory = import_factory(resolved.value, resolved.source, settings.ini_dir)
    try:
        return factory()
    except Exception as exc:
        detail = first_line(exc) or "(no message)"
        raise error(
            f"dnnsafety_{resolved.name}={resolved.value!r} (from {resolved.source}): the factory "
            f"{resolved.value} raised {type(exc).__name__}: {detail}. Fix: the error is in that factory "
            f"(see the chained traceback); called with no arguments it must return {returns}."
        ) from exc


#: What each file setting must point at, for "is a directory" and "not valid" messages.
_FILE_KINDS = {
    "model": "a model file: a TorchScript archive (torch.jit.save), a torch.export program (.pt2), "
             "an ONNX model (.onnx, with the [onnx] extra) or a state dict (.pt/.pth, with dnnsafety_model_factory)",
    "data": "a data file: .npz (keys x, y), .npy (x only) or .pt/.pth (a tensor or a dict of tensors)",
    "operational_data": "a data file: .npz (key x), .npy or .pt/.pth (a tensor or a dict of tensors)",
    "scenarios": "a CSV file with one row per evaluation sample",
    "conditions": "a TOML file with a [conditions] table",
    "predictions": "a file of recorded predictions: .npy/.npz class scores (one row per evaluation sample) or a COCO "
                   "results .json",
}


def existing_file(settings: Settings, resolved: Resolved) -> Path:
    path = settings.path(resolved)
    where = f"dnnsafety_{resolved.name}={resolved.value!r} (from {resolved.source})"
    kind = _FILE_KINDS.get(resolved.name, "a file")
    try:
        what = not_regular(path)  # nothing is opened: a FIFO would block
    except OSError:
        what = None if path.is_file() else ""
    if what == "a directory":
        raise ConfigError(
            f"{where}: {path} is a directory, not a file. Fix: point dnnsafety_{resolved.name} at {kind}."
        )
    if what:
        raise ConfigError(
            f"{where}: {path} is {what}, not a regular file; refused before opening it. "
            f"Fix: point dnnsafety_{resolved.name} at {kind}."
        )
    if what == "":
        raise ConfigError(
            f"{where}: file not found at {path}. Fix: correct the path (relative paths are taken from "
            "the ini file's folder for ini options and from the current folder for CLI flags and "
            "environment variables)."
        )
    return path


# ------------------------------------------------------------------------------------------ models


def load_model(settings: Settings, device: torch.device) -> Any:
    """The model named by ``dnnsafety_model`` (and ``dnnsafety_model_factory``), in eval mode."""
    resolved = settings.require("model", "the model")
    factory_setting = settings.get("model_factory")
    exported = False
    if resolved.is_factory:
        model = call_factory(resolved, settings, "a torch.nn.Module or a callable model", ModelLoadError)
    else:
        path = existing_file(settings, resolved)
        model, exported = _load_model_file(path, resolved, settings, factory_setting)
    if isinstance(model, torch.nn.Module):
        model = model.to(device)
        # A torch.export program's train/eval behaviour was fixed when it was exported (export it
        # from a model in eval mode); its module refuses .eval().
        if not exported:
            model.eval()
    elif not callable(model):
        raise ModelLoadError(
            f"dnnsafety_model={resolved.value!r} (from {resolved.source}) gave a "
            f"{type(model).__name__}, not a torch.nn.Module or callable."
        )
    return model


_MODEL_FIX = (
    "Fix: save the model again (the file may be truncated or damaged in transfer) as TorchScript "
    "(torch.jit.save), a torch.export program (torch.export.save, .pt2) or a state dict "
    "(torch.save(model.state_dict(), path) with dnnsafety_model_factory), and point dnnsafety_model at it."
)
_EXPORT_FIX = (
    "Fix: save it with torch.export.save(torch.export.export(model.eval(), example_inputs), 'model.pt2')."
)
_PICKLE_OPT_IN = "only for a file you trust, set dnnsafety_allow_pickle=true."


def _load_model_file(path: Path, resolved: Resolved, settings: Settings, factory: Resolved) -> tuple[Any, bool]:
    """Load a model file by what its bytes are; the model and whether it is a torch.export program."""
    where = f"dnnsafety_model={resolved.value!r} (from {resolved.source})"
    allow_pickle = bool(settings.value("allow_pickle"))
    if path.suffix.lower() == ".onnx":  # the suffix decides: ONNX has no magic bytes (plain protobuf)
        from pytest_dnnsafety.files.onnx_model import OnnxModel  # onnxruntime imported lazily, for .onnx only

        return OnnxModel.from_file(path, where, allow_external=bool(settings.value("onnx_external_data")),
                                   allow_custom_domains=bool(settings.value("onnx_custom_domains"))), False
    is_pt2 = path.suffix.lower() == ".pt2"
    expected = "torch.export program (.pt2)" if is_pt2 else "model"
    fix = _EXPORT_FIX if is_pt2 else _MODEL_FIX
    try:
        if is_pt2 and not allow_pickle:  # read once and checked as the bytes torch's own zip reader sees
            return _load_export(path, where, allow_pickle), True
        with open_regular(path) as handle:
            is_zip = handle.read(4) == b"PK\x03\x04"
        kind = None
        if is_zip:
            with open_zip(path) as archive:
                kind = zip_kind(archive.namelist())
                if kind == "torchscript":  # a torch.save zip is checked by check_torch_file, a .pt2 by _load_export
                    verify_crcs(archive)
        if is_pt2 and kind != "export":  # a .pt2 is a torch.export archive; anything else is named
            raise NotValid(describe_file(path))
        if kind == "export":
            return _load_export(path, where, allow_pickle), True
        if kind == "torchscript":
            return _load_torchscript(path, where), False
        refused = check_torch_file(path, scan=not allow_pickle)
    except NotValid as exc:
        suffix = path.suffix.lower()
        note = (f" (the suffix {suffix!r} is not a PyTorch model format)"
                if suffix not in (".pt", ".pth", ".pt2", ".onnx", ".ts", ".jit", ".zip", ".bin") else "")
        raise ModelLoadError(
            f"{where}: {path.name} is not a valid {expected} file: found {exc}{note}. {fix}"
        ) from None
    except Refused as exc:  # only from the .pt2 check above
        raise ModelLoadError(
            f"{where}: refused to {exc.verb} {path.name}: it holds {exc.listing()}; loading it would run "
            f"code from the file. {_EXPORT_FIX[:-1]} from a plain torch.nn.Module; {_PICKLE_OPT_IN}"
        ) from None
    if refused:
        raise ModelLoadError(
            f"{where}: refused to unpickle {path.name}: it holds Python objects, not only tensors "
            f"({listing(refused)}), and loading it would run code from the file (the torch.load "
            "weights_only=True allow-list rejects them). Fix: save a state dict (torch.save(model.state_dict(), "
            "...)) and set dnnsafety_model_factory, or save TorchScript (torch.jit.save) or a torch.export "
            f"program (.pt2); {_PICKLE_OPT_IN}"
        )
    obj = _torch_load(path, where, f"a valid {expected} file", allow_pickle, ModelLoadError, _MODEL_FIX)
    if isinstance(obj, Mapping):
        return _load_state_dict(obj, where, path, settings, factory), False
    if isinstance(obj, torch.nn.Module) or callable(obj):
        return obj, False
    raise ModelLoadError(f"{where}: {path.name} holds a {type(obj).__name__}, not a model or state dict.")


def _torch_load(
    path: Path, where: str, valid: str, allow_pickle: bool, error: type[DnnSafetyError], fix: str
) -> Any:
    """``torch.load`` a file that :func:`check_torch_file` accepted; torch's own refusals named.

    Without ``allow_pickle`` it runs with ``weights_only=True`` under :func:`weights_only_forced`.
    """
    try:
        if allow_pickle:
            return torch.load(str(path), map_location="cpu", weights_only=False)
        with weights_only_forced():
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # The static scan found only allowed globals, so torch refused something else (e.g. a
        # pickle protocol its weights-only unpickler does not read).
        text = str(exc)
        reason = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else text
        reason = next((line.strip() for line in reason.splitlines() if line.strip()), "no reason given")
        raise error(
            f"{where}: refused to unpickle {path.name}: torch's weights-only loader rejected it ({reason}). "
            "Fix: save it again with torch.save(obj, path) and the default pickle protocol"
            + ("; " + _PICKLE_OPT_IN if error is ModelLoadError else ".")
        ) from exc
    except Exception as exc:  # torch raises many types for a damaged file
        raise error(
            f"{where}: {path.name} is not {valid}: torch.load failed with {type(exc).__name__}: "
            f"{first_line(exc)}. {fix}"
        ) from exc


def _load_export(path: Path, where: str, allow_pickle: bool) -> Any:
    """A torch.export program's module; without ``allow_pickle`` only after :func:`check_export_archive`.

    The file is read once: the check and ``torch.export.load`` see the very same bytes, so a file
    replaced between the two cannot be loaded unchecked.
    """
    # imported here: torch.export.pt2_archive pulls in ~800 torch modules, only a .pt2 needs them
    from pytest_dnnsafety.files.pt2_archive import check_export_archive

    with open_regular(path) as handle:
        data = handle.read()
    if allow_pickle:
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                verify_crcs(archive)
        except (zipfile.BadZipFile, EOFError, ValueError, OSError) as exc:
            raise NotValid(f"a damaged zip archive ({exc})") from None
    else:
        check_export_archive(data, path)
    guard = nullcontext() if allow_pickle else weights_only_forced()
    try:
        with guard:
            program = torch.export.load(io.BytesIO(data))
            problem = None if allow_pickle else example_inputs_problem(program.example_inputs)
            if problem:  # .module() would paste these keys into the code of its input guards
                raise Refused(path.name, [path.name], problem, verb="load")
            return program.module()
    except Refused:
        raise
    except pickle.UnpicklingError as exc:
        raise ModelLoadError(
            f"{where}: refused to unpickle a pickle inside {path.name}: torch's weights-only loader "
            f"rejected it ({first_line(exc)}). {_EXPORT_FIX[:-1]} from a plain torch.nn.Module; {_PICKLE_OPT_IN}"
        ) from exc
    except Exception as exc:  # torch raises many types for a bad archive
        raise ModelLoadError(
            f"{where}: {path.name} is not a valid torch.export program (.pt2) file: torch.export.load "
            f"failed with {type(exc).__name__}: {first_line(exc)}. {_EXPORT_FIX}"
        ) from exc


def _load_torchscript(path: Path, where: str) -> Any:
    """A TorchScript archive via :func:`torch.jit.load` (C++ unpickler: no Python globals, see the module doc)."""
    try:
        with warnings.catch_warnings():
            # TorchScript is deprecated upstream but still a supported model format here; its
            # DeprecationWarning must not break users who run with -W error.
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:
        raise ModelLoadError(
            f"{where}: {path.name} is not a valid TorchScript archive: torch.jit.load failed with "
            f"{type(exc).__name__}: {first_line(exc)}. Fix: save it again with "
            "torch.jit.save(torch.jit.script(model), path) (the file may be truncated or damaged)."
        ) from exc


def _load_state_dict(obj: Mapping[str, Any], where: str, path: Path, settings: Settings, factory: Resolved) -> Any:
    """Load a state dict (bare, or under ``"state_dict"``) into the module from ``dnnsafety_model_factory``."""
    if factory.value is None:
        raise ConfigError(
            f"{where}: {path.name} is a state dict; a module to load it into is needed. Fix: set "
            "dnnsafety_model_factory = 'package.module:build_model'."
        )
    if not factory.is_factory:
        raise ConfigError(
            f"dnnsafety_model_factory={factory.value!r} (from {factory.source}): expected "
            "'package.module:callable'."
        )
    module = call_factory(factory, settings, "the untrained torch.nn.Module", ModelLoadError)
    if not isinstance(module, torch.nn.Module):
        raise ModelLoadError(
            f"dnnsafety_model_factory={factory.value!r} returned {type(module).__name__}, "
            "not a torch.nn.Module."
        )
    state = obj.get("state_dict", obj) if isinstance(obj.get("state_dict"), Mapping) else obj
    fix = "Fix: point dnnsafety_model_factory at the architecture the weights were saved from."
    try:
        result = module.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches raise even with strict=False
        raise ModelLoadError(
            f"{where}: state dict does not fit the module from {factory.value!r}: {exc}. {fix}"
        ) from exc
    if result.missing_keys or result.unexpected_keys:
        raise ModelLoadError(
            f"{where}: state dict does not fit the module from {factory.value!r}: missing "
            f"{list(result.missing_keys)[:5]}, unexpected {list(result.unexpected_keys)[:5]}. {fix}"
        )
    return module


# ---------------------------------------------------------------------------------------------- data


_DATA_SUFFIXES = (".npz", ".npy", ".pt", ".pth")
_KIND_OF_SUFFIX = {".npz": "NumPy .npz", ".npy": "NumPy .npy", ".pt": "PyTorch .pt", ".pth": "PyTorch .pth"}
_DATA_FIX = {
    ".npz": "Fix: write it again with np.savez(path, x=x, y=y) (the file may be truncated or damaged in transfer).",
    ".npy": "Fix: write it again with np.save(path, x) (the file may be truncated or damaged in transfer).",
    ".pt": "Fix: write it again with torch.save({'x': x, 'y': y}, path) (the file may be truncated or damaged "
           "in transfer).",
}


def read_array_file(path: Path, what: str, budget: int | None = None, raw: bytes | None = None) -> Any:
    """The contents of a data file: a dict of arrays (.npz), an array (.npy) or torch.load's result (.pt).

    ``budget``: the most bytes of array data to read (default :func:`~.parsing.data_budget`); a file
    declaring more is refused before its data is read. A path that is not a regular file is refused
    before it is opened. ``raw`` (.npy and .npz only): the file's bytes, read already
    (:func:`~.parsing.read_bounded`) and fingerprinted by the caller, parsed instead of reading ``path`` again.
    """
    suffix = path.suffix.lower()
    if suffix not in _DATA_SUFFIXES:
        raise DataError(
            f"{what}: {path} has an unknown suffix {suffix!r}. Fix: use .npz, .npy or .pt (or .pth), or a "
            "'package.module:load' factory that returns the arrays."
        )
    budget = data_budget() if budget is None else budget
    expected = _KIND_OF_SUFFIX[suffix]
    fix = _DATA_FIX.get(suffix, _DATA_FIX[".pt"])
    try:
        if suffix == ".npz":
            return read_npz(path, budget, raw)
        if suffix == ".npy" and raw is not None:
            if not raw.startswith(b"\x93NUMPY"):
                raise NotValid(describe_bytes(raw[:512], len(raw)))
            return read_npy(io.BytesIO(raw), path.name, len(raw), budget)
        if raw is not None:
            raise ValueError(f"read_array_file: raw bytes are read for .npy and .npz only, not {suffix}")
        if suffix == ".npy":
            with open_regular(path) as handle:
                head = handle.read(512)
                size = os.fstat(handle.fileno()).st_size
                if not head.startswith(b"\x93NUMPY"):
                    raise NotValid(describe_bytes(head, size))
                handle.seek(0)
                return read_npy(handle, path.name, size, budget)
        with open_regular(path) as handle:
            size = os.fstat(handle.fileno()).st_size
        if size > budget:  # torch.save files are not compressed: the file size is the data size
            raise TooLarge(f"the file is {format_bytes(size)}, more than the read budget of {format_bytes(budget)} "
                            "for one data file; refused before reading it")
        refused = check_torch_file(path, scan=True)
    except NotRegularFile as exc:
        raise DataError(f"{what}: {exc}; refused before opening it. Fix: point the setting at {expected} "
                        "file.") from None
    except FileNotFoundError:
        raise DataError(f"{what}: file not found at {path}. Fix: correct the path.") from None
    except NotValid as exc:
        raise DataError(f"{what}: {path} is not a valid {expected} file: found {exc}. {fix}") from None
    except TooLarge as exc:
        raise DataError(f"{what}: {path}: {exc}. {LARGE_FIX}.") from None
    except Refused as exc:
        raise DataError(
            f"{what}: {path} holds pickled objects, which are refused: {exc.listing()}; reading them would "
            "run code from the file (numpy allow_pickle=False). Fix: save numeric arrays, e.g. "
            "np.savez(path, x=x.astype(np.float32), y=y.astype(np.int64))."
        ) from None
    if refused:
        raise DataError(
            f"{what}: {path} holds Python objects, not only tensors; refused (weights_only=True): "
            f"{listing(refused)}. Fix: save a tensor or a dict of tensors, e.g. torch.save({{'x': x, 'y': y}}, path)."
        )
    return _torch_load(path, what, f"a valid {expected} file", False, DataError, fix)


def _load_data_setting(settings: Settings, name: str, what: str, made: Any = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, y)`` of setting ``name``; ``made``: what its factory already returned (the factory is not called again)."""
    resolved = settings.require(name, what)
    label = f"{what} (dnnsafety_{name}={resolved.value!r} from {resolved.source})"
    if resolved.is_factory:
        raw = made if made is not None else call_factory(
            resolved, settings, "(x, y), x, a dict with 'x', a TensorDataset or a DataLoader", DataError)
        if raw is None:
            raise DataError(f"{label}: the factory returned None. Fix: return (x, y), x, a dict with 'x', a "
                            "TensorDataset or a DataLoader (a missing `return`?).")
    else:
        raw = read_array_file(existing_file(settings, resolved), label)
    if isinstance(raw, Mapping) and "x" not in raw:
        raise DataError(f"{label}: expected keys 'x' (and 'y'); found {sorted(raw)}.")
    return as_tensors(raw, label)


def load_dataset(settings: Settings, name: str = "data", what: str = "evaluation data"
                 ) -> torch.utils.data.Dataset | torch.utils.data.DataLoader:
    """The data of setting ``name`` as a ``TensorDataset(x, y)`` (``(x,)`` when unlabelled).

    ``y`` is ``(N,)`` class indices, or a ``(N, classes)`` 0/1 matrix for a multi-label task. Detection
    data (keys ``x``, ``boxes``, ``labels``, ``offsets``: image i's objects are rows
    ``offsets[i]:offsets[i+1]`` of ``boxes`` ``(M, 4)`` and ``labels`` ``(M,)``) come back as a
    :class:`~pytest_dnnsafety.data.tasks.DetectionData`; a COCO annotations ``.json`` as a
    :class:`~pytest_dnnsafety.files.coco.CocoDetectionData` (its images read lazily from ``dnnsafety_images``).

    ``dnnsafety_data`` (the labelled evaluation data) by default; also ``monitor_data`` (what runtime
    monitors are fitted on) and ``ood_data`` (novel classes). A factory that returns a ``DataLoader``
    gets it back as it is (checked to read in order), so data larger than memory streams: every gate
    reads a loader batch by batch.
    """
    resolved = settings.require(name, what)
    if resolved.is_factory:
        made = call_factory(resolved, settings, "(x, y), x, a dict with 'x', a TensorDataset or a DataLoader",
                             DataError)
        if isinstance(made, torch.utils.data.DataLoader):
            check_loader_order(made, f"{what} (dnnsafety_{name}={resolved.value!r} from {resolved.source})")
            return made
    if resolved.is_factory and isinstance(made, DetectionData):
        return made
    if not resolved.is_factory and str(resolved.value).lower().endswith(".json"):  # COCO annotations
        from pytest_dnnsafety.files.coco import from_coco

        images = settings.get("images")
        return from_coco(existing_file(settings, resolved), None if images.value is None else settings.path(images),
                         f"{what} (dnnsafety_{name}={resolved.value!r} from {resolved.source})")
    x, y = _load_data_setting(settings, name, what, made if resolved.is_factory else None)
    if isinstance(y, BoxSet):  # detection targets (.npz keys x, boxes, labels, offsets)
        return DetectionData(x, y)
    return torch.utils.data.TensorDataset(x, y) if y is not None else torch.utils.data.TensorDataset(x)


def load_operational_data(settings: Settings) -> torch.Tensor:
    """Unlabelled operational inputs (labels, if present, are ignored)."""
    x, _ = _load_data_setting(settings, "operational_data", "operational data")
    return x
