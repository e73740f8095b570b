"""Serving: the continuous-batching scheduler, metrics and the GPU load window."""
