"""The read side: the pipeline's state as Redis holds it, for the CLI, the API and the dashboard."""
