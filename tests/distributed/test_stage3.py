"""ZeRO-3 on what real models do: tied weights, a module called twice, parameters unused in some
steps, a parameter read outside forward, eval forwards between steps, generation loops,
GatheredParameters, state dicts and zero.Init — each checked against plain PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from torch import nn

import zeroshard

VOCAB, DIM, STEPS, GA, BATCH, LR = 23, 16, 5, 2, 8, 1e-2


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Linear(DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.embed(idx)
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))  # the same module twice
        if use_extra:  # unused in every other step
            h = h + self.extra(h)
        return self.head(self.norm(h))


def reinit(m: nn.Module) -> None:
    """A parent re-initialising its children after building them (Hugging Face's _init_weights)."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        m.weight.data.normal_(0.0, 0.3)
    if isinstance(m, nn.Linear) and m.bias is not None:
        m.bias.data.uniform_(-0.1, 0.1)


def build(init: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if init:
        with zeroshard.zero.Init():
            model = TiedLM()
            model.apply(reinit)
        return model
    model = TiedLM()
    model.apply(reinit)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shape = (STEPS, BATCH, 6)
    return torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g)


def loss_fn(model: nn.Module, logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    # The tied head's weight read outside any module's forward, inside the loss.
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tgt.reshape(-1)) + 1e-2 * model.head.weight.pow(2).mean()


def reference() -> dict[str, torch.Tensor]:
    model = build()
    x, y = data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model, model(x[step], step % 2 == 0), y[step]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(rank: int, world: int, zero: dict, init: bool,
          leaf: bool = False) -> tuple[zeroshard.ZeroEngine, dict[str, torch.Tensor]]:
    model = build(init)
    if leaf:  # the whole model one unit: a single gather per pass
        zeroshard.utils.set_z3_leaf_modules(model, [TiedLM])
    cfg = {"train_batch_size": BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 3, **zero},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    x, y = data()
    mb = BATCH // (GA * world)
    for step in range(STEPS):
        for m in range(GA):
            a = (m * world + rank) * mb
            logits = engine(x[step, a : a + mb], step % 2 == 0)
            engine.backward(loss_fn(engine.module, logits, y[step, a : a + mb]))
            engine.step()
        engine.eval()
        with torch.no_grad():  # an evaluation forward between steps changes the module order
            engine(x[0, :2], False)
        engine.train()
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return engine, params


VARIANTS = {
    "defaults": {},
    "tight": {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 300,
              "stage3_prefetch_bucket_size": 700},
    "no_prefetch": {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 300,
                    "stage3_prefetch_bucket_size": 0},
    "leaf": {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0},
}


def features_worker(rank: int, world: int) -> dict:
    out: dict = {}
    for name, zero in VARIANTS.items():
        engine, params = train(rank, world, zero, init=(name == "tight"), leaf=(name == "leaf"))
        c = engine.optimizer.coordinator
        out[name] = {"params": params, "prefetches": c.prefetch_count, "gathers": c.gather_count,
                     "peak": engine.memory_usage()["gathered_peak"], "units": len(c.units)}
        if name == "leaf":
            engine, _ = train(rank, world, VARIANTS["no_prefetch"], init=False)  # later checks use this one
    # Generation: a loop of small forwards inside engine.gathered() gathers nothing more.
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        plain = engine.module(idx, False)
        with engine.gathered():
            before = c.gather_count
            for _ in range(5):
                nxt = engine.module(idx, False)[:, -1:].argmax(-1)
                idx = torch.cat([idx, nxt], dim=1)
            out["gen_gathers"] = c.gather_count - before
            out["gen_same"] = torch.equal(engine.module(torch.tensor([[1, 2, 3]]), False), plain)
    # State dicts hold full tensors, not placeholders (keep_vars too).
    sd = engine.module.state_dict()
    sd_vars = engine.module.state_dict(keep_vars=True)
    out["sd_shapes"] = {k: list(v.shape) for k, v in sd.items()}
    out["sd_equal"] = all(torch.equal(sd[k], out["no_prefetch"]["params"][k]) for k in out["no_prefetch"]["params"])
    out["sd_vars_full"] = all(v.numel() > 0 for v in sd_vars.values())
    out["at_rest_numel"] = sum(p.numel() for p in engine.module.parameters())
    # GatheredParameters with modifier_rank=0: rank 0's change reaches every rank and survives a step
    # (the bias too: not the first parameter of its unit, which once crashed the write-back).
    w, b = engine.module.block.weight, engine.module.block.bias
    with zeroshard.zero.GatheredParameters([w, b], modifier_rank=0), torch.no_grad():
        if rank == 0:
            w.fill_(0.5)
            b.fill_(0.25)
    for g in engine.optimizer.param_groups:
        g["lr"] = 0.0
    engine.backward(loss_fn(engine.module, engine(torch.tensor([[1, 2]]), False), torch.tensor([[2, 3]])))
    for _ in range(GA):
        engine.step()
    with zeroshard.zero.GatheredParameters([w, b]):
        out["modified"] = w.detach().clone()
        out["modified_bias"] = b.detach().clone()
    return out


def test_stage3_real_model_features() -> None:
    ref = reference()
    ref_flat = torch.cat([t.reshape(-1) for t in ref.values()])
    for r in run_distributed(features_worker, 2):
        for name in VARIANTS:
            got = r[name]["params"]
            flat = torch.cat([got[n].reshape(-1) for n in ref])
            rel = ((flat - ref_flat).norm() / ref_flat.norm()).item()
            assert rel <= 1e-5, (name, rel)
        assert r["tight"]["prefetches"] > 0 and r["no_prefetch"]["prefetches"] == 0
        assert r["leaf"]["units"] == 1 and r["tight"]["units"] == 4
        # The tight budget gathers again in backward; the defaults keep the small model gathered.
        assert r["tight"]["gathers"] > r["defaults"]["gathers"]
        assert r["gen_gathers"] == 0 and r["gen_same"]
        assert r["sd_shapes"]["block.weight"] == [DIM, DIM] and r["sd_shapes"]["embed.weight"] == [VOCAB, DIM]
        assert r["sd_equal"] and r["sd_vars_full"]
        assert r["at_rest_numel"] == 0
        assert torch.equal(r["modified"], torch.full((DIM, DIM), 0.5))
        assert torch.equal(r["modified_bias"], torch.full((DIM,), 0.25))


def window_worker(rank: int, world: int, zero: dict) -> dict:
    model = build()
    cfg = {"train_batch_size": BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    c = engine.optimizer.coordinator
    x, y = data()
    mb = BATCH // (GA * world)
    gathers: list[list[int]] = []  # all-gathers (on demand or prefetched) each micro-step's forward made
    for step in range(STEPS):
        gathers.append([])
        for m in range(GA):
            a = (m * world + rank) * mb
            before = c.gather_count + c.prefetch_count
            logits = engine(x[step, a : a + mb], step % 2 == 0)
            gathers[-1].append(c.gather_count + c.prefetch_count - before)
            engine.backward(loss_fn(engine.module, logits, y[step, a : a + mb]))
            engine.step()
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"gathers": gathers, "params": params, "units": len(c.units)}


@pytest.mark.parametrize("budget", ["defaults", "tight"])
def test_units_stay_gathered_through_the_accumulation_window(budget: str) -> None:
    """Inside an accumulation window no step changes the parameters: a backward that does not end
    it keeps the units gathered (when the live budget holds them all) and the next micro-step's
    forward gathers nothing; the window's last backward releases them, and the next window gathers
    again. A budget short of the model releases and gathers as before. Both train as plain PyTorch."""
    zero = {} if budget == "defaults" else {"stage3_max_live_parameters": 300, "stage3_prefetch_bucket_size": 700}
    ref = reference()
    ref_flat = torch.cat([t.reshape(-1) for t in ref.values()])
    for r in run_distributed(window_worker, 2, zero):
        flat = torch.cat([r["params"][n].reshape(-1) for n in ref])
        assert ((flat - ref_flat).norm() / ref_flat.norm()).item() <= 1e-5
        for first, second in r["gathers"]:
            assert first >= r["units"] - 1  # every unit (the tied head's is the embedding's)
            if budget == "defaults":
                assert second == 0, r["gathers"]
            else:  # gathered again (prefetches the pass did not use vary the count)
                assert second >= r["units"] - 1, r["gathers"]


def init_worker(rank: int, world: int) -> dict:
    out = {}
    for stage in (2, 3):
        model = build(init=True)
        cfg = {"train_batch_size": 2 * world, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
        engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
        with engine.gathered():
            out[stage] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out


def test_zero_init_builds_the_same_values() -> None:
    want = {n: p.detach() for n, p in build().named_parameters()}
    for r in run_distributed(init_worker, 2):
        for stage in (2, 3):
            for n, t in want.items():
                assert torch.equal(r[stage][n], t), (stage, n)


class Wide(nn.Module):
    def __init__(self, layers: int = 8, width: int = 256) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def budget_worker(rank: int, world: int, budget: int) -> dict:
    torch.manual_seed(0)
    with zeroshard.zero.Init() as init:
        model = Wide()
    unit = 256 * 256
    cfg = {"train_batch_size": 2 * world, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": unit, "stage3_prefetch_bucket_size": unit},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    losses = []
    x = torch.randn(2, 256)
    for _ in range(4):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    mem = engine.memory_usage()
    return {"init_peak": init.peak_bytes, "mem": mem, "losses": torch.tensor(losses)}


def test_model_larger_than_budget_builds_and_trains() -> None:
    psi = 8 * 256 * 256
    budget = int(0.7 * 4 * psi)  # the full fp32 parameters (4Ψ bytes) would not fit
    for r in run_distributed(budget_worker, 2, budget):
        assert r["init_peak"] <= budget, (r["init_peak"], budget)
        mem = r["mem"]
        # No compute-dtype shard is kept at rest (units are gathered from the fp32 masters).
        held = mem["parameters"] + mem.get("parameter_shard", 0) + mem["gathered_peak"]
        assert held <= budget, (mem, budget)
        # Gathered parameters stay bounded by the live budget + the unit in use + the prefetch
        # budget (one unit each here), not by the model (8 units).
        assert mem["gathered_peak"] <= 3 * (2 * 256 * 256)
        assert r["losses"][-1] < r["losses"][0]


#: (hidden size, ZeRO-3 settings): a budget of a few units (gathered again in backward), and the
#: default budget holding the model, where every unit is gathered once per pass and lends its
#: row of the fp32 shard (``zeroshard.core.zero3.lent_rows``; rows of several pages at width 128)
LLAMA_VARIANTS = {
    "tight": (32, {"stage3_max_live_parameters": 3000, "stage3_prefetch_bucket_size": 3000}),
    "lent": (128, {}),
}


def _llama(hidden: int = 32):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM, cfg


def hf_worker(rank: int, world: int, variant: str) -> dict:
    hidden, zero = LLAMA_VARIANTS[variant]
    cls, hf_cfg = _llama(hidden)
    torch.manual_seed(0)
    with zeroshard.zero.Init():
        model = cls(hf_cfg)
    cfg = {"train_batch_size": 4, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    lender = engine.optimizer.lender
    ids = torch.randint(0, 97, (3, 4, 10), generator=torch.Generator().manual_seed(5))
    mb = 4 // world
    for step in range(3):
        batch = ids[step, rank * mb : (rank + 1) * mb]
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    norm = engine.module.model.norm.weight
    with zeroshard.zero.GatheredParameters(norm, modifier_rank=0), torch.no_grad():
        if rank == 0:
            norm.mul_(3.0)
    with engine.gathered():
        out = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out["lent bytes"] = torch.tensor(lender.peak_lent_bytes if lender is not None else 0)
    return out


@pytest.mark.parametrize("variant", sorted(LLAMA_VARIANTS))
def test_hugging_face_llama_under_zero_init(variant: str) -> None:
    cls, hf_cfg = _llama(LLAMA_VARIANTS[variant][0])
    torch.manual_seed(0)
    ref = cls(hf_cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    ids = torch.randint(0, 97, (3, 4, 10), generator=torch.Generator().manual_seed(5))
    for step in range(3):
        opt.zero_grad()
        ref(input_ids=ids[step], labels=ids[step]).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    with torch.no_grad():
        ref.model.norm.weight.mul_(3.0)
    want = {n: p.detach() for n, p in ref.named_parameters()}
    want_flat = torch.cat([t.reshape(-1) for t in want.values()])
    for r in run_distributed(hf_worker, 2, variant):
        assert (int(r["lent bytes"]) > 0) == (variant == "lent")
        flat = torch.cat([r[n].reshape(-1) for n in want])
        assert ((flat - want_flat).norm() / want_flat.norm()).item() <= 1e-5
        torch.testing.assert_close(r["model.norm.weight"], want["model.norm.weight"], rtol=1e-6, atol=1e-6)


def with_buffers(model: nn.Module) -> nn.Module:
    """BatchNorm-style running statistics (persistent, in the file) and a scratch buffer (not)."""
    model.block.register_buffer("running_mean", torch.linspace(-1.0, 1.0, DIM))
    model.block.register_buffer("num_batches_tracked", torch.tensor(7))
    model.register_buffer("scratch", torch.ones(3), persistent=False)
    return model


def save16_worker(rank: int, world: int, out_dir: str) -> list[str]:
    model = with_buffers(build())
    cfg = {"train_batch_size": 2 * world, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": 0, "stage3_gather_16bit_weights_on_model_save": True},
           "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    engine.save_16bit_model(out_dir, "pytorch_model.bin")
    return sorted(p.name for p in Path(out_dir).iterdir())


def test_save_16bit_model_streams_full_weights(tmp_path) -> None:
    from safetensors.torch import load_file

    names = run_distributed(save16_worker, 2, str(tmp_path))
    assert names[0] == ["pytorch_model.safetensors"]
    saved = load_file(tmp_path / "pytorch_model.safetensors")
    model = with_buffers(build())
    want = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    # the buffers as the bf16 module holds them (floating ones cast, as module.to(bf16) does)
    want |= {n: b.to(torch.bfloat16) if b.is_floating_point() else b for n, b in model.state_dict().items()
             if n.startswith("block.") and n.split(".")[-1] in ("running_mean", "num_batches_tracked")}
    assert set(saved) == set(want)  # the tied head is stored once, as embed.weight; no scratch buffer
    for n, t in want.items():
        assert saved[n].dtype == t.dtype and torch.equal(saved[n], t), n


def load_worker(rank: int, world: int, path: str) -> dict:
    torch.manual_seed(123)  # different from the weights on disk
    with zeroshard.zero.Init():
        model = Wide(layers=3, width=64)
    zeroshard.zero.load_weights(model, path)  # each rank reads its own ranges only
    cfg = {"train_batch_size": 2 * world, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    with engine.gathered():
        after_init = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    zeroshard.zero.load_weights(engine.module, {n: t * 2 for n, t in after_init.items()})  # into an engine
    with engine.gathered():
        after_engine = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"init": after_init, "engine": after_engine}


def test_load_weights_into_partitioned_model(tmp_path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = {n: p.detach().clone() for n, p in Wide(layers=3, width=64).named_parameters()}
    save_file(src, tmp_path / "model.safetensors")
    for r in run_distributed(load_worker, 2, str(tmp_path)):
        for n, t in src.items():
            assert torch.equal(r["init"][n], t), n
            assert torch.equal(r["engine"][n], 2 * t), n
