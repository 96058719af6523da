"""The radix prefix cache over a paged KV pool, in pure Python.

Works on integers (token keys, page ids, block hashes), never on tensors; imports nothing of
ours and neither torch nor Ray, so the router can reuse its hashing and every test runs anywhere.
"""
