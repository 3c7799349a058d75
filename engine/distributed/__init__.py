"""What the layers need of tensor parallelism, below them: which part of every weight a rank
holds (shard.py, Megatron-style) and the process group's collectives (group.py)."""
