"""Cache-aware routing of requests to workers.

May import `cache` (hashing, index structures) and `protos`; never `worker`.
"""
