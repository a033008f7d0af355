"""Sharded jobs: where each shard writes, and the shards' outputs seen as one job (status, compact, finalize)."""
