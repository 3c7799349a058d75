"""This replica's adapters: the manager that admission and the admin API call (manager.py),
the disk, host and device tiers and the moves between them (tiers.py), and how one adapter
looks to the catalog and the admin API (info.py)."""
