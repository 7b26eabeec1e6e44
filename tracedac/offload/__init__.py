"""Host memory as a third choice: host copies of offloaded results and their prefetch, the
link's bandwidth and the device's FLOP rate, and what the copies cost a step."""
