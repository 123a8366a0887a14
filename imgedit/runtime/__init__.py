"""What runs inside a worker process: loading, CFG-parallel ranks, the runner and the serve loop."""
