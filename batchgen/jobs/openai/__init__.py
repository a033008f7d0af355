"""The OpenAI Batch API: requests to planned rows, committed rows to output.jsonl and errors.jsonl."""
