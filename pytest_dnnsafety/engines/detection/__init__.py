"""Family `detection`: COCO box matching, mAP and recall with bootstrap bounds over images (matching)."""
