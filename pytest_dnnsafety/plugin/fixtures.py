"""Fixture values built from the settings: the operational profile, segmentation masks and the scenario table.

They read their files through :mod:`pytest_dnnsafety.files.loading` (no unpickling, bounded reads) and
build the objects of the layers below (the reliability family's profile, the interpretability family's
masks, the scenario table).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import torch

from pytest_dnnsafety.data.forms import as_tensors
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.files.loading import call_factory, existing_file, load_operational_data
from pytest_dnnsafety.files.loading import read_array_file
from pytest_dnnsafety.settings import Settings

__all__ = ["load_operational_profile", "load_masks", "load_scenario_table", "load_model_or_predictions"]


def load_model_or_predictions(settings: Settings, device: torch.device, dataset: Callable[[], Any]) -> Any:
    """The ``model`` fixture's value: the model of ``dnnsafety_model``, or — with ``dnnsafety_predictions`` set —
    :class:`~pytest_dnnsafety.files.predictions.RecordedPredictions` read against the evaluation data
    (``dataset()``, the ``dataset`` fixture) and holding the model when ``dnnsafety_model`` is set too (else None:
    the model is not loaded, and gates that need it are refused by name)."""
    from pytest_dnnsafety.files.loading import load_model
    from pytest_dnnsafety.files.predictions import RecordedPredictions

    resolved = settings.get("predictions")
    if resolved.value is None:
        return load_model(settings, device)
    path = existing_file(settings, resolved)
    model = load_model(settings, device) if settings.get("model").value is not None else None
    what = f"recorded predictions (dnnsafety_predictions={resolved.value!r} from {resolved.source})"
    return RecordedPredictions.from_file(path, dataset(), model, what=what)


def load_operational_profile(settings: Settings, device: torch.device) -> Any:
    """An :class:`~pytest_dnnsafety.engines.reliability.profile.OperationalProfile` from ``dnnsafety_operational_data``.

    A ``pkg.module:factory`` may return a ready profile (e.g. one in a PCA latent space) or
    operational data; a file holds the data. Data gets a Gaussian KDE with Scott's bandwidth — up to
    :data:`~pytest_dnnsafety.engines.reliability.latent.KDE_MAX_DIM` values per input. Above it (images) no
    KDE is fitted: the data come back as
    :class:`~pytest_dnnsafety.engines.reliability.latent.OperationalInputs`, read in blocks by ball cells
    (a ``.npy`` file a slice of rows at a time, a factory's ``DataLoader`` batch by batch) or encoded for
    ``latent=``, never held whole.
    """
    from pytest_dnnsafety.engines.reliability.latent import KDE_MAX_DIM, NpyRows, OperationalInputs
    from pytest_dnnsafety.engines.reliability.profile import OperationalProfile

    resolved = settings.require("operational_data", "the operational profile")
    label = f"operational data (dnnsafety_operational_data={resolved.value!r} from {resolved.source})"
    if resolved.is_factory:
        made = call_factory(resolved, settings, "an OperationalProfile or operational data", DataError)
        if isinstance(made, OperationalProfile):
            return made
        if isinstance(made, torch.utils.data.DataLoader) and _values_per_input(made) > KDE_MAX_DIM:
            return OperationalInputs(made, label)  # streamed: batch by batch
        x, _ = as_tensors(made, label)
    else:
        path = existing_file(settings, resolved)
        if path.suffix.lower() == ".npy" and path.is_file():  # a regular file (not a FIFO, not a folder)
            try:
                rows: Any = NpyRows(path, label)
            except DataError:
                rows = None  # the whole-file reader below names what is wrong with it
            if rows is not None and math.prod(rows.shape[1:]) > KDE_MAX_DIM:
                return OperationalInputs(rows, label)  # a slice of rows at a time
        x = load_operational_data(settings)
    if x.ndim > 1 and x[0].numel() > KDE_MAX_DIM:
        return OperationalInputs(x, label)
    return OperationalProfile(x, device=device)


def _values_per_input(loader: Any) -> int:
    """Values per input of a ``DataLoader``'s data (its dataset's first item, or its first batch)."""
    try:
        item = loader.dataset[0]
        batched = False
    except (TypeError, IndexError, NotImplementedError, KeyError):
        item, batched = next(iter(loader), None), True
    x = item[0] if isinstance(item, (tuple, list)) else item.get("x") if isinstance(item, Mapping) else item
    if x is None or not hasattr(x, "shape"):
        return 0
    shape = tuple(x.shape[1:]) if batched else tuple(x.shape)
    return math.prod(shape) if shape else 1


def load_masks(settings: Settings) -> Any:
    """The segmentation masks of ``dnnsafety_masks`` as a ``(N, H, W)`` bool tensor.

    A file (.npz with key ``masks``, .npy, .pt/.pth holding a tensor or ``{"masks": ...}``) read
    without unpickling, or a ``package.module:load`` factory returning the masks. Alignment with
    the data (count, H and W) is checked by the gate, which sees both.
    """
    from pytest_dnnsafety.engines.interpretability.occlusion import check_masks

    resolved = settings.require("masks", "the segmentation masks (fixture `masks`)")
    label = f"segmentation masks (dnnsafety_masks={resolved.value!r} from {resolved.source})"
    if resolved.is_factory:
        raw = call_factory(resolved, settings, "the masks: (N, H, W) booleans or {'masks': ...}", DataError)
        if raw is None:
            raise DataError(f"{label}: the factory returned None. Fix: return the masks (a missing `return`?).")
    else:
        raw = read_array_file(existing_file(settings, resolved), label)
        if isinstance(raw, Mapping) and "masks" not in raw and len(raw) == 1:
            raw = next(iter(raw.values()))  # an .npz saved with np.savez(path, m) has key arr_0
    return check_masks(raw, label)


def load_scenario_table(settings: Settings) -> Any:
    """The scenario table from ``dnnsafety_scenarios`` (CSV) and ``dnnsafety_conditions`` (TOML)."""
    scen = settings.require("scenarios", "the scenario table")
    from pytest_dnnsafety.scenarios import Conditions, ScenarioTable

    if scen.is_factory:
        table = call_factory(scen, settings, "a pytest_dnnsafety.ScenarioTable", ConfigError)
        if not isinstance(table, ScenarioTable):
            raise ConfigError(
                f"dnnsafety_scenarios={scen.value!r} (from {scen.source}) returned "
                f"{type(table).__name__}, not a pytest_dnnsafety.ScenarioTable."
            )
        return table
    csv_path = existing_file(settings, scen)
    cond = settings.require("conditions", "the operating conditions (each condition's value domain)")
    conditions = Conditions.from_toml(existing_file(settings, cond))
    return ScenarioTable.from_csv(csv_path, conditions)
