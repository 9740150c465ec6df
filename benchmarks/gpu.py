"""The GPU benchmark: the LM head chunked by the plan, on CUDA, in bfloat16 and float32.

    python -m benchmarks.gpu [--rounds 9] [--limit 10] [--dtypes bfloat16,float32]
                             [--cost-model roofline|profile] [--smoke]

gpt-small (GPT-2 small's shape: vocabulary 50257, 1024 tokens, width 768, 12 blocks, 12
heads, batch 4) returning its final hidden states, its loss `optremat.CausalLMLoss` over
its tied head, on one CUDA device, in bfloat16 and in float32, with the rows of
`benchmarks.chunked`: the unplanned step with the whole head; per-block checkpointing
(non-reentrant `torch.utils.checkpoint` around every block) with the whole head, and with
the head and loss in PyTorch's `F.linear_cross_entropy` under its default options (where
this PyTorch has it);
optremat planned with `chunks="auto"` at both per-block peaks measured (where no plan is
predicted to fit one, at the least peak found) and at 70% and 50% of the first;
`optremat.compile_backend` (Inductor) on the model, the loss's chunks left to it, at each
per-block peak; above each table, the least peak of any region plan with the whole
head and with the chunks priced. Peaks come from the CUDA allocator, step times from
interleaved rounds (the median of per-round ratios to the unplanned step), as
`benchmarks.native` measures them. Writes gpu.md under $OUT when it is set, else here;
with `--cost-model profile`, every op timed on the GPU instead of priced by the roofline
(`gpu_profile.md`); with `--measured`, the roofline over the GPU's rates as
`optremat.measure_profile` measures them before planning instead of its built-in profile
(`gpu_measured.md`).

`--smoke` runs the same code on the CPU on a 2-block GPT of width 64, for one round with
2 s plans at per-block checkpointing's peak only (no least peaks; compiled by aot_eager),
and writes nothing:
the check (`tests/test_bench.py`) that the command still runs where no GPU is.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

import optremat
from benchmarks.chunked import GPT_SMALL, HEADER, gpt
from benchmarks.report import write_rows
from optremat.tracing.costs import COST_MODELS

SMOKE = dict(vocab=1024, seq=64, dim=64, layers=2, heads=2)
FRACTIONS = (0.7, 0.5)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--limit", type=float, default=10.0)
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of " + ", ".join(DTYPES))
    parser.add_argument("--cost-model", default="roofline", choices=COST_MODELS,
                        help="how plans price ops: the roofline model, or each op timed on the GPU (profile)")
    parser.add_argument("--measured", action="store_true",
                        help="price ops over the rates optremat.measure_profile measures on this GPU")
    parser.add_argument("--smoke", action="store_true", help="a tiny configuration on the CPU, one round, no page")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    if unknown := set(dtypes) - set(DTYPES):
        parser.error(f"unknown dtypes {', '.join(sorted(unknown))}; choose from {', '.join(DTYPES)}")
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks.gpu needs a CUDA device (--smoke runs a tiny configuration on the CPU)")
    device = "cpu" if args.smoke else "cuda"
    shape, batch, rounds, limit, fractions = ((SMOKE, 2, 1, 2.0, ()) if args.smoke
                                              else (GPT_SMALL, 4, args.rounds, args.limit, FRACTIONS))
    machine = f"{torch.cuda.get_device_name()}, {os.cpu_count()} host cores" if not args.smoke else "CPU (smoke)"
    command = " ".join(["python -m benchmarks.gpu"] + sys.argv[1:])
    head = ["# LM head chunks on a GPU", "", f"Machine: {machine}, torch {torch.__version__}. Command: `{command}`.",
            "", __doc__.split("\n\n", 2)[2].split("\n\n`--smoke`")[0].strip(), ""]
    if args.measured and args.cost_model != "roofline":
        parser.error("--measured measures the rates the roofline prices ops over: not with --cost-model profile")
    profile = optremat.measure_profile(device) if args.measured else None
    if profile is not None:
        head += [f"Measured profile: {profile}.", ""]
        print(head[-2], flush=True)
    page = "gpu_measured.md" if args.measured else "gpu.md" if args.cost_model == "roofline" else f"gpu_{args.cost_model}.md"
    out = Path(os.environ.get("OUT", Path(__file__).parent)) / page
    notes: list[str] = []
    rows: list[list[str]] = []
    for name in dtypes:
        floors, table = gpt(shape, batch, rounds, limit, device, DTYPES[name], fractions, least_peaks=not args.smoke,
                            cost_model=args.cost_model, inner="aot_eager" if args.smoke else "inductor", profile=profile)
        notes += [f"- {name}: {line}" for line in floors]
        rows += [[name, *row] for row in table]
        if args.smoke:
            print(*floors, *(" | ".join(row) for row in rows[-len(table):]), sep="\n", flush=True)
        else:  # the page rewritten after each dtype, so a failure in the second loses nothing of the first
            write_rows(out, head + notes + [""], ["dtype", *HEADER], [rows])


if __name__ == "__main__":
    main()
