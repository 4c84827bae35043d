"""The published JSON Schemas of the plugin's output files.

``evidence.schema.json`` (JSON Schema draft 2020-12) describes the evidence file that
``--dnnsafety-json`` writes (``schema`` = ``pytest-dnnsafety/1``); a baseline file is the same
format. Validate a file with any draft 2020-12 validator, e.g.::

    import json, jsonschema
    from pytest_dnnsafety.report.schemas import evidence_schema

    jsonschema.validate(json.load(open("reports/evidence.json")), evidence_schema())

The schema ships inside the package (package data); it needs no third-party import to load.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

__all__ = ["EVIDENCE_SCHEMA_FILE", "evidence_schema"]

#: The schema file's name inside this package.
EVIDENCE_SCHEMA_FILE = "evidence.schema.json"


def evidence_schema() -> dict[str, Any]:
    """The evidence file's JSON Schema (draft 2020-12) as a dict, read from the installed package."""
    text = resources.files(__name__).joinpath(EVIDENCE_SCHEMA_FILE).read_text(encoding="utf-8")
    return json.loads(text)
