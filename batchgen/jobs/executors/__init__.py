"""Ways to run a job: in this process, or as N shard processes on one machine (Ray lives in batchgen.ray)."""
