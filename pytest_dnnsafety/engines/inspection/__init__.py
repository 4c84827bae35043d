"""Family `inspection`: DeepInspect class confusion and bias, single-label (deepinspect, kernels) and multi-label
(multilabel); what a gate runs per task (plan)."""
