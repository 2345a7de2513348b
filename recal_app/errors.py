"""The application's own errors (what the libraries raise keeps its library's class): ``*Error``."""

from __future__ import annotations


class DivergedError(RuntimeError):
    """Training produced a non-finite loss or weight: the run stops, keeping its last complete checkpoint."""
