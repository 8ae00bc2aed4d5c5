"""The ZeRO machinery: everything that shards, gathers, reduces and steps the training state.

Layers point one way (each imports only those below it); nothing here imports the engine, the
checkpoint formats, the config schema or DeepSpeed's names (``pyproject.toml``'s import-linter
contracts check this in CI)::

    zero3/             stage 3: units of parameters gathered just in time, prefetched, released
      stage3 ─ coordinator ─ param_unit ─ units
    zero_optimizer     stages 0-2: the stage a config asks for, composed from
      master ─ grad_sync ─ frozen          fp32 master shard, gradient reduction, frozen chunks
    offload/           where state lives (policy: device, host, pinned host, file) and its stores
    precision/         param/reduce/master dtypes, loss scaling
    comm/              collectives over explicit process groups, agreement checks, watchdog
    partition/         pure shard geometry: padded layouts, buckets, flat buffers
    device, host_memory, weak_hooks     small helpers with no ZeRO knowledge

A gradient at stage 2 goes: autograd hook (grad_sync) → bucket (partition) → reduce-scatter
(comm) → the master shard's gradient (master) → the optimizer step on the shard (zero_optimizer)
→ the updated shard all-gathered back into the parameters. At stage 3 the parameters themselves
live as shards between uses (zero3.param_unit) and the coordinator gathers them around each
module's forward and backward.
"""
