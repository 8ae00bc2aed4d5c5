"""The CUDA/NCCL path, end to end, on one GPU (skipped without CUDA; CI has none).

One process, world size 1 over NCCL: every stage and precision trains the toy model on the GPU
and is compared with plain PyTorch on the same GPU; ZeRO-3 also builds a Hugging Face model under
zero.Init. Run on a GPU machine with ``python3 -m pytest -q tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch
from models import make_data, make_model, train_reference, train_reference_mixed

import zeroshard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS, GA, BATCH, LR = 6, 2, 24, 1e-2
TOL = {"fp32": 1e-5, "bf16": 0.03, "fp16": 0.005}  # as in tests/distributed/test_parity.py


@pytest.fixture(scope="module", autouse=True)
def nccl() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means real fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    zeroshard.init_distributed()
    assert "nccl" in torch.distributed.get_backend()  # "cpu:gloo,cuda:nccl": control messages on the CPU


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cuda_parity(stage: int, precision: str) -> None:
    dev = torch.device("cuda")
    x, y = (t.to(dev) for t in make_data(STEPS, BATCH))
    w0 = torch.cat([p.detach().reshape(-1) for p in make_model(0).to(dev).parameters()])
    if precision == "fp32":
        ref = train_reference(make_model(0).to(dev), x, y, LR, 1.0)
    else:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        ref = train_reference_mixed(make_model(0).to(dev), x, y, LR, 1.0, dtype)
    cfg = {"train_batch_size": BATCH, "gradient_accumulation_steps": GA, "gradient_clipping": 1.0,
           "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
           "bf16": {"enabled": precision == "bf16"},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 600, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": 500},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    engine, _, _, _ = zeroshard.initialize(model=make_model(0), config=cfg)
    assert engine.device.type == "cuda"
    mb = BATCH // GA
    for step in range(STEPS):
        for m in range(GA):
            engine.backward(engine(x[step, m * mb : (m + 1) * mb], y[step, m * mb : (m + 1) * mb]))
            engine.step()
    with engine.gathered():
        got = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    want = torch.cat([p.detach().float().reshape(-1) for p in ref.parameters()])
    scale = want.norm() if precision == "fp32" else (want - w0).norm()
    rel = ((got - want).norm() / scale).item()
    print(f"cuda stage {stage} {precision}: {rel:.2e}")
    assert rel <= TOL[precision]


def test_cuda_zero_init_hugging_face() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    with zeroshard.zero.Init():
        model = transformers.LlamaForCausalLM(cfg)
    ds = {"train_batch_size": 4, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=ds)
    ids = torch.randint(0, 97, (4, 16), device="cuda")
    losses = []
    for _ in range(5):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert engine.memory_usage()["parameters"] == 0  # at rest: only the shard


@pytest.mark.parametrize("param_device", ["none", "cpu"])
def test_cuda_lora_frozen_base_partitioned(param_device: str) -> None:
    """LoRA at ZeRO-3 on the GPU, the base built under zero.Init: the frozen base's chunks are kept
    (on the device, or pinned in host memory with ``offload_param: cpu``) and gathered like the
    trained ones; fp32 parity with plain PyTorch on the same GPU, the base unchanged."""
    import torch.nn.functional as F
    from lora_model import build, check_lora, data

    dev = torch.device("cuda")
    x, y = data(24)
    ref = build().to(dev)
    trained = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, weight_decay=0.01)
    for s in range(4):
        opt.zero_grad()
        F.cross_entropy(ref(x[s * 6 : s * 6 + 6].to(dev)), y[s * 6 : s * 6 + 6].to(dev)).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if param_device != "none":
        zero["offload_param"] = {"device": param_device, "pin_memory": True}
    cfg = {"train_micro_batch_size_per_gpu": 6, "gradient_clipping": 1.0, "zero_optimization": zero,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    m = build("device")
    engine, *_ = zeroshard.initialize(model=m, config=cfg,
                                      model_parameters=[p for p in m.parameters() if p.requires_grad])
    placed = engine.optimizer.memory_placement()["frozen_parameter_shard"]
    assert set(placed) == ({"device"} if param_device == "none" else {"pinned_host"}), placed
    for s in range(4):
        engine.backward(F.cross_entropy(engine(x[s * 6 : s * 6 + 6].to(dev)), y[s * 6 : s * 6 + 6].to(dev)))
        engine.step()
    with engine.gathered():
        got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    rel = check_lora(got, {n: p.detach() for n, p in ref.named_parameters()}, TOL["fp32"])
    print(f"cuda LoRA stage 3, frozen base on {param_device}: {rel:.2e}")
