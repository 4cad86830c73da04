"""Draftsmith: train EAGLE-3 draft models for speculative decoding, one cached stage at a time."""

__version__ = "0.1.0"
