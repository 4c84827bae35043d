"""canvas_demo: handwritten digits on canvases under operating conditions, a multi-label reader and a detector."""
