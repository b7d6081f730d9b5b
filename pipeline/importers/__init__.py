"""Foreign evidence as rankscope traces: PyTorch Flight Recorder dumps, read safely."""
