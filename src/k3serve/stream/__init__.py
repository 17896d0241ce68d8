"""Moving weight bytes under a RAM budget: I/O pool, expert cache policies, trunk pinning, prefetch, traces."""
