"""flotilla.kernels."""
