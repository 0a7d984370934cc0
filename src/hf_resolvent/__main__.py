"""``python -m hf_resolvent``: the patterns' per-token cost and decode cache, and a figure of their A/B masks.

    python -m hf_resolvent [SPEC ...] [-n 2048] [--plot runs/patterns.png]

The command lives here rather than under ``python -m hf_resolvent.patterns``: the package imports its patterns
module, so running that module as ``__main__`` loads a second copy of it, and Python warns that it does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_resolvent.patterns import get_pattern, plot_patterns

# the named patterns of the papers' complexity table (windows of 8)
SPECS = ["attention", "local_attention:8", "dense", "banded:8", "diagonal", "exp2", "exp2:ce", "square", "square:ce"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_resolvent", description="Inspect resolvent mixer patterns.")
    parser.add_argument("--plot", metavar="PNG", help="write the A/B masks of the patterns to this PNG")
    parser.add_argument("-n", type=int, default=2048, help="sequence length for the figures printed")
    parser.add_argument("specs", nargs="*", default=SPECS, help="pattern specs (default: the papers' table)")
    args = parser.parse_args(argv)
    try:
        patterns = [get_pattern(spec) for spec in args.specs]
    except ValueError as e:  # get_pattern's message names the spec and the accepted forms
        parser.error(str(e))
    n = args.n
    print(f"{'pattern':<20}{'cost(n)':>10}{'cache_size(n)':>15}   (n = {n})")
    for p in patterns:
        print(f"{p.name:<20}{p.cost(n):>10}{p.cache_size(n):>15}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_patterns(args.plot, args.specs)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
