"""Paged-KV attention kernels: a plain-torch reference (the CPU path and test oracle) and Triton.

Imports nothing of ours.
"""
