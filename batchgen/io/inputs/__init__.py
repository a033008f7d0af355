"""Reading input files: discovery, Parquet, JSON Lines and OpenAI Batch files as bounded Arrow batches."""
