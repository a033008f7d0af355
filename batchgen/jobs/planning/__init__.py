"""Length-aware planning: output-length prediction, windows of rows, and what plan estimates."""
