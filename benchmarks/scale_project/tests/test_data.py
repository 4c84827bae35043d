"""Does the evaluation data exercise the operating conditions we claim (data/conditions.toml)?

3 lighting x 4 weather x 3 blur values; 33 of 36 combinations are feasible (no fog at night).
"""

import pytest


@pytest.mark.min_scene_coverage(1.0, k=1)
def test_every_condition_value_occurs(scenario_table):
    """No declared value of a condition goes untested."""


@pytest.mark.min_scene_coverage(0.95, k=2, min_count=5)
def test_pairs_of_conditions_are_covered(scenario_table):
    """95 % of the feasible pairs of condition values are seen on at least 5 images."""
