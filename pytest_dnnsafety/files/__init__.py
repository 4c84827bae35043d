"""Files: model and data loading, checked opening, array headers and budgets, archive and `.pt2` checks, graph taps, depth-safe parsing, fingerprints (imports the core and data/ only)."""
