"""The marker and settings reference, generated from the registry (the docs site renders it; it cannot drift).

:func:`markers_markdown` writes one section per gate marker from its
:class:`~pytest_dnnsafety.gates.core.GateDef`: what it measures and how it compares, the tasks it
supports, every keyword (:class:`~pytest_dnnsafety.gates.core.Param`: types, default, what to give),
the fixture roles and the keywords every gate takes. :func:`settings_markdown` writes the settings
table from :data:`~pytest_dnnsafety.settings.SETTINGS`. :func:`undocumented` lists what has no text to
show (a gate without ``doc``, a keyword without ``doc``): the test suite requires it to be empty.
The docs site's build hook (``docs/hooks.py``) calls them; no torch import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_dnnsafety.settings import SETTINGS
from pytest_dnnsafety.gates.core import COMMON_SETTINGS, REQUIRED, GateDef

__all__ = ["FAMILY_PAGES", "markers_markdown", "settings_markdown", "undocumented", "family_page"]

#: The docs page of each built-in family module (``docs/gates/<page>.md``).
FAMILY_PAGES = {
    "coverage": "coverage", "neurons": "neurons", "reliability": "reliability", "robustness": "robustness",
    "performance": "performance", "confusion": "confusion", "interpretability": "interpretability",
    "monitors": "monitors", "inspection": "inspection", "quantification": "quantification", "detection": "detection",
}

_COMMON_TEXT = {
    "seed": "seed of every random choice this gate makes (wins over `dnnsafety_seed`)",
    "device": "device of this gate's engines and model: `auto`, `cpu`, `cuda`, `cuda:N`, `mps`",
    "batch_size": "batch size of this gate's forward passes and engine updates",
    "task": "the model's task for this gate: `single-label`, `multi-label`, `detection` (default: the setting, "
            "else inferred from the data); a task the gate does not support is a collection error",
}


def _registry(registry: Mapping[str, GateDef] | None) -> Mapping[str, GateDef]:
    if registry is not None:
        return registry
    from pytest_dnnsafety.gates import builtin_registry

    return builtin_registry()


def family_page(gate: GateDef) -> str | None:
    """The docs page (``gates/<name>.md``) of a built-in gate's family, None for a gate from elsewhere."""
    module = getattr(gate.measure, "__module__", "") or ""
    prefix = "pytest_dnnsafety.gates."
    if not module.startswith(prefix):
        return None
    name = module[len(prefix):].split(".")[0].split("_")[0]
    page = FAMILY_PAGES.get(name)
    return None if page is None else f"gates/{page}.md"


def _types(types: tuple[type, ...]) -> str:
    names = {int: "int", float: "float", str: "str", dict: "dict", bool: "bool", list: "list", tuple: "tuple",
             type(None): "None"}
    return " or ".join(names.get(t, getattr(t, "__name__", str(t))) for t in types)


def _default(value: Any) -> str:
    return "required" if value is REQUIRED else f"`{value!r}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def markers_markdown(registry: Mapping[str, GateDef] | None = None, *, link_prefix: str = "../") -> str:
    """Markdown: one ``## marker`` section per gate (keywords, fixtures, tasks), in registry order."""
    gates = _registry(registry)
    lines = ["| marker | compares | tasks |", "|---|---|---|"]
    for name, gate in gates.items():
        lines.append(f"| [`{name}`](#{name}) | {_cell(gate.metric)} {gate.op} threshold | {', '.join(gate.tasks)} |")
    lines.append("")
    for name, gate in gates.items():
        lines += [f"## `{name}` {{ #{name} }}", "", f"`{_cell(gate.signature())}`", ""]
        lines += [_cell(gate.doc[:1].upper() + gate.doc[1:]) + ".", ""]
        low, high = gate.threshold_range
        facts = [f"**Compares** {_cell(gate.metric)} `{gate.op}` the threshold (in [{low:g}, {high:g}])",
                 f"**tasks** {', '.join(gate.tasks)}"]
        if gate.shards:
            facts.append("**torchrun** splits its batches across the ranks")
        if gate.timed:
            facts.append("**timed**: under torchrun every rank takes rank 0's verdict")
        page = family_page(gate)
        if page:
            facts.append(f"**family page** [{page[6:-3]}]({link_prefix}{page})")
        lines += ["; ".join(facts) + ".", ""]
        if gate.params:
            lines += ["| keyword | type | default | give |", "|---|---|---|---|"]
            for p in gate.params:
                lines.append(f"| `{p.name}` | {_types(p.types)} | {_cell(_default(p.default))} | {_cell(p.doc)} |")
            lines.append("")
        lines += ["| fixture keyword | default fixture | read |", "|---|---|---|"]
        for role, fixture in gate.fixtures.items():
            if role in gate.conditional:
                option = gate.conditional[role]
                when = (f"only without `{option[1:]}=`" if option.startswith("!") else f"only with `{option}=`")
            elif role in gate.optional:
                when = (f"when `dnnsafety_{gate.optional[role]}` is configured, the fixture is overridden or the "
                        "keyword is given")
            else:
                when = "always"
            lines.append(f"| `{role}` | `{fixture}` | {when} |")
        lines += ["", f"Also `{'`, `'.join(COMMON_SETTINGS)}` (see [every gate's keywords](#every-gate)) and "
                  f"`{gate.regression_keyword}` (the largest {'drop' if gate.op == '>=' else 'rise'} allowed against "
                  "a baseline).", ""]
    lines += ["## Keywords every gate takes { #every-gate }", "", "| keyword | meaning |", "|---|---|"]
    lines += [f"| `{key}` | {_COMMON_TEXT[key]} |" for key in COMMON_SETTINGS]
    lines += ["| `max_drop` | on a `>=` gate: the largest drop of the metric allowed against the baseline |",
              "| `max_rise` | on a `<=` gate: the largest rise of the metric allowed against the baseline |", ""]
    return "\n".join(lines)


def settings_markdown() -> str:
    """Markdown: the settings table (ini option, CLI flag, environment variable, default, meaning)."""
    lines = ["| ini option | CLI flag | environment | default | meaning |", "|---|---|---|---|---|"]
    for setting in SETTINGS.values():
        default = "—" if setting.default is None else f"`{setting.default}`"
        lines.append(f"| `{setting.ini}` | `{setting.cli}` | `{setting.env}` | {default} | {_cell(setting.help)} |")
    return "\n".join(lines) + "\n"


def undocumented(registry: Mapping[str, GateDef] | None = None) -> list[str]:
    """What the reference would show without text: gates without ``doc``, keywords without ``doc``, common settings
    without a description."""
    out = []
    for name, gate in _registry(registry).items():
        if not gate.doc.strip():
            out.append(f"{name}: no doc")
        out += [f"{name}({p.name}=...): no doc" for p in gate.params if not p.doc.strip()]
    out += [f"common keyword {key}: no text" for key in COMMON_SETTINGS if key not in _COMMON_TEXT]
    return out
