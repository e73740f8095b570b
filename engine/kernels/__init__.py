"""Hardware kernels, chosen in one place (backends.py): attention backends, CUDA graphs and the CPU's C++ kernels."""
