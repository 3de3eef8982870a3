"""The paged KV block pool: block ids, allocation and freeing (hash-based reuse,
the host tier, stats and events build on it)."""
