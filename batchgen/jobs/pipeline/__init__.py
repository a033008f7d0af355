"""One job's rows from input to finished output: row checks, prompts, the job core, signals, the summary."""
