"""Triton GPU kernels for GLM-5.3-Flash, each beside its torch reference."""
