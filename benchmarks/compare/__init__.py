"""Pieces of benchmarks/gpu_compare.py: side-by-side runs of GPU allocators under PyTorch.

Nothing here imports torch or gpumem at module level: the orchestrator never touches CUDA
(its children must find the device untouched), and the pure logic (trace packing, searches,
tables, JSON checks) is tested on machines without a GPU.
"""
