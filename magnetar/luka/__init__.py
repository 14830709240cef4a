"""LuKA: lined (H2O) and clustered attention over the context KV during decoding (``../shared/papers/003``)."""
from magnetar.luka.core import choose_pages, clustered_attention, column_mass, compress_pages, heavy_hitters

__all__ = ["choose_pages", "clustered_attention", "column_mass", "compress_pages", "heavy_hitters"]
