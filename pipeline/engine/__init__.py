"""Records in, findings out: step assembly, the detector engine, incidents, actions."""
