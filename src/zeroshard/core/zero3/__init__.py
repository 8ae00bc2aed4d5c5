"""ZeRO stage 3: parameters sharded at rest and gathered per unit just in time.

- :mod:`.units`: which modules form a unit (a group of parameters gathered together) and the leaf rules;
- :mod:`.param_unit`: one unit's shard and its transitions (``SHARDED`` → ``GATHERING`` → ``GATHERED``);
- :mod:`.coordinator`: module hooks that gather, prefetch and release units in execution order;
- :mod:`.lent_rows`, :mod:`.param_reads`, :mod:`.parameter_offload`: host-memory and offload helpers;
- :mod:`.stage3`: the stage itself, the stage-2 optimizer plus the coordinator.
"""
