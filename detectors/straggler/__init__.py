"""The straggler detector: a rank whose own work is slower than its peers'."""
