"""Gradian: per-example gradient indexing of training data, and ranking against queries."""

__version__ = "0.1.0"
