"""Family `confusion`: severity-weighted confusion (Cheng et al. 2018, §II-H)."""
