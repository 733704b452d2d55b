"""Driver time of suffix drafts per committed token: SuffixIndex.extend + propose, as the driver
calls them, over greedy outputs kept by `spd eval --reference-cache` / `spd draft-policies`.

    spd measure suffix-time --reference-cache DIR [--limit 20] [--prompt-tokens 100]

Each output is replayed token by token after a stand-in prompt; the median over outputs is printed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from spd_engine.engine.protocol.suffix import SuffixIndex, SuffixSettings
from spd_engine.tools.cli import HelpFormatter


def time_output(tokens: list[int], prompt_tokens: int, settings: SuffixSettings) -> float:
    """Microseconds per token of extend + propose over one output."""
    index = SuffixIndex(settings)
    index.extend(list(range(prompt_tokens)))
    t0 = time.perf_counter()
    for tok in tokens:
        index.extend((tok,))
        index.propose(index.history[-settings.max_len:], len(index.history))
    return 1e6 * (time.perf_counter() - t0) / max(1, len(tokens))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spd measure suffix-time", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--reference-cache", required=True, metavar="DIR", help="greedy outputs (*.json with 'tokens')")
    p.add_argument("--limit", type=int, default=20, help="outputs to time")
    p.add_argument("--prompt-tokens", type=int, default=100, help="length of the stand-in prompt")
    args = p.parse_args(argv)
    files = sorted(Path(args.reference_cache).glob("*.json"))[:max(1, args.limit)]
    if not files:
        print(f"suffix_time: no greedy outputs (*.json) in {args.reference_cache}", file=sys.stderr)
        return 2
    per = []
    for f in files:
        try:
            tokens = json.loads(f.read_text())["tokens"]
        except (OSError, ValueError, KeyError) as err:
            print(f"suffix_time: {f}: not a reference-cache entry ({err})", file=sys.stderr)
            return 2
        per.append(time_output(tokens, args.prompt_tokens, SuffixSettings()))
    print(f"suffix extend + propose per committed token: median {statistics.median(per):.1f} us "
          f"(min {min(per):.1f}, max {max(per):.1f}) over {len(per)} outputs")
    return 0

