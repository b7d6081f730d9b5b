"""Attach the rank collector to training frameworks that own the loop (Hugging Face
``Trainer``): the framework builds and wraps the model and optimizer itself, so the
attach happens in its callback, once both exist."""
