"""The one exception type of the data pipeline: every message names the file or key at fault."""
from __future__ import annotations


class DataError(RuntimeError):
    """Bad input to the data pipeline (missing/corrupt shard, empty corpus, bad option).

    The message names the file or option at fault and what to do about it.
    """
