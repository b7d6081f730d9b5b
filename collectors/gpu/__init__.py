"""The NVML GPU-health collector: a sampling thread per host (or per rank)."""
