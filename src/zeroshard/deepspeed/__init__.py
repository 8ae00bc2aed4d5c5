"""DeepSpeed's names, in one package that wraps zeroshard's core.

Everything here exists so that DeepSpeed scripts, libraries and tests run unchanged; none of it is
needed to understand how zeroshard trains (that is :mod:`zeroshard.core` and :mod:`zeroshard.engine`),
and nothing below this package imports it (``pyproject.toml``'s import contracts):

- :mod:`.engine`: ``ZeroEngine``, the engine ``initialize`` returns: zeroshard's
  :class:`~zeroshard.engine.Engine` with DeepSpeed's engine methods (:mod:`.engine_api`: config
  accessors, training-state methods, and the methods not supported yet, each a clear error);
- :mod:`.comm`, :mod:`.checkpointing`, :mod:`.utils`, :mod:`.runtime`, :mod:`.accelerator`:
  ``deepspeed.comm``, ``deepspeed.checkpointing`` (activation checkpointing), ``deepspeed.utils``...
  (public as ``zeroshard.comm``, ``zeroshard.checkpointing``, ...);
- :mod:`.param_attrs`: the ``ds_*`` attributes of ZeRO-3 parameters, kept by observing the units;
- :mod:`.imports`: the opt-in import layer that answers ``import deepspeed`` with zeroshard
  (``python -m zeroshard.deepspeed.imports script.py``; :mod:`.accelerate_launch` for
  ``accelerate launch``), its table of DeepSpeed's modules (:mod:`.surface`) and the names it serves
  beyond the public API (:mod:`.misc`, :mod:`.ops`, :mod:`.op_builder`, :mod:`.zero_config`,
  :mod:`.stage_classes`, :mod:`.param_offload`, :mod:`.version_info`; :mod:`.moe` and :mod:`.pipe`
  are clear errors). Importing this package changes nothing; ``imports.enable()`` turns the layer on.

DeepSpeed's checkpoint format is read and written by :mod:`zeroshard.checkpoint.deepspeed` and
:mod:`zeroshard.checkpoint.to_deepspeed`, beside zeroshard's own format.
"""
