"""The disk cache: records, admission, recovery, eviction policy, leases, pins, budget, single flight."""
