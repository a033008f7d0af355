"""Sharded jobs: how input splits into shards, and the shards' outputs seen as one job."""
