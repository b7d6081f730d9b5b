"""GPU-health detectors over the NVML readings joined onto a step."""
