"""digits_demo: an 8x8 digit classifier evaluated under perception-style operating conditions.

A small, self-contained user project for pytest-dnnsafety. ``python -m digits_demo.train``
regenerates the model and every data file the dependability tests read.
"""

__all__ = ["build_model", "apply_conditions", "DOMAINS", "RESTRICTIONS"]

from digits_demo.conditions import DOMAINS, RESTRICTIONS, apply_conditions
from digits_demo.model import build_model
