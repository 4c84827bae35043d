"""Statistics: confidence intervals and bounds (intervals), rank statistics (ranking). Imports the layers below only."""
