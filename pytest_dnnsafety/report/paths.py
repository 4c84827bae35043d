"""The run's output files, checked together before any test runs (and before any of them is touched).

Outputs are the evidence (``dnnsafety_json``), the HTML page (``dnnsafety_html``), the saved
baseline (``dnnsafety_save_baseline``), pytest's JUnit file (``--junitxml``) and GitHub's job
summary (``$GITHUB_STEP_SUMMARY``); the baseline to compare with (``dnnsafety_baseline``) and the
input files (``dnnsafety_model``, ``dnnsafety_data`` ... where they name a file) are read.
Gates may write files too: ``max_pmi_ub(cells_file=...)``'s per-cell audit table, checked when the
test is collected (:func:`check_marker_output`), long before the assessment that fills it runs.

Rules (:func:`check_collisions`, :func:`check_marker_output`), on paths resolved with
:func:`os.path.realpath` (links and ``..`` followed, so two spellings of one file collide):

* two inputs may be one file (``dnnsafety_data`` and ``dnnsafety_operational_data`` from one ``.npz``);
* two outputs on one file are refused: the last written would silently replace the other's
  evidence (and the evidence removes a stale file of its name at start);
* an output on the baseline or on an input file is refused — the evidence would delete it at
  start — except the saved baseline on the baseline: ``--dnnsafety-baseline=B --dnnsafety-save-baseline=B`` compares with
  ``B`` and then replaces it with this run's evidence (the baseline is read before that);
* a gate's file may be none of the run's files;
* a gate's file given as a symbolic link is refused, not followed: the link's target may be any
  file (another run's evidence, a file outside the project); a folder, or a parent that is a file
  or cannot be written, is refused too. (The run's own outputs never follow a link either: they
  are written to a temporary file that then replaces whatever the path held.)

Errors are :class:`~pytest_dnnsafety.errors.ConfigError` (settings) and
:class:`~pytest_dnnsafety.errors.MarkerError` (gate markers), naming both sides and the fix.
Nothing here imports torch or pytest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from pytest_dnnsafety.errors import ConfigError, MarkerError

__all__ = ["Output", "check_collisions", "check_gate_outputs", "check_marker_output", "prepare_output",
           "run_outputs", "MARKER_OUTPUT_PARAMS"]

#: The settings that name an output file of the run (written at its end), in report order.
OUTPUT_SETTINGS = ("json", "html", "save_baseline")
#: The settings that name a file the run reads (the ``source`` ones only where they name an existing file).
INPUT_SETTINGS = ("baseline", "model", "model_factory", "data", "scenarios", "conditions", "operational_data",
                  "masks", "monitor_data", "ood_data")
#: Marker keywords that name a file the gate writes.
MARKER_OUTPUT_PARAMS = ("cells_file",)


@dataclass(frozen=True)
class Output:
    """One file of the run: its description for messages, its path and whether the run writes it."""

    label: str
    path: Path
    writes: bool = True
    #: the setting's name (``json``, ``baseline`` ...), or "" for pytest's and CI's files
    setting: str = ""

    @property
    def real(self) -> str:
        return os.path.realpath(self.path)


def run_outputs(settings: Any, *, junitxml: str | None = None, invocation_dir: Path | None = None,
                environ: Mapping[str, str] | None = None) -> list[Output]:
    """The run's files from its settings, ``--junitxml`` and ``$GITHUB_STEP_SUMMARY`` (unset ones left out)."""
    files = []
    for name in (*OUTPUT_SETTINGS, *INPUT_SETTINGS):
        resolved = settings.get(name)
        if resolved.value is None:
            continue
        path = settings.path(resolved)
        if name in OUTPUT_SETTINGS or name == "baseline" or path.is_file():  # not "pkg.module:callable"
            files.append(Output(f"dnnsafety_{name}={resolved.value!r} (from {resolved.source})", path,
                                writes=name in OUTPUT_SETTINGS, setting=name))
    base = invocation_dir or Path.cwd()
    if junitxml:
        files.append(Output(f"--junitxml={junitxml!r}", base / Path(junitxml).expanduser()))
    environ = os.environ if environ is None else environ
    summary = (environ.get("GITHUB_STEP_SUMMARY") or "").strip()
    if summary:
        files.append(Output(f"GITHUB_STEP_SUMMARY={summary!r} (environment variable)", base / Path(summary)))
    return files


def _allowed(a: Output, b: Output) -> bool:
    """The one pair that may share a file: the baseline read and the baseline saved (see the module doc)."""
    return {a.setting, b.setting} == {"baseline", "save_baseline"}


def check_collisions(files: Iterable[Output]) -> None:
    """ConfigError when two of the run's files resolve to one path (other than baseline/save_baseline)."""
    seen: dict[str, Output] = {}
    for file in files:
        first = seen.get(file.real)
        if first is None:
            seen[file.real] = file
            continue
        if _allowed(first, file) or not (first.writes or file.writes):
            continue  # two settings may read one file (data and operational data from one .npz)
        reader = next((f for f in (first, file) if not f.writes), None)
        if reader is not None:
            writer = file if reader is first else first
            what = "the baseline" if reader.setting == "baseline" else "an input file"
            why = (f"the run would delete {what} at start, before any gate reads it"
                   if writer.setting in ("json", "html") else f"the run would overwrite {what} it reads")
        else:
            why = "the file written last would silently replace the other's evidence"
        raise ConfigError(f"{first.label} and {file.label} both resolve to {file.real}: {why}. "
                          "Fix: give each a path of its own.")


def check_marker_output(where: str, marker: str, keyword: str, value: Any, base_dir: Path,
                        files: Iterable[Output] = ()) -> Path:
    """The path a gate's file keyword resolves to (relative ones against ``base_dir``), checked now.

    Raises :class:`MarkerError` naming the test, the marker keyword, the path and the fix when the
    path is a symbolic link (refused, never followed), a folder, under a parent that is a file or
    cannot be written, or one of the run's ``files``.
    """
    path = Path(str(value)).expanduser()
    path = path if path.is_absolute() else base_dir / path
    head = f"{where}: @pytest.mark.{marker}({keyword}={str(value)!r}) resolves to {path}"
    fix = f"Fix: give {keyword} a new file path of its own, such as reports/{marker}_cells.csv"
    if path.is_symlink():
        raise MarkerError(f"{head}, a symbolic link to {os.readlink(path)!r}: the plugin does not write through "
                          f"links (the target could be any file). {fix}, or the link's target itself.")
    if path.is_dir():
        raise MarkerError(f"{head}, which is a directory. {fix}.")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:  # the first folder that exists: its writability
        parent = parent.parent
    if not parent.is_dir():
        raise MarkerError(f"{head}, whose folder cannot be created: {parent} is a file. {fix}.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MarkerError(f"{head}, whose folder {parent} cannot be written. {fix}.")
    real = os.path.realpath(path)
    for file in files:
        if file.real == real:
            what = "that evidence" if file.writes else "the baseline" if file.setting == "baseline" else "that input"
            raise MarkerError(f"{head}, the file of {file.label}: the gate's table would replace {what}. {fix}.")
    return path


def check_gate_outputs(where: str, specs: Iterable[Any], base_dir: Path, files: Iterable[Output] = ()) -> None:
    """:func:`check_marker_output` for every file keyword (:data:`MARKER_OUTPUT_PARAMS`) the gates ``specs`` set."""
    files = list(files)
    for spec in specs:
        for keyword in MARKER_OUTPUT_PARAMS:
            value = spec.options.get(keyword)
            if value is not None:
                check_marker_output(where, spec.marker, keyword, value, base_dir, files)


def prepare_output(settings: Any, name: str, example: str, *, remove_stale: bool = True) -> Path | None:
    """The checked path of an output file setting (``json``, ``html``, ``save_baseline``), or None when unset.

    A directory or an unwritable path is a :class:`ConfigError` naming the setting, its source and
    the fix; a stale file from an earlier run is removed (not for a saved baseline: it may be the
    one this run compares against). The HTML page also needs the ``[html]`` extra.
    """
    resolved = settings.get(name)
    if resolved.value is None:
        return None
    path = settings.path(resolved)
    try:
        if name == "html":
            from pytest_dnnsafety.report.html import check_html_path

            check_html_path(path)
        elif remove_stale:
            from pytest_dnnsafety.report.evidence import prepare_evidence_path

            prepare_evidence_path(path)
        else:
            if path.is_dir():
                raise IsADirectoryError(str(path))
            path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        problem = "is a directory" if isinstance(exc, IsADirectoryError) else f"cannot be written: {exc}"
        raise ConfigError(f"dnnsafety_{name}={resolved.value!r} (from {resolved.source}) resolves to {path}, which "
                          f"{problem}. Fix: give a writable file path such as {example} (missing folders are "
                          "created).") from None
    return path
