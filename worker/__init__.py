"""The model runtime and continuous-batching engine of one GPU (or CPU) worker.

May import `cache`, `kernels` and `protos`; never `router` or `cluster`.
"""
