"""Package version: part of every artifact key, so artifacts never leak across releases."""
__version__ = "0.1.0"
