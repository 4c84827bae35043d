"""A gate family declares itself once (``FAMILY = Family(...)``) and everything that lists families is derived.

* :data:`~pytest_dnnsafety.gates.BUILTIN_FAMILIES` is the ``gates`` modules that declare a ``FAMILY``, in the
  families' ``order``; each family's word names its module, its docs page and its tests folder;
* the built-in families' plots are exactly the report's :data:`~pytest_dnnsafety.report.plots.BUILTIN_PLOTS`
  (the table a page rendered without a registry falls back to), each declared by one family;
* :meth:`GateRegistry.add_family` adds the gates as ``add`` does, and refuses what ``add`` refuses plus a
  malformed family, a family name taken by another family and a plot key another family draws differently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import pytest_dnnsafety
from pytest_dnnsafety.gates import (BUILTIN_FAMILIES, Family, GateDef, GateDefinitionError, GateRegistry,
                                    builtin_registry)
from pytest_dnnsafety.report.plots import BUILTIN_PLOTS

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("coverage", "neurons", "reliability", "robustness", "performance", "confusion", "interpretability",
         "monitors", "inspection", "quantification", "detection")


def _gate(marker: str) -> GateDef:
    return GateDef(marker=marker, metric="m", op=">=", threshold_range=(0.0, 1.0), params=(), fixtures={},
                   measure=lambda spec, fx, ctx: None, doc="d")  # type: ignore[arg-type, return-value]


def _plot(details: Any, prefix: str) -> list[Any]:
    return []


def test_the_builtin_families_are_derived_in_their_order() -> None:
    assert BUILTIN_FAMILIES == tuple(f"pytest_dnnsafety.gates.{name}" for name in ORDER)
    registry = builtin_registry()
    assert tuple(registry.families) == ORDER
    assert sorted(registry) == sorted(m for f in registry.families.values() for m in f.markers)
    for name, family in registry.families.items():
        assert family.page == f"gates/{name}.md" and (ROOT / "docs" / family.page).is_file()
        assert (ROOT / "tests" / "families" / name).is_dir() and family.title.strip()
    assert pytest_dnnsafety.Family is Family


def test_the_builtin_plots_are_the_families_plots() -> None:
    declared = [key for family in builtin_registry().families.values() for key in family.plots]
    assert sorted(declared) == sorted(BUILTIN_PLOTS) and len(declared) == len(set(declared))
    assert builtin_registry().plots == dict(BUILTIN_PLOTS)


def test_a_family_adds_its_gates_and_plots_once() -> None:
    family = Family("toy", "Toy", [_gate("min_toy_a"), _gate("min_toy_b")], plots={"toy": _plot})
    assert family.page == "gates/toy.md" and family.markers == ("min_toy_a", "min_toy_b")
    registry = GateRegistry()
    assert registry.add_family(family) is family
    registry.add_family(family)  # the same declaration again: nothing changes
    assert list(registry) == ["min_toy_a", "min_toy_b"] and registry.plots == {"toy": _plot}
    assert __name__ in registry.source("min_toy_a")
    late = Family("early", "Early", (_gate("min_early"),), order=1)
    registry.add_family(late)
    assert list(registry.families) == ["early", "toy"]  # by order, not by registration


@pytest.mark.parametrize(("family", "problem"), [
    (Family("Two words", "T", (_gate("min_x"),)), "must be one lowercase word"),
    (Family("toy", " ", (_gate("min_x"),)), "title"),
    (Family("toy", "T", ()), "non-empty tuple of GateDef"),
    (Family("toy", "T", ("min_x",)), "must hold GateDef"),  # type: ignore[arg-type]
    (Family("toy", "T", (_gate("min_x"),), plots={"a key": _plot}), "plots must map"),
    (Family("toy", "T", (_gate("min_x"),), page="gates/toy.html"), "page"),
    (Family("toy", "T", (_gate("min_x"),), order=True), "order"),
])
def test_a_malformed_family_is_refused(family: Family, problem: str) -> None:
    with pytest.raises(GateDefinitionError, match="is malformed") as err:
        GateRegistry().add_family(family)
    assert problem in str(err.value)


def test_clashes_with_another_family_are_refused() -> None:
    registry = GateRegistry()
    registry.add_family(Family("toy", "Toy", (_gate("min_toy"),), plots={"toy": _plot}))
    with pytest.raises(GateDefinitionError, match="gate family 'toy' is registered twice"):
        registry.add_family(Family("toy", "Toy", (_gate("min_other"),)))
    with pytest.raises(GateDefinitionError, match="plot 'toy' of gate family 'other' .* drawn differently"):
        registry.add_family(Family("other", "Other", (_gate("min_other"),), plots={"toy": lambda d, p: []}))
    with pytest.raises(GateDefinitionError, match="gate marker 'min_toy' is registered twice"):
        registry.add_family(Family("third", "Third", (_gate("min_toy"),)))
    with pytest.raises(GateDefinitionError, match="takes a pytest_dnnsafety.Family, got GateDef"):
        registry.add_family(_gate("min_x"))  # type: ignore[arg-type]
    assert list(registry.families) == ["toy"] and "min_other" not in registry
