"""Offline entry points (CLI commands, Python API)."""
