"""Benchmarks of zeroshard: the side-by-side comparison with DeepSpeed, DDP, ZeroRedundancyOptimizer and
FSDP2 (``run.py``, built on :mod:`benchmarks.harness`), and single-question studies
(:mod:`benchmarks.studies`, one results file each in ``benchmarks/results/``).

Entry points: ``python benchmarks/run.py``, ``python benchmarks/report.py``, ``python
benchmarks/studies/<study>.py`` and ``bash benchmarks/gpu.sh`` (see ``benchmarks/README.md``).
"""
