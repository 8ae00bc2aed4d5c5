"""Side-by-side benchmarks of zeroshard against DeepSpeed, DDP, ZeroRedundancyOptimizer and FSDP2.

Entry point: ``python benchmarks/run.py`` (see ``benchmarks/README.md``). Nothing in this package
imports torch at module level except the worker-side modules (``worker``, ``workload``, ``systems``),
so that the worker can time ``import torch`` honestly.
"""
