"""Cache-aware routing of requests to workers.

May import `cache` (hashing, index structures) and nothing else of ours: never `worker`,
`cluster` or `protos`.
"""
