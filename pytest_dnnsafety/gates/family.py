"""A gate family declares itself once: :class:`Family`.

A family is one word (``coverage``, ``robustness``, ...) that names its gate module, its engine
package, its docs page and its tests. Its module ends with a ``FAMILY = Family(...)`` declaration —
the word, the title of its docs page in the site's navigation, its gates, the plots of the HTML
report its gates' details feed — and a one-line ``pytest_dnnsafety_register_gates`` hook that calls
``registry.add_family(FAMILY)``. Everything that lists families is derived from these declarations:
:data:`pytest_dnnsafety.gates.BUILTIN_FAMILIES` (the modules of the ``gates`` package that declare a
``FAMILY``), the docs navigation of the gate families, the run's plot table
(:attr:`~pytest_dnnsafety.gates.core.GateRegistry.plots`). A plugin or ``conftest.py`` declares its
own family the same way. No torch import here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from pytest_dnnsafety.gates.core import GateDef
from pytest_dnnsafety.report.plots import PlotFn

__all__ = ["Family", "LAST"]

#: The ``order`` of a family that gives none: after the built-in ones (which use 10, 20, ... 110).
LAST = 1000


@dataclass(frozen=True, eq=False)
class Family:
    """One gate family: its word, its docs title and page, its gates and the plots its details feed.

    ``name`` is the one word of the family (a lowercase identifier, e.g. ``"calibration"``);
    ``title`` the text of its entry in the docs navigation; ``gates`` its :class:`GateDef` markers;
    ``plots`` the HTML report's plots of its gates' details (details key -> plot function, see
    :data:`pytest_dnnsafety.report.plots.PlotFn`; a built-in family names the functions of
    :mod:`pytest_dnnsafety.report.plots`); ``page`` its docs page (default ``gates/<name>.md``);
    ``order`` its place among the families (the docs navigation, the built-in list, the plot table):
    smaller first, then by name. Families compare by identity: one declaration per family.
    """

    name: str
    title: str
    gates: Sequence[GateDef]
    plots: Mapping[str, PlotFn] = field(default_factory=dict)
    page: str = ""
    order: int = LAST

    def __post_init__(self) -> None:
        # Frozen copies: the declaration cannot change after the registry read it.
        if isinstance(self.gates, (list, tuple)):
            object.__setattr__(self, "gates", tuple(self.gates))
        if isinstance(self.plots, Mapping):
            object.__setattr__(self, "plots", MappingProxyType(dict(self.plots)))
        if not self.page and isinstance(self.name, str):
            object.__setattr__(self, "page", f"gates/{self.name}.md")

    @property
    def markers(self) -> tuple[str, ...]:
        """The marker names of the family's gates, in declaration order."""
        return tuple(gate.marker for gate in self.gates)

    def problems(self) -> list[str]:
        """What is wrong with this declaration (empty when it is usable); its gates are checked by the registry."""
        out: list[str] = []
        if not (isinstance(self.name, str) and self.name.isidentifier() and self.name == self.name.lower()
                and not self.name.startswith("_")):
            out.append(f"name {self.name!r} must be one lowercase word (a Python identifier not starting with '_')")
        if not isinstance(self.title, str) or not self.title.strip():
            out.append(f"title {self.title!r} must be a non-empty string (the docs navigation's text)")
        if not isinstance(self.gates, tuple) or not self.gates:
            out.append(f"gates must be a non-empty tuple of GateDef, got {self.gates!r}")
        elif not all(isinstance(gate, GateDef) for gate in self.gates):
            bad = next(gate for gate in self.gates if not isinstance(gate, GateDef))
            out.append(f"gates must hold GateDef definitions, got {type(bad).__name__}")
        if not isinstance(self.plots, Mapping) or not all(
                isinstance(key, str) and key.isidentifier() and callable(plot) for key, plot in self.plots.items()):
            out.append("plots must map details keys (identifiers) to plot functions plot(details, prefix)")
        if not isinstance(self.page, str) or not self.page.endswith(".md"):
            out.append(f"page {self.page!r} must be the docs page's path (ending in .md)")
        if isinstance(self.order, bool) or not isinstance(self.order, int):
            out.append(f"order {self.order!r} must be an int")
        return out
