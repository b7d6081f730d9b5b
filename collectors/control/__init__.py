"""Evict/recover control messages, received and verified inside the training process."""
