"""KV beyond the device pool: the connector interface (base.py) and the tiers built on it (disk,
Redis, host memory: tiered.py for the scheduler half, tiered_worker.py for a rank's half)."""
