"""Settings resolution: marker > CLI > environment > ini > default.

Every setting has one definition here (:data:`SETTINGS`) from which the ini option, the CLI flag
and the environment variable are derived, so the four spellings can never drift apart::

    ini:  dnnsafety_batch_size = 256
    CLI:  --dnnsafety-batch-size=256
    env:  DNNSAFETY_BATCH_SIZE=256
    marker keyword (where the gate allows it): batch_size=256

A value is parsed and checked once, and a bad value raises :class:`~pytest_dnnsafety.errors.ConfigError`
naming the setting, the value, *where it came from* and the fix. No torch import here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from pytest_dnnsafety.errors import ConfigError

__all__ = [
    "Setting", "Resolved", "Settings", "SETTINGS", "FACTORY_RE", "MAX_SEED", "parse_device", "parse_setting",
]

#: ``package.module:callable`` (a factory) rather than a file path.
FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_MEMORY_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

_MISSING = object()

#: The largest seed accepted. Seeds reach torch.Generator.manual_seed (64-bit), int64 tensors and
#: the evidence files; a larger value would be accepted at start and crash a gate later.
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Setting:
    """One configurable value and its four spellings."""

    name: str
    kind: str  # "source" | "path" | "int" | "bool" | "device" | "threads" | "task" | "seconds" | "sample" | "memory"
    default: Any
    help: str
    fix: str
    minimum: int | None = None  # inclusive bounds of an "int" setting
    maximum: int | None = None

    @property
    def ini(self) -> str:
        return f"dnnsafety_{self.name}"

    @property
    def cli(self) -> str:
        return "--dnnsafety-" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return f"DNNSAFETY_{self.name.upper()}"

    @property
    def dest(self) -> str:
        return f"dnnsafety_{self.name}"


#: The tasks a model may have (see :mod:`pytest_dnnsafety.data.tasks`); setting ``task`` also takes ``auto``.
TASK_NAMES = ("single-label", "multi-label", "detection")

_SETTING_LIST = [
    Setting(
        "model", "source", None,
        "model to evaluate: a TorchScript file, a torch.export program (.pt2), a state dict "
        "(with dnnsafety_model_factory) or 'package.module:factory'",
        "set dnnsafety_model in your pytest ini options, or define a `model` fixture in conftest.py",
    ),
    Setting(
        "predictions", "path", None,
        "outputs recorded elsewhere (e.g. on the target), standing in for the model in the gates that read only "
        "outputs on dnnsafety_data: class scores or logits as .npy/.npz (one row per evaluation sample, in the "
        "data's order) or detections as a COCO results .json; the other gates run dnnsafety_model (refused without "
        "one)",
        "set dnnsafety_predictions to a .npy/.npz of (N, classes) scores or a COCO results .json recorded on "
        "dnnsafety_data",
    ),
    Setting(
        "model_factory", "source", None,
        "'package.module:callable' building the untrained module that a state-dict model file is loaded into",
        "set dnnsafety_model_factory = 'package.module:build_model'",
    ),
    Setting(
        "data", "source", None,
        "labelled evaluation data: .npz (keys x, y), .npy (x only), .pt (tensor or dict), a COCO annotations .json "
        "(detection; images from dnnsafety_images) or 'package.module:load'",
        "set dnnsafety_data in your pytest ini options, or define a `dataset` fixture in conftest.py",
    ),
    Setting(
        "images", "path", None,
        "the folder of the images a COCO annotations file (dnnsafety_data = \"annotations.json\") names by "
        "file_name: .npy arrays, or PNG/JPEG with Pillow (default: the annotations file's folder)",
        "set dnnsafety_images to the folder that holds the annotations' file_name entries",
    ),
    Setting(
        "scenarios", "source", None,
        "CSV scenario table: one row per evaluation sample, one column per operating condition",
        "set dnnsafety_scenarios (and dnnsafety_conditions), or define a `scenario_table` fixture in conftest.py",
    ),
    Setting(
        "conditions", "source", None,
        "TOML file with each operating condition's full value domain and the impossible combinations",
        "set dnnsafety_conditions to a TOML file with a [conditions] table (see docs/security.md)",
    ),
    Setting(
        "operational_data", "source", None,
        "unlabelled inputs representing the operational profile: .npz (key x), .npy, .pt or 'package.module:load'",
        "set dnnsafety_operational_data in your pytest ini options",
    ),
    Setting(
        "masks", "source", None,
        "per-input segmentation masks aligned with dnnsafety_data (one (H, W) boolean mask per input, same order): "
        ".npz (key masks), .npy, .pt (tensor or dict) or 'package.module:load'",
        "set dnnsafety_masks in your pytest ini options, or define a `masks` fixture in conftest.py",
    ),
    Setting(
        "monitor_data", "source", None,
        "in-distribution data the runtime monitors are fitted and calibrated on (e.g. the model's training data): "
        ".npz (keys x, y), .npy, .pt or 'package.module:load'",
        "set dnnsafety_monitor_data in your pytest ini options, or define a `monitor_data` fixture in conftest.py",
    ),
    Setting(
        "ood_data", "source", None,
        "inputs of classes the model was never trained on (the monitors' novel-class fault family): .npz (key x), "
        ".npy, .pt or 'package.module:load'",
        "set dnnsafety_ood_data in your pytest ini options, or define an `ood_data` fixture in conftest.py",
    ),
    Setting(
        "device", "device", "auto",
        "device for engines and the model: auto | cpu | cuda | cuda:N | mps",
        "use one of auto, cpu, cuda, cuda:N, mps",
    ),
    Setting("task", "task", "auto",
            "what the model does: single-label | multi-label | detection, or auto (inferred from the data's labels: "
            "(N,) class indices, a (N, classes) 0/1 matrix, or boxes); each gate supports some tasks and refuses the "
            "others (marker keyword task=)",
            "use auto, single-label, multi-label or detection"),
    Setting("seed", "int", 0, "seed for every random choice the gates make (0 <= int <= 2**63-1)",
            "use a non-negative integer below 2**63 such as 1234", minimum=0, maximum=MAX_SEED),
    Setting("batch_size", "int", 256, "batch size of forward passes and engine updates (int >= 1)",
            "use a positive integer such as 256", minimum=1),
    Setting("max_memory", "memory", "1GiB",
            "working-memory budget of the engines' model calls (bytes or a size such as 1GiB, 512MiB; at least "
            "16MiB): occlusion, the attack families, the shared activation pass and the monitors split a batch into "
            "the calls that fit it, from the model's measured bytes per input",
            "use a size such as 1GiB or 512MiB (at least 16MiB), or a number of bytes"),
    Setting("max_queries", "int", 10**9,
            "the most model queries a max_pmi_ub plan may take: a plan above it (e.g. a tiny target_width) is "
            "refused before sampling, naming its cost (int >= 1; marker keyword max_queries)",
            "use a positive integer such as 1000000000", minimum=1),
    Setting("max_seconds", "seconds", 3600,
            "the most seconds one gate may be estimated to take (model passes x a probed time per pass, plus its "
            "engine's work): a gate estimated above it is refused before measuring, naming the estimate and what "
            "shrinks it; 0 or none: no limit (marker keyword max_seconds)",
            "use a non-negative number of seconds such as 3600, or 0 / none for no limit"),
    Setting("sample", "sample", None,
            "gate on a seeded subsample of N inputs of the evaluation data (stratified by the scenario table when "
            "the gate reads one; every bound is computed on the N inputs): int >= 1, or none for all the data "
            "(marker keyword sample=)",
            "use a positive number of inputs no larger than the data, such as 200, or none for all the data"),
    Setting("threads", "threads", "auto",
            "torch intra-op CPU threads of each test process: auto (the usable cores shared by the xdist workers, "
            "less the cores other processes keep busy; OMP_NUM_THREADS/MKL_NUM_THREADS win when set) or an int >= 1",
            "use auto or a positive integer such as 1"),
    Setting("json", "path", None, "write the dependability evidence (JSON) to this path",
            "give a writable file path such as reports/dnnsafety.json"),
    Setting("junit_properties", "bool", False,
            "also write each gate's metric as per-testcase <properties> in the JUnit file "
            "(off by default: the JUnit XSD that CI servers use does not allow them)",
            "use true or false"),
    Setting("allow_pickle", "bool", False,
            "allow loading model files that are arbitrary pickles (unsafe: runs code from the file)",
            "use true only for model files you trust; prefer TorchScript, torch.export or a state dict"),
    Setting("onnx_external_data", "bool", False,
            "allow an .onnx model whose tensors keep their data in other files (only relative paths inside the "
            "model's folder; read by the plugin and inlined)",
            "use true only for ONNX models you trust whose data files lie in the model's folder"),
    Setting("onnx_custom_domains", "bool", False,
            "allow an .onnx model that uses custom-operator domains (other than ai.onnx and ai.onnx.ml); "
            "onnxruntime can load libraries for custom operators",
            "use true only for ONNX models you trust; prefer standard ONNX operators"),
    Setting("html", "path", None,
            "write a self-contained HTML report of the gates (cards, plots) to this path; "
            "needs the optional extra: pip install 'pytest-dnnsafety[html]'",
            "give a writable file path such as reports/dnnsafety.html"),
    Setting("baseline", "path", None,
            "compare every gate with the same gate of a stored run (an evidence file written by "
            "--dnnsafety-save-baseline or --dnnsafety-json); max_drop/max_rise on a marker fail a regression",
            "give the path of a stored evidence file such as reports/baseline.json"),
    Setting("save_baseline", "path", None,
            "save this run's evidence as a baseline for later runs (--dnnsafety-baseline) to this path",
            "give a writable file path such as reports/baseline.json"),
]

#: All settings by name.
SETTINGS: dict[str, Setting] = {s.name: s for s in _SETTING_LIST}


@dataclass(frozen=True)
class Resolved:
    """A parsed setting value and a human description of where it came from."""

    name: str
    value: Any
    source: str
    raw: Any = None
    base_dir: Path | None = None

    @property
    def is_factory(self) -> bool:
        return isinstance(self.value, str) and bool(FACTORY_RE.match(self.value))


def parse_device(raw: str) -> str:
    """Check a device string's syntax (availability is checked where torch is imported)."""
    text = str(raw).strip().lower()
    if not _DEVICE_RE.match(text):
        raise ValueError("expected auto, cpu, cuda, cuda:N or mps")
    return text


def _parse(setting: Setting, raw: Any) -> Any:
    kind = setting.kind
    if kind == "int":
        if isinstance(raw, bool):
            raise ValueError("expected an integer, got a boolean")
        try:
            value = int(str(raw).strip()) if not isinstance(raw, int) else raw
        except ValueError:
            raise ValueError("expected an integer") from None
        if setting.minimum is not None and value < setting.minimum:
            raise ValueError(f"must be >= {setting.minimum}")
        if setting.maximum is not None and value > setting.maximum:
            note = " (2**63-1: a seed must fit a signed 64-bit integer)" if setting.maximum == MAX_SEED else ""
            raise ValueError(f"must be <= {setting.maximum}{note}")
        return value
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError("expected true or false")
    if kind == "device":
        return parse_device(raw)
    if kind == "task":
        text = str(raw).strip().lower().replace("_", "-")
        if isinstance(raw, bool) or text not in ("auto", *TASK_NAMES):
            raise ValueError(f"expected auto, {', '.join(TASK_NAMES)}")
        return text
    if kind == "seconds":  # a time budget: 0, none or inf turn it off
        text = str(raw).strip().lower()
        if text in ("none", "off", "inf", "0"):
            return 0.0
        if isinstance(raw, bool):
            raise ValueError("expected a number of seconds, got a boolean")
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError("expected a number of seconds, or none") from None
        if seconds != seconds or seconds < 0:
            raise ValueError("must be a number >= 0 (0 or none: no limit)")
        return 0.0 if seconds == float("inf") else seconds
    if kind == "sample":  # a count of inputs, or none for all of them
        text = str(raw).strip().lower()
        if text in ("none", "all"):
            return None
        if isinstance(raw, bool) or isinstance(raw, float):
            raise ValueError(f"expected a whole number of inputs, got {raw!r}")
        try:
            count = int(text)
        except ValueError:
            raise ValueError("expected a whole number of inputs, or none") from None
        if count < 1:
            raise ValueError(f"must be >= 1 (a subsample of {count} inputs measures nothing)")
        return count
    if kind == "memory":  # checked fully (units, minimum) by runtime.sizes.parse_memory where it is used
        text = str(raw).strip()
        match = None if isinstance(raw, bool) else _MEMORY_RE.match(text)
        if match is None or match.group(2).lower() not in ("", "b", "kib", "mib", "gib", "tib", "kb", "mb", "gb", "tb"):
            raise ValueError("expected a memory size such as 1GiB, 512MiB or a number of bytes")
        return int(text) if text.isdigit() else text
    if kind == "threads":
        text = str(raw).strip().lower()
        if text == "auto":
            return "auto"
        if isinstance(raw, bool) or not text.isdigit() or int(text) < 1:
            raise ValueError("expected auto or an integer >= 1")
        return int(text)
    # "source" and "path": a non-empty string
    if not isinstance(raw, (str, os.PathLike)) or not str(raw).strip():
        raise ValueError("expected a non-empty path or 'package.module:callable'")
    return str(raw).strip()


def parse_setting(name: str, raw: Any, source: str) -> Any:
    """Parse one raw value of setting ``name``; a ConfigError names the value, its source and the fix."""
    setting = SETTINGS[name]
    try:
        return _parse(setting, raw)
    except ValueError as exc:
        raise ConfigError(f"{setting.ini}={raw!r} (from {source}): {exc}. Fix: {setting.fix}.") from None


class Settings:
    """Resolves settings for one pytest run, remembering where each value came from."""

    def __init__(
        self,
        *,
        cli: Mapping[str, Any] | Callable[[str], Any],
        ini: Callable[[str], Any],
        env: Mapping[str, str] | None = None,
        ini_file: Path | None = None,
        invocation_dir: Path | None = None,
    ) -> None:
        self._cli = cli
        self._ini = ini
        self._env = os.environ if env is None else env
        self._ini_file = ini_file
        self._ini_dir = ini_file.parent if ini_file is not None else (invocation_dir or Path.cwd())
        self._invocation_dir = invocation_dir or Path.cwd()
        self._cache: dict[str, Resolved] = {}

    @classmethod
    def from_pytest_config(cls, config: Any) -> "Settings":
        inipath = getattr(config, "inipath", None)
        return cls(
            cli=lambda dest: config.getoption(dest, default=None),
            ini=lambda name: config.getini(name),
            ini_file=Path(inipath) if inipath else None,
            invocation_dir=Path(config.invocation_params.dir),
        )

    def _cli_value(self, setting: Setting) -> Any:
        if callable(self._cli):
            return self._cli(setting.dest)
        return self._cli.get(setting.dest)

    def _lookup(self, setting: Setting) -> tuple[Any, str, Path | None]:
        cli = self._cli_value(setting)
        if cli is not None:
            return cli, f"command-line option {setting.cli}", self._invocation_dir
        if self._env.get(setting.env, "").strip():  # an empty variable counts as unset, like an empty ini value
            return self._env[setting.env], f"environment variable {setting.env}", self._invocation_dir
        ini = self._ini(setting.ini)
        if ini not in (None, "", []):
            where = f" in {self._ini_file}" if self._ini_file else ""
            return ini, f"ini option {setting.ini}{where}", self._ini_dir
        return setting.default, "default", self._ini_dir

    def get(self, name: str, marker_value: Any = _MISSING, marker: str | None = None) -> Resolved:
        """The setting ``name``; a marker keyword, if given, wins over everything else."""
        setting = SETTINGS[name]
        if marker_value is not _MISSING:
            source = f"marker @pytest.mark.{marker}({name}=...)" if marker else "marker keyword"
            return self._checked(setting, marker_value, source, self._ini_dir)
        if name not in self._cache:
            raw, source, base = self._lookup(setting)
            self._cache[name] = self._checked(setting, raw, source, base)
        return self._cache[name]

    def value(self, name: str) -> Any:
        return self.get(name).value

    def _checked(self, setting: Setting, raw: Any, source: str, base: Path | None) -> Resolved:
        if raw is None:
            return Resolved(setting.name, None, source, raw, base)
        return Resolved(setting.name, parse_setting(setting.name, raw, source), source, raw, base)

    def validate_all(self) -> None:
        """Parse every setting now, so a bad value stops the run before any test."""
        for name in SETTINGS:
            self.get(name)

    def require(self, name: str, what: str) -> Resolved:
        """The setting ``name``, or a ConfigError saying how to provide it."""
        resolved = self.get(name)
        if resolved.value is None:
            setting = SETTINGS[name]
            raise ConfigError(
                f"{what} is not configured: {setting.ini} is unset (no {setting.cli}, no "
                f"{setting.env}, no ini option). Fix: {setting.fix}."
            )
        return resolved

    def path(self, resolved: Resolved) -> Path:
        """A path setting made absolute against the folder its source implies."""
        path = Path(str(resolved.value)).expanduser()
        if not path.is_absolute() and resolved.base_dir is not None:
            path = resolved.base_dir / path
        return path

    @property
    def ini_dir(self) -> Path:
        return self._ini_dir
