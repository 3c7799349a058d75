"""The fleet: adapter-affinity routing between replicas that share one registry (router.py)."""
