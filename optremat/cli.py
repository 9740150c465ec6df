"""The `optremat` command line.

Exit codes: 0 success, 2 bad input (unknown model, unreadable file, untraceable model).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from optremat.coarsen import coarsen
from optremat.graph import Graph, GraphError, format_bytes
from optremat.schedule import keep_all, simulate

EXIT_BAD_INPUT = 2


def _graph_command(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.graph:
        graph = Graph.load(args.graph)
        source = args.graph
    else:
        from optremat.extract import extract
        from optremat.models import build

        example = build(args.model)
        graph = extract(example.model, example.inputs, example.loss_fn, device=args.device)
        source = f"built-in model {args.model}"
    seconds = time.perf_counter() - start
    coarse = coarsen(graph, by_module=args.by_module)
    unplanned = simulate(graph, keep_all(graph))
    coarse_peak = simulate(coarse.coarse, keep_all(coarse.coarse)).peak_bytes
    if args.save:
        graph.save(args.save)
    if args.json:
        print(json.dumps({
            "source": source, "nodes": graph.n, "edges": len(graph.edges), "coarse_nodes": coarse.coarse.n,
            "unplanned_peak_bytes": unplanned.peak_bytes, "coarse_unplanned_peak_bytes": coarse_peak,
            "resident_bytes": graph.pinned_bytes, "step_cost_seconds": graph.total_cost,
            "extract_seconds": seconds, "fingerprint": graph.fingerprint,
        }))
        return 0
    print(f"{source} (fingerprint {graph.fingerprint}, read in {seconds:.1f} s)")
    print(graph.summary())
    print(f"unplanned peak {format_bytes(unplanned.peak_bytes)} (simulated)")
    print(f"coarsened{' by module' if args.by_module else ''}: {coarse.coarse.n} nodes "
          f"({graph.n / max(coarse.coarse.n, 1):.1f}x fewer), unplanned peak {format_bytes(coarse_peak)}")
    if args.save:
        print(f"graph written to {args.save}")
    return 0


def _parser() -> argparse.ArgumentParser:
    from optremat.models import BUILDERS

    parser = argparse.ArgumentParser(prog="optremat", description="Activation rematerialization planning for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    graph = commands.add_parser("graph", help="extract (or load) a training-step graph and summarise it")
    source = graph.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(BUILDERS), help="a built-in model")
    source.add_argument("--graph", help="a graph file (optremat JSON or a published node-link benchmark graph)")
    graph.add_argument("--device", default="cpu", help="device profile for roofline costs (cpu, a100, h100)")
    graph.add_argument("--by-module", action="store_true", help="also group consecutive ops of one module")
    graph.add_argument("--save", help="write the extracted graph as JSON")
    graph.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    graph.set_defaults(run=_graph_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from optremat.extract import ExtractionError

    try:
        return args.run(args)
    except (GraphError, ExtractionError, OSError, ValueError, KeyError) as error:
        print(f"optremat: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
