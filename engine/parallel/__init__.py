"""Tensor parallelism: one model split across N ranks (engine/parallel/group.py), each rank a
process holding 1/N of every layer (Megatron-style, engine/parallel/shard.py)."""
