"""One job's rows from input to finished output: the setup, the job core, the batch function, progress, the summary."""
