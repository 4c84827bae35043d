"""Family `neurons`: neuron k-activation coverage and neuron activation patterns (Cheng et al. 2018, §II-B/C)."""
