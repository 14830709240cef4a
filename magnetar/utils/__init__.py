"""Small shared utilities: NVTX ranges, logging, timing."""
