"""Family `performance`: per-scenario accuracy and degradation (Cheng et al. 2018, §II-E)."""
