"""Load models, data and scenario tables from files or factories, safely.

Model files are never unpickled as arbitrary objects unless the user opts in with
``dnnsafety_allow_pickle``: TorchScript archives go through :func:`torch.jit.load`, ``torch.export``
programs through :func:`torch.export.load`, state dicts through ``torch.load(weights_only=True)``
into a module built by ``dnnsafety_model_factory``.

Every error names the file or factory, the setting it came from and the fix.
"""

from __future__ import annotations

import importlib
import pickle
import warnings
import sys
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

import torch

from .config import Resolved, Settings
from .errors import ConfigError, DataError, ModelLoadError

__all__ = [
    "resolve_device",
    "import_factory",
    "load_model",
    "load_dataset",
    "load_operational_data",
    "load_operational_profile",
    "load_scenario_table",
    "as_tensors",
    "iter_batches",
]


def resolve_device(resolved: Resolved | str) -> torch.device:
    """Turn ``auto``/``cpu``/``cuda[:n]``/``mps`` into a usable :class:`torch.device`."""
    text = resolved.value if isinstance(resolved, Resolved) else str(resolved)
    source = resolved.source if isinstance(resolved, Resolved) else "argument"
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"dnnsafety_device={text!r} (from {source}): CUDA is not available on this machine "
                "(torch.cuda.is_available() is False). Fix: use dnnsafety_device=auto or cpu."
            )
        index = int(text.split(":", 1)[1]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"dnnsafety_device={text!r} (from {source}): only {torch.cuda.device_count()} CUDA "
                "device(s) present. Fix: pick an existing index or use auto."
            )
    if text == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ConfigError(
            f"dnnsafety_device='mps' (from {source}): MPS is not available. Fix: use auto or cpu."
        )
    return torch.device(text)


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


def _existing_file(settings: Settings, resolved: Resolved) -> Path:
    path = settings.path(resolved)
    if not path.is_file():
        raise ConfigError(
            f"dnnsafety_{resolved.name}={resolved.value!r} (from {resolved.source}): file not found "
            f"at {path}. Fix: correct the path (relative paths are taken from the ini file's folder "
            "for ini options and from the current folder for CLI flags and environment variables)."
        )
    return path


def _is_torchscript(path: Path) -> bool:
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    return any(name.endswith("constants.pkl") or "/code/" in name for name in names)


def load_model(settings: Settings, device: torch.device) -> Any:
    """The model named by ``dnnsafety_model`` (and ``dnnsafety_model_factory``), in eval mode."""
    resolved = settings.require("model", "the model")
    factory_setting = settings.get("model_factory")
    exported = False
    if resolved.is_factory:
        model = import_factory(resolved.value, resolved.source, settings.ini_dir)()
    else:
        path = _existing_file(settings, resolved)
        model = _load_model_file(path, resolved, settings, factory_setting)
        # A torch.export program's train/eval behaviour was fixed when it was exported (export it
        # from a model in eval mode); its module refuses .eval().
        exported = path.suffix == ".pt2"
    if isinstance(model, torch.nn.Module):
        model = model.to(device)
        if not exported:
            model.eval()
    elif not callable(model):
        raise ModelLoadError(
            f"dnnsafety_model={resolved.value!r} (from {resolved.source}) gave a "
            f"{type(model).__name__}, not a torch.nn.Module or callable."
        )
    return model


def _load_model_file(path: Path, resolved: Resolved, settings: Settings, factory: Resolved) -> Any:
    where = f"dnnsafety_model={resolved.value!r} (from {resolved.source})"
    if path.suffix == ".pt2":
        try:
            return torch.export.load(str(path)).module()
        except Exception as exc:  # torch raises many types for a bad archive
            raise ModelLoadError(f"{where}: not a loadable torch.export program: {exc}") from exc
    if _is_torchscript(path):
        with warnings.catch_warnings():
            # TorchScript is deprecated upstream but still a supported model format here; its
            # DeprecationWarning must not break users who run with -W error.
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.load(str(path), map_location="cpu")
    allow_pickle = settings.value("allow_pickle")
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        raise ModelLoadError(
            f"{where}: refused to unpickle {path.name}: it holds Python objects, not only tensors, and "
            "loading it would run code from the file (torch.load weights_only=True rejected it). Fix: "
            "save a state dict (torch.save(model.state_dict(), ...)) and set dnnsafety_model_factory, or "
            "save TorchScript (torch.jit.save) or a torch.export program (.pt2); only for a file you "
            "trust, set dnnsafety_allow_pickle=true."
        ) from exc
    except Exception as exc:
        raise ModelLoadError(f"{where}: cannot read {path}: {exc}") from exc
    if isinstance(obj, Mapping):
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
        module = import_factory(factory.value, factory.source, settings.ini_dir)()
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
    if isinstance(obj, torch.nn.Module) or callable(obj):
        return obj
    raise ModelLoadError(f"{where}: {path.name} holds a {type(obj).__name__}, not a model or state dict.")


# ---------------------------------------------------------------------------------------------- data


def as_tensors(data: Any, what: str = "data") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalise ``(x, y)``, ``x``, a dict, a TensorDataset or a DataLoader into tensors.

    Checks shape agreement and finiteness; ``y`` may be missing (unlabelled data).
    """
    x: Any
    y: Any = None
    if isinstance(data, torch.utils.data.DataLoader):
        xs, ys = [], []
        for batch in data:
            bx, by = _split_batch(batch)
            xs.append(torch.as_tensor(bx))
            if by is not None:
                ys.append(torch.as_tensor(by))
        if not xs:
            raise DataError(f"{what}: the DataLoader yielded no batches. Fix: give it a non-empty dataset.")
        x = torch.cat(xs)
        y = torch.cat(ys) if ys else None
    elif isinstance(data, torch.utils.data.TensorDataset):
        x = data.tensors[0]
        y = data.tensors[1] if len(data.tensors) > 1 else None
    elif isinstance(data, Mapping):
        if "x" not in data:
            raise DataError(f"{what}: a dict of arrays needs key 'x' (and 'y' for labels); got {sorted(data)}.")
        x, y = data["x"], data.get("y")
    elif isinstance(data, (tuple, list)) and len(data) in (1, 2) and not _is_scalar_list(data):
        x = data[0]
        y = data[1] if len(data) == 2 else None
    else:
        x = data
    x = _to_tensor(x, what, "x")
    y = _to_tensor(y, what, "y") if y is not None else None
    if x.ndim == 0 or x.shape[0] == 0:
        raise DataError(f"{what}: no samples (x has shape {tuple(x.shape)}). Fix: provide a non-empty data set.")
    if not torch.is_floating_point(x):
        x = x.float()
    bad = (~torch.isfinite(x)).sum().item()
    if bad:
        raise DataError(
            f"{what}: x holds {bad} NaN/inf value(s). Fix: clean or impute the inputs before evaluating."
        )
    if y is not None:
        if y.shape[0] != x.shape[0]:
            raise DataError(
                f"{what}: x has {x.shape[0]} samples but y has {y.shape[0]} labels. Fix: align inputs and labels."
            )
        if torch.is_floating_point(y):
            if not torch.isfinite(y).all() or not torch.equal(y, y.round()):
                raise DataError(f"{what}: labels y must be integer class indices.")
            y = y.long()
        else:
            y = y.long()
    return x, y


def iter_batches(data: Any, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Yield ``(x, y)`` batches (``y`` may be None) from any accepted data form.

    A ``DataLoader`` is iterated as it is (its own batch size wins); tensors, arrays,
    ``(x, y)`` pairs, dicts and ``TensorDataset`` are sliced into ``batch_size`` rows.
    """
    if isinstance(data, torch.utils.data.DataLoader):
        for batch in data:
            bx, by = _split_batch(batch)
            yield torch.as_tensor(bx), (torch.as_tensor(by) if by is not None else None)
        return
    x, y = as_tensors(data)
    for start in range(0, x.shape[0], batch_size):
        yield x[start:start + batch_size], (y[start:start + batch_size] if y is not None else None)


def _is_scalar_list(data: Sequence[Any]) -> bool:
    return all(isinstance(item, (int, float)) for item in data)


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    if isinstance(batch, Mapping):
        return batch["x"], batch.get("y")
    return batch, None


def _to_tensor(value: Any, what: str, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        return torch.as_tensor(value)
    except Exception as exc:
        raise DataError(f"{what}: {name} cannot be turned into a tensor: {exc}") from exc


def _read_array_file(path: Path, what: str) -> Any:
    suffix = path.suffix.lower()
    if suffix in (".npz", ".npy"):
        import numpy as np

        try:
            loaded = np.load(path, allow_pickle=False)
            if suffix == ".npy":
                return loaded
            with loaded:  # an .npz reads (and refuses object arrays) key by key
                return {key: loaded[key] for key in loaded.files}
        except ValueError as exc:
            raise DataError(f"{what}: {path} holds pickled objects, which are refused: {exc}") from exc
    if suffix in (".pt", ".pth"):
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise DataError(
                f"{what}: {path} holds Python objects, not only tensors; refused (weights_only=True). "
                "Fix: save a tensor or a dict of tensors."
            ) from exc
    raise DataError(f"{what}: {path} has an unknown suffix {suffix!r}. Fix: use .npz, .npy or .pt.")


def _load_data_setting(settings: Settings, name: str, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    resolved = settings.require(name, what)
    label = f"{what} (dnnsafety_{name}={resolved.value!r} from {resolved.source})"
    if resolved.is_factory:
        raw = import_factory(resolved.value, resolved.source, settings.ini_dir)()
    else:
        raw = _read_array_file(_existing_file(settings, resolved), label)
    if isinstance(raw, Mapping) and "x" not in raw:
        raise DataError(f"{label}: expected keys 'x' (and 'y'); found {sorted(raw)}.")
    return as_tensors(raw, label)


def load_dataset(settings: Settings) -> torch.utils.data.TensorDataset:
    """The labelled evaluation data as a ``TensorDataset(x, y)`` (``(x,)`` when unlabelled)."""
    x, y = _load_data_setting(settings, "data", "evaluation data")
    return torch.utils.data.TensorDataset(x, y) if y is not None else torch.utils.data.TensorDataset(x)


def load_operational_data(settings: Settings) -> torch.Tensor:
    """Unlabelled operational inputs (labels, if present, are ignored)."""
    x, _ = _load_data_setting(settings, "operational_data", "operational data")
    return x


def load_operational_profile(settings: Settings, device: torch.device) -> Any:
    """An :class:`~pytest_dnnsafety.profile.OperationalProfile` from ``dnnsafety_operational_data``.

    A ``pkg.module:factory`` may return a ready profile (e.g. one in a PCA latent space) or
    operational data; a file holds the data. Data gets a Gaussian KDE with Scott's bandwidth.
    """
    from .profile import OperationalProfile

    resolved = settings.require("operational_data", "the operational profile")
    if resolved.is_factory:
        made = import_factory(resolved.value, resolved.source, settings.ini_dir)()
        if isinstance(made, OperationalProfile):
            return made
        x, _ = as_tensors(made, f"operational data (dnnsafety_operational_data={resolved.value!r})")
    else:
        x = load_operational_data(settings)
    return OperationalProfile(x, device=device)


def load_scenario_table(settings: Settings) -> Any:
    """The scenario table from ``dnnsafety_scenarios`` (CSV) and ``dnnsafety_conditions`` (TOML)."""
    scen = settings.require("scenarios", "the scenario table")
    from .scenarios import Conditions, ScenarioTable

    if scen.is_factory:
        table = import_factory(scen.value, scen.source, settings.ini_dir)()
        if not isinstance(table, ScenarioTable):
            raise ConfigError(
                f"dnnsafety_scenarios={scen.value!r} (from {scen.source}) returned "
                f"{type(table).__name__}, not a pytest_dnnsafety.ScenarioTable."
            )
        return table
    csv_path = _existing_file(settings, scen)
    cond = settings.require("conditions", "the operating conditions (each condition's value domain)")
    conditions = Conditions.from_toml(_existing_file(settings, cond))
    return ScenarioTable.from_csv(csv_path, conditions)
