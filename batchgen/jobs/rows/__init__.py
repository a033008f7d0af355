"""One input row, the ground floor of jobs/: read with a stable id (a sharded job's share of the input
too), its own sampling, constraint and adapter, its coded error, the planned row and its prompt hash."""
