"""The disk cache: records, recovery, LRU order, leases, budget, publish/evict, single flight."""
