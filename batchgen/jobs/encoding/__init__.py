"""embed, score and classify jobs: rows prepared for the encoder, its job core, output rows, the load per task."""
