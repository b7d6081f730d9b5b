"""Offline work over recorded traces: replay through the live engine, evaluation against labels."""
