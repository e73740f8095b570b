"""Command-line entry points (tools/*.py and the specmix-* console scripts run these ``main`` functions)."""
