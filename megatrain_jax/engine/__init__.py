"""Training engines: `resident` (everything in device memory) and, later, streamed ones."""
