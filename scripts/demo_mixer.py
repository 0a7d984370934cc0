"""Short tour of the mixer library: every pattern, its three forms side by side, cost and cache figures.

    python scripts/demo_mixer.py [--n 300] [--plot patterns.png]
"""

import argparse
import time

import torch

from hf_resolvent.ops import resolvent_mix
from hf_resolvent.patterns import get_pattern, plot_patterns

SPECS = ["attention", "local_attention:8", "dense", "banded:8", "diagonal", "exp2", "exp2:ce", "square", "square:ce"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="sequence length of the random test inputs")
    parser.add_argument("--plot", default="patterns.png", help="where to write the A/B masks (PNG)")
    args = parser.parse_args()

    torch.manual_seed(0)
    batch, heads, d = 2, 4, 32
    qa, ka, qb, kb, x = (torch.randn(batch, heads, args.n, d) for _ in range(5))
    g = torch.rand(batch, heads, args.n)
    print(f"three forms on random inputs (B={batch}, H={heads}, n={args.n}, d={d}, float32), "
          f"and the cost of token 2048 / cache after 2048 tokens")
    print(f"{'pattern':<18}{'|par-ref|':>11}{'|rec-ref|':>11}{'par ms':>9}{'cost':>7}{'cache':>7}")
    for spec in SPECS:
        ref = resolvent_mix(qa, ka, qb, kb, x, g, spec, impl="reference")
        t0 = time.perf_counter()
        par = resolvent_mix(qa, ka, qb, kb, x, g, spec, impl="parallel")
        ms = 1e3 * (time.perf_counter() - t0)
        rec = resolvent_mix(qa, ka, qb, kb, x, g, spec, impl="recurrent")
        p = get_pattern(spec)
        print(f"{spec:<18}{(par - ref).abs().max().item():>11.1e}{(rec - ref).abs().max().item():>11.1e}"
              f"{ms:>9.1f}{p.cost(2048):>7}{p.cache_size(2048):>7}")
    plot_patterns(args.plot)
    print(f"wrote {args.plot} (non-zero entries of A and B, the papers' Figure 2)")


if __name__ == "__main__":
    main()
