"""Triton kernels, one file each, with a torch reference beside every kernel."""
