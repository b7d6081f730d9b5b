"""Shared statistics of the detectors: robust peer scores, per-rank history, streaks, windows."""
