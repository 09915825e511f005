"""kvbridge.kernels."""
