"""Tuning tables for :mod:`glm5_kernels.fused_moe`, one JSON file per (E, H, I, dtype, device).

``fused_moe_E{E}_H{H}_I{I}_{dtype}_{device}.json`` maps token counts (``"1"`` … ``"16384"``) to launch
configs; written by ``bench/tune_fused_moe.py`` on the target GPU. A package so the tables ship in
the wheel as package data.
"""
