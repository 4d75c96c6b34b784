"""Triton serving glue: launcher, backend directory setup."""
