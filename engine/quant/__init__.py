"""Quantized bases: which quantization a checkpoint carries (scheme.py), its tensors converted
to the one in-memory layout of kernels/quant.py (formats.py), and parts of that layout for
merged slices and tensor-parallel ranks (shard.py)."""
