"""Short tour of the mixer library: every pattern, its three forms side by side, cost and cache figures.

    python scripts/bench/demo_mixer.py [--n 300] [--plot runs/patterns.png]
"""

import argparse
import time
from pathlib import Path

import torch

from hf_resolvent.ops import recurrent_mix, reference_mix, resolvent_mix
from hf_resolvent.patterns import get_pattern, plot_patterns

SPECS = ["attention", "local_attention:8", "dense", "banded:8", "diagonal", "exp2", "exp2:ce", "square", "square:ce"]


def parse_args(argv: "list[str] | None" = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="sequence length of the random test inputs")
    # runs/ is git-ignored: a figure written there is never taken for a file of the repository
    parser.add_argument("--plot", default="runs/patterns.png", help="where to write the A/B masks (PNG)")
    return parser.parse_args(argv)


def main(argv: "list[str] | None" = None) -> None:
    args = parse_args(argv)

    torch.manual_seed(0)
    batch, heads, d = 2, 4, 32
    qa, ka, qb, kb, x = (torch.randn(batch, heads, args.n, d) for _ in range(5))
    g = torch.rand(batch, heads, args.n)
    print(f"three forms on random inputs (B={batch}, H={heads}, n={args.n}, d={d}, float32), "
          f"and the cost of token 2048 / cache after 2048 tokens")
    print(f"{'pattern':<18}{'|par-ref|':>11}{'|rec-ref|':>11}{'par ms':>9}{'cost':>7}{'cache':>7}")
    for spec in SPECS:
        ref = reference_mix(qa, ka, qb, kb, x, g, spec)
        t0 = time.perf_counter()
        par = resolvent_mix(qa, ka, qb, kb, x, g, spec)  # the parallel form
        ms = 1e3 * (time.perf_counter() - t0)
        rec = recurrent_mix(qa, ka, qb, kb, x, g, spec)
        p = get_pattern(spec)
        print(f"{spec:<18}{(par - ref).abs().max().item():>11.1e}{(rec - ref).abs().max().item():>11.1e}"
              f"{ms:>9.1f}{p.cost(2048):>7}{p.cache_size(2048):>7}")
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot_patterns(args.plot, SPECS)  # the patterns of the table above
    print(f"wrote {args.plot} (non-zero entries of A and B, the papers' Figure 2 with the diagonal pattern)")


if __name__ == "__main__":
    main()
