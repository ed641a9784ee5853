"""The disk cache: records, admission, recovery, LRU order, leases, pins, budget, single flight."""
