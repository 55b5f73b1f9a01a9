"""Triton kernels and their launchers: shape, dtype and stride checks, no autograd."""
