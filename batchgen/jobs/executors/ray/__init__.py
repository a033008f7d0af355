"""The Ray executor: a Ray Data pipeline reads and generates, this process (the driver) commits. Python
callers reach it as batchgen.ray.run; `batchgen run --executor ray` through jobs/executors/start.py."""
