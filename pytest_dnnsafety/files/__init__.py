"""Files: model and data loading, archive and `.pt2` checks, graph taps, depth-safe parsing, fingerprints (imports the core and data/ only)."""
