"""The KV cache's bookkeeping: ref-counted blocks, free list and block tables
(block_manager.py), and automatic prefix caching (prefix_cache.py)."""
