"""``spotlight``: trained MLP hash codes of queries and keys (Spotlight Attention, Eq. 5-6; trained by
``magnetar-calibrate spotlight``), Hamming similarity summed over the query group; no sinks or window by default.
The selection is :class:`magnetar.sparse.lsh.HashSelector`'s; only the hash functions differ."""
from __future__ import annotations

from magnetar.sparse.lsh import HashSelector


class SpotlightSelector(HashSelector):
    kind = "mlp"
