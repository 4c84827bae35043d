"""Family `confusion`: severity-weighted confusion (Cheng et al. 2018, §II-H): the engine and the severity matrix (weighted), a pass counted and read (gating)."""
