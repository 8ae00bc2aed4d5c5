"""The comparison's harness: ``benchmarks/run.py`` plans jobs (:mod:`.plan`), starts each as fresh
rank processes (:mod:`.launch`, :mod:`.worker`) that train through one module per system
(:mod:`.systems`) on the shared workload (:mod:`.workload`), and turns their results into JSON,
markdown and a chart (:mod:`.derive`, :mod:`.goals`, :mod:`.tables`, :mod:`.chart`, :mod:`.report`).
Also the helpers the studies share: :mod:`.spawned` (spawned gloo ranks), :mod:`.proc_memory`
(``/proc`` and malloc readers) and :mod:`.machine` (machine, versions, git state).

Nothing here imports torch at module level except the worker-side modules (``worker``, ``workload``,
``systems``) and ``spawned``, so that the worker can time ``import torch`` honestly.
"""
