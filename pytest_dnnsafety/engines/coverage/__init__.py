"""Family `coverage`: scenario k-projection coverage of the operating conditions (Cheng et al. 2018, §II-A)."""
