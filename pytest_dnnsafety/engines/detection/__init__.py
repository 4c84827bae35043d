"""Family `detection`: COCO box matching, mAP and recall with bootstrap bounds over images (matching); a pass matched and the worst scenario group read (quality)."""
