"""The torch rank collector: hooks on an unchanged training loop, one step record per step."""
