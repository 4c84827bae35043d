"""Family `interpretability`: occlusion sensitivity of classifiers (occlusion) and detectors (detector) (Cheng et al.
2018, §II-G); what a gate runs per task (plan)."""
