"""The summariser's one error: a run that cannot go ahead."""
from __future__ import annotations


class SummarizeError(RuntimeError):
    """A run that cannot go ahead (bad template, budget too small, ...), with the reason."""
