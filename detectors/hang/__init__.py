"""Hangs and crashed ranks from progress beats: the hang monitor and its wait-for graph."""
