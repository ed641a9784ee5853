"""The disk cache: records, admission, recovery, eviction, leases, pins, budget, single flight."""
