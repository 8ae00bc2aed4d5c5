"""Collectives as plain functions over explicitly passed process groups.

- :mod:`.collectives`: all-gather, reduce-scatter and all-reduce with async handles, shape checks
  before each collective, and the hooks the communication logger counts through;
- :mod:`.groups`: process-group set-up from the launcher's environment (no globals);
- :mod:`.topology`: the world as nodes × ranks per node (``DeviceMesh``), the groups of each level;
- :mod:`.quantized`: ZeRO++'s quantized all-gather (qwZ) and hierarchical reduce-scatter (qgZ);
- :mod:`.subset`: fail-fast guards for code that only some ranks run;
- :mod:`.agreement`: the per-window check that every rank ran the same forwards and backwards;
- :mod:`.watchdog`: names the step a collective hung in.

DeepSpeed's ``deepspeed.comm`` API is :mod:`zeroshard.deepspeed.comm`, built on this.
"""
