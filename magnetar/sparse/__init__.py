"""Sparse decoding: per-step KV selection (oracle top-k, LSH, Spotlight, Quest) over the full cache."""
