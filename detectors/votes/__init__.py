"""Equality votes among replicas that must agree exactly (digests, reduced norms, checks)."""
