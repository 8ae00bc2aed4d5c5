"""Opt-in compatibility layers. Nothing in zeroshard's core imports this package (one exception:
``zeroshard.moe``, read on first use, is :mod:`zeroshard.compat.ds_moe`, DeepSpeed's MoE names).

:mod:`zeroshard.compat.deepspeed` makes ``import deepspeed`` (and its package metadata) resolve to
zeroshard for libraries that drive DeepSpeed themselves, such as Hugging Face transformers and
accelerate. Importing it changes nothing; :func:`zeroshard.compat.deepspeed.enable` turns it on.
"""
