import time, torch, sys
from transformers import LlamaConfig, LlamaForCausalLM
import torch.nn.functional as F
from optremat.extract import trace
from optremat.sharding import FSDP, per_rank
from optremat.schedule import simulate, keep_all
cfg = dict(b1=dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
           b7=dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, vocab_size=32000))[sys.argv[1]]
config = LlamaConfig(**cfg, max_position_embeddings=4096, use_cache=False, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
t=time.time()
with torch.device("meta"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
print("params", sum(p.numel() for p in model.parameters())/1e9)
idx = torch.zeros(1, 4096, dtype=torch.long, device="meta")
def loss(out): 
    return F.cross_entropy(out.logits.flatten(0,1).float(), idx.flatten())
tr = trace(model, (idx,), loss, device="h100")
print("traced", time.time()-t, tr.graph.n)
g = tr.graph
print("unplanned 1 rank GiB", simulate(g, keep_all(g)).peak_bytes/2**30)
for w in (8, 64):
    r = per_rank(g, tr.parameters(model), FSDP(units=("model.layers.*",), world=w, optimizer_state=4.0))
    print(w, simulate(r, keep_all(r)).peak_bytes/2**30, time.time()-t)
from collections import Counter
c = Counter(g.ops[i] for i in range(g.n) if "attention" in g.ops[i] or "softmax" in g.ops[i] or "bmm" in g.ops[i])
print(c)
import numpy as np
big = np.argsort(-g.size)[:8]
for i in big: print(g.ops[i], g.tensor[i], g.size[i]/2**20, g.module[i])
