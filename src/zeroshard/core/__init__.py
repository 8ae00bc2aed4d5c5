"""The ZeRO machinery: everything that shards, gathers, reduces and steps the training state.

Layers point one way (each imports only those below it); nothing here imports the engine, the
checkpoint formats, the config schema or DeepSpeed's names (``pyproject.toml``'s import-linter
contracts check this in CI)::

    build              the plan turned into parts, each constructed with its collaborators
    state_moves        a built stage's state moved to host memory and back (offload_states)
    zero3/             stage 3: units of parameters gathered just in time, prefetched, released
      stage3 ─ coordinator ─ param_unit ─ units, frozen (the shard of untrained parameters),
      secondary (ZeRO++ hpZ: a unit's second shard inside the node)
    zero_optimizer     stages 0-2: the stage over its parts (master, store, sync) and a torch optimizer
    grad_sync, plan    gradient reduction per stage; which copies exist and where (pure)
    offload/           where state lives (policy: device, host, pinned host, file) and its stores
    master             the fp32 master shard and the stage 1-2 parameter all-gather
    precision/, comm/  dtypes and loss scaling; collectives over explicit groups, agreement, watchdog,
                       the nodes x ranks topology (DeviceMesh) and ZeRO++'s quantized collectives
    partition/, seam, clock, host_memory, weak_hooks, device
                       shard geometry; the Stage protocol and owner_of/unit_of; small helpers

Code above the core uses :mod:`.seam` (the ``Stage`` protocol, ``owner_of``/``unit_of``) and
:func:`.build.build_stage`; DeepSpeed's ``ds_*`` parameter attributes are an observer handed in.

A gradient at stage 2 goes: autograd hook (grad_sync) → bucket (partition) → reduce-scatter
(comm) → the master shard's gradient (master) → the optimizer step on the shard (zero_optimizer)
→ the updated shard all-gathered back into the parameters. At stage 3 the parameters themselves
live as shards between uses (zero3.param_unit) and the coordinator gathers them around each
module's forward and backward.

Across machines the same path takes other groups, never other code: hybrid sharding builds the
stage over a group of ranks and all-reduces each reduced shard over the replicate group
(grad_sync); qgZ replaces a bucket's reduce-scatter with two quantized all-to-alls over the
topology's levels; qwZ and hpZ change where a unit's all-gather reads from (param_unit).
"""
