"""The DLRM's dense part (bottom MLP, dot interaction, top MLP; forward + backward) with
``AlignedLinear`` layers against plain ``nn.Linear``, alternating in one process, medians.

The bench_e2e model at pool1: 13 -> 512 -> 256 -> 64, 26 sparse features of width 64 (interaction
width 415), top 415 -> 512 -> 256 -> 1, batch 2048. Run (repository root, venv active):

    python benchmarks/bench_aligned_linear.py --threads 2
    python benchmarks/bench_aligned_linear.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from neorec.model.aligned_linear import AlignedLinear
from neorec.model.dlrm import DotInteraction

from bench_args import at_least  # same folder (run as a script)


def mlp(layer, sizes):
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        layers += [layer(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=at_least(1), default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--rounds", type=at_least(1), default=40,
                        help="timed steps of each variant, alternating, after 2 untimed ones; medians (default 40)")
    parser.add_argument("--batch", type=at_least(1), default=2048, help="samples per step (default 2048)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    features, dim = 26, 64
    models = {}
    for name, layer in (("aligned", AlignedLinear), ("plain", nn.Linear)):
        torch.manual_seed(0)
        models[name] = (mlp(layer, [13, 512, 256, dim]), mlp(layer, [dim + (features + 1) * features // 2, 512, 256, 1]))
    interaction = DotInteraction(features, embedding_dim=dim)
    dense = torch.randn(args.batch, 13)
    sparse = torch.randn(args.batch, features, dim, requires_grad=True)

    def step(name):
        bottom, top = models[name]
        top(interaction(bottom(dense), sparse)).sum().backward()

    times = {name: [] for name in models}
    for name in models:
        step(name), step(name)
    for _ in range(args.rounds):
        for name in models:
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    aligned, plain = (statistics.median(times[n]) for n in ("aligned", "plain"))
    print(f"threads {args.threads}: AlignedLinear {aligned * 1e3:.2f} ms, nn.Linear {plain * 1e3:.2f} ms per step; "
          f"saved {(plain - aligned) * 1e3:.2f} ms ({(plain - aligned) / plain * 100:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
