"""The network detector: the rank or link everybody's communication waits for."""
