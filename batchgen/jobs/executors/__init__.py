"""Ways to run a job: in this process, as N shard processes on one machine, or on Ray (ray/); start.py
chooses one for `batchgen run`."""
