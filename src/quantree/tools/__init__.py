"""What a user runs around the pipeline: the numeric debugger, inspection, reports, the CLI,
the demo, and the one place user files are read."""
