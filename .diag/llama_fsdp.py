import torch, torch.distributed as dist, numpy as np, torch.nn.functional as F
import optremat, optremat.distributed
from optremat.distributed import run_local, wrap, held_by_rank
from optremat.runtime.measure import measure_peak
from transformers import LlamaConfig, LlamaForCausalLM

def make():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=1000, max_position_embeddings=128, use_cache=False, tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    tokens = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(1))
    return model, tokens

def loss_of(tokens):
    return lambda out: F.cross_entropy(out.logits.flatten(0, 1), tokens.flatten())

def work(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, tokens = make()
    mine = tokens.chunk(world)[rank].contiguous()
    par = optremat.FSDP(units=("model.layers.*",)) if kind == "fsdp" else optremat.DDP()
    plan = optremat.distributed.plan(model, (mine,), 0.8, par, loss_fn=loss_of(mine), time_limit=2)
    optremat.apply(model, plan)
    w = wrap(model, plan.parallel)
    def step():
        for p in model.parameters(): p.grad = None
        loss_of(mine)(w(mine)).backward()
    step(); step()
    peaks = [measure_peak(step, resident=[held_by_rank(model, w), mine], setup=step).peak_bytes for _ in range(3)]
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).numpy().copy() for n, p in model.named_parameters()}
    return plan.budget_bytes, plan.predicted_peak_bytes, min(peaks), len(plan.regions), grads if rank == 0 else None

if __name__ == "__main__":
    import sys
    res = run_local(work, 2, sys.argv[1])
    model, tokens = make()
    loss_of(tokens)(model(tokens)).backward()
    ref = {n: p.grad.numpy() for n, p in model.named_parameters()}
    for r in res: print("budget", r[0], "pred", r[1], "meas", r[2], f"{r[2]/r[1]-1:+.3f}", "regions", r[3])
    g = res[0][4]
    print("max err", max(float(np.abs(g[k]-ref[k]).max()) for k in ref))
