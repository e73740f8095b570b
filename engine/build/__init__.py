"""The profile build: quality gate, K calibration and the build report."""
