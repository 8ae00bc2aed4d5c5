"""Trained by torchrun for ``tests/distributed/test_cluster_faults.py``: on the emulated two-node
cluster (2 nodes x 2 ranks) until the test kills a node or cuts the link, or on one node to resume.

An MLP at ZeRO stage ``--stage`` (3 by default), fp32, AdamW, ``collective_timeout`` of
``--timeout`` seconds. Step ``s``'s global batch is ``--batch`` samples drawn from a generator
seeded with ``s``, whatever the world size: rank ``r``'s micro-batch ``m`` is rows
``(m * world + r) * micro ...`` of it, with ``micro = batch / (world * gradient_accumulation)``,
so a job of 4 ranks and one of 2 ranks with ``--ga 2`` train on the same samples.

- Every ``--save-every`` steps the engine saves to ``--ckpt`` (``engine.save_checkpoint``); every
  rank then appends the step to ``<out>/progress.rank<R>``.
- ``--pause-at S``: in the forward of step ``S``, between the first and the second linear layer
  (under ZeRO-3 the next layer's all-gather is the next collective), every rank touches
  ``<out>/paused.rank<R>`` and sleeps ``--pause-s`` seconds: the test faults the cluster then,
  in the middle of a step.
- A rank whose training raises writes ``<out>/error.rank<R>.json`` (``time.time()`` of the
  failure, its pid, the error's type, message and traceback) and raises it again (torchrun
  prints it on stderr).
- ``--resume``: ``engine.load_checkpoint(--ckpt)`` first (the latest complete checkpoint).
- ``--kill-at MOMENT:S`` (``scripts/cluster_fault_trials.py``): on node 1 (torchrun's ``GROUP_RANK``),
  every rank touches ``<out>/at.rank<R>`` when it reaches ``MOMENT`` of step ``S`` (``forward``,
  ``backward``, ``step``, ``save``: as it enters that engine call; ``agreement``: the backward's
  agreement check, where it then waits to be killed, so that node 0 is inside the check's
  all-gather): the trial kills node 1 then. ``--layers``/``--hidden`` make the MLP larger, so that a
  kill lands inside a call; ``--timeout 0`` leaves ``collective_timeout`` at its default.
- At the end rank 0 writes the parameters to ``<out>/final.safetensors`` and every rank touches
  ``<out>/final.rank<R>.done`` last (:func:`teardown.done_markers`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import zeroshard

IN, HIDDEN, OUT = 16, 64, 4


class Pause(nn.Module):
    """Sleeps in the forward of one step (no parameters, so no collective of its own)."""

    def __init__(self, out: Path, rank: int, step: int, seconds: float) -> None:
        super().__init__()
        self.out, self.rank, self.at, self.seconds = out, rank, step, seconds
        self.current = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.current == self.at:
            (self.out / f"paused.rank{self.rank}").touch()
            time.sleep(self.seconds)
        return x


def _mark(engine: object, marker: Path, moment: str, step: str) -> None:
    """Touch ``marker`` when this rank reaches ``moment`` of optimizer step ``step`` (``--kill-at``)."""
    at = int(step)
    if moment == "agreement":
        from zeroshard.core.comm import agreement

        check = agreement.check

        def held(*args: object, **kwargs: object) -> None:
            backward = kwargs.get("kind", agreement.BACKWARD) == agreement.BACKWARD
            if getattr(engine, "global_steps", -1) == at and backward:
                marker.write_text(moment)
                time.sleep(3600)  # killed here: node 0 waits in the check's all-gather
            check(*args, **kwargs)  # type: ignore[arg-type]

        agreement.check = held  # type: ignore[assignment]
        return
    name = {"forward": "forward", "backward": "backward", "step": "step", "save": "save_checkpoint"}[moment]
    call = getattr(engine, name)

    def marked(*args: object, **kwargs: object) -> object:
        if getattr(engine, "global_steps", -1) == at and not marker.exists():
            marker.write_text(moment)
        return call(*args, **kwargs)

    setattr(engine, name, marked)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="samples per optimizer step, all ranks together")
    ap.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=20.0, help="collective_timeout, seconds")
    ap.add_argument("--pause-at", type=int, default=-1)
    ap.add_argument("--pause-s", type=float, default=1.0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-at", default="", help="MOMENT:STEP at which node 1's ranks mark that they are there")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--layers", type=int, default=1, help="hidden-to-hidden layers")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    micro = a.batch // (world * a.ga)
    assert micro * world * a.ga == a.batch, (a.batch, world, a.ga)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pause = Pause(a.out, rank, a.pause_at, a.pause_s)
    hidden = [m for _ in range(a.layers) for m in (nn.Linear(a.hidden, a.hidden), nn.Tanh())]
    model = nn.Sequential(nn.Linear(IN, a.hidden), nn.Tanh(), pause, *hidden, nn.Linear(a.hidden, OUT))
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": a.ga,
              "gradient_clipping": 1.0, "collective_timeout": a.timeout,
              "zero_optimization": {"stage": a.stage, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if a.timeout <= 0:
        del config["collective_timeout"]
    try:
        engine, *_ = zeroshard.initialize(model=model, config=config)
        if a.kill_at and int(os.environ.get("GROUP_RANK", "0")) == 1:
            _mark(engine, a.out / f"at.rank{rank}", *a.kill_at.split(":"))
        if a.resume:
            engine.load_checkpoint(str(a.ckpt))
        for step in range(engine.global_steps, a.steps):
            pause.current = step
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(a.batch, IN, generator=g), torch.randn(a.batch, OUT, generator=g)
            for m in range(a.ga):
                rows = slice((m * world + rank) * micro, (m * world + rank + 1) * micro)
                loss = F.mse_loss(engine(x[rows]), y[rows])
                engine.backward(loss)
                engine.step()
            if (step + 1) % a.save_every == 0:
                engine.save_checkpoint(str(a.ckpt))
                with open(a.out / f"progress.rank{rank}", "a") as f:
                    f.write(f"{step + 1}\n")
        with engine.gathered():
            params = {n: p.detach().clone().contiguous() for n, p in engine.module.named_parameters()}
    except Exception as e:
        record = {"time": time.time(), "pid": os.getpid(), "type": type(e).__name__, "message": str(e),
                  "traceback": traceback.format_exc()}
        (a.out / f"error.rank{rank}.json").write_text(json.dumps(record))
        raise
    if rank == 0:
        save_file(params, str(a.out / "final.safetensors"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    (a.out / f"final.rank{rank}.done").touch()


if __name__ == "__main__":
    main()
