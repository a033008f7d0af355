"""What each CLI command does, over the layers below: run, plan, bench, status, compact (finalize: jobs/sharding/)."""
