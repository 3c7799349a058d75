"""Tensor parallelism's runner (runner.py): rank 0 drives N - 1 worker ranks, each a process
holding 1/N of every layer (the shard and group primitives the layers use are
engine/distributed/)."""
