"""`spd draft-policies`: what drafting policies would buy, measured offline with the exact T=0
replay (train/draft_potential.py).

    spd draft-policies [--stages 4] [--max-new-tokens 256] [--limit N] [--reference-cache DIR] [--json OUT]
                       [--branches 2,4] [--branch-when refill,always]

Per dataset, overall, and over the prompts whose greedy output does not loop: alpha and pooled
EAL of every policy in one run (the same references and draft tables), plus the PDM's top-1/2/4
recall and the suffix draft's coverage and precision per fill; with --branches, the same for
branch width W (train/branch_replay.py: what W chains would buy, with the stage tokens per step
they cost), for the PDM alone and for the default suffix chooser.
"""
from __future__ import annotations

import argparse
import builtins
import functools
import math
import sys

POLICY_GRID = {"pdm": None, **{f"suffix>={m}": (m, math.inf) for m in (1, 2, 3, 4, 6, 8)},
               **{f"suffix>={m},margin<{x:g}": (m, x) for m in (1, 2, 3) for x in (1.0, 2.0, 4.0, 8.0)}}


def _policies():
    from spd_engine.engine.protocol.drafting import DraftChooser
    from spd_engine.engine.protocol.suffix import SuffixSettings

    return {name: DraftChooser() if spec is None else DraftChooser(SuffixSettings(16, spec[0]), spec[1])
            for name, spec in POLICY_GRID.items()}


def _pooled(accs, n: int) -> dict:
    ver = sum(a.verified for a in accs)
    acc = sum(a.accepted for a in accs)
    ticks = sum(a.ticks for a in accs)
    dec = sum(a.tokens - 1 for a in accs)
    return {"prompts": len(accs), "alpha": acc / ver if ver else None, "eal": n * dec / ticks if ticks else None}


def _branch_policies(widths: str, whens: str) -> list:
    from spd_engine.engine.protocol.branching import WHEN, BranchPolicy
    from spd_engine.tools.cli_conventions import parse_names

    try:
        ws = [int(w) for w in widths.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--branches takes comma-separated integers, got {widths!r}") from None
    if any(w < 2 or w > 4 for w in ws):
        raise ValueError(f"--branches: each W must be in 2..4 (the draft table ranks 4 PDM drafts), got {widths!r}")
    return [BranchPolicy(w, when) for w in ws for when in parse_names(whens, WHEN, "branch polic(ies)")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from spd_engine.tools.cli_conventions import add_json_argument
    from spd_engine.tools.engine_args import add_engine_arguments

    add_engine_arguments(p, mode_flags=False, branch_flags=False)
    g = p.add_argument_group("policies")
    g.add_argument("--datasets", default="mt_bench,humaneval,gsm8k", help="comma-separated subset of the prompt sets")
    g.add_argument("--limit", type=int, default=None, help="prompts per dataset (default: all)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate per prompt at most")
    g.add_argument("--reference-cache", default=None, metavar="DIR", help="greedy outputs reused across runs")
    g.add_argument("--branches", dest="branch_widths", default="",
                   help="comma-separated branch widths W > 1 to score too (at most 4)")
    g.add_argument("--branch-when", dest="branch_whens", default="refill,always", help="where a branch may start: refill, always")
    add_json_argument(g, "the policy table and the draft-state statistics")


def run(args) -> int:
    return _run(args)


def _run(args) -> int:
    import torch

    from spd_engine.engine.model.greedy import greedy_generate
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.engine.protocol.drafting import DraftChooser
    from spd_engine.engine.protocol.suffix import SuffixSettings
    from spd_engine.engine.runtime.build import build_pdm
    from spd_engine.tools.cli_conventions import parse_names, write_json
    from spd_engine.tools.engine_args import engine_config
    from spd_engine.train.branch_replay import pooled as branch_pooled
    from spd_engine.train.branch_replay import score_branches
    from spd_engine.train.draft_potential import StateStats, loops, score_prompt
    from spd_engine.train.evaluate import DATASETS, default_data_dir, encode_prompt, full_target, load_dataset
    from spd_engine.train.fast_eval import draft_table
    from spd_engine.train.reference_cache import ReferenceCache

    ecfg, tok_dir = engine_config(args)
    if ecfg.parallel.topology.tp > 1:
        raise ValueError("spd draft-policies replays the unsharded model: --tp does not apply")
    tok = Tokenizer.from_dir(tok_dir) if tok_dir is not None else None
    eos = tok.eos_ids if tok is not None else ecfg.model.cfg.eos_token_ids
    names = parse_names(args.datasets, DATASETS, "dataset(s)")
    prompts = [p for name in names for p in load_dataset(default_data_dir(), name, args.limit)]
    if args.threads:
        torch.set_num_threads(args.threads)
    target, pdm, n = full_target(ecfg), build_pdm(ecfg), ecfg.parallel.topology.n
    cache = ReferenceCache(args.reference_cache, ecfg) if args.reference_cache else None
    policies = _policies()
    probe = DraftChooser(SuffixSettings(16, 2))
    branch_policies = _branch_policies(args.branch_widths, args.branch_whens)
    branch_choosers = {"pdm": DraftChooser(), "suffix>=2": probe}
    per_branch: dict[str, dict[str, list]] = {}  # group -> "W=.. when chooser" -> [BranchRun]
    per: dict[str, dict[str, list]] = {}  # group -> policy -> [Acceptance]
    stats: dict[str, StateStats] = {}
    for i, pr in enumerate(prompts):
        ids = encode_prompt(pr.text, tok, ecfg.model.cfg.vocab_size)
        compute = lambda: greedy_generate(target, ids, args.max_new_tokens, eos_ids=eos,  # noqa: E731
                                          chunk=ecfg.runtime.prefill_chunk)
        y = cache.get_or_compute(ids, args.max_new_tokens, eos, ecfg.runtime.prefill_chunk, compute) if cache else compute()
        if len(y) < 2:
            continue
        table = draft_table(target, pdm, ids, y)
        accs, st = score_prompt(table, y, ids, n, policies, probe)
        groups = [pr.dataset, "overall"] + ([] if loops(ids, y) else ["non-looping"])
        branch_runs = score_branches(table, y, ids, n, branch_choosers, branch_policies)
        for g in groups:
            for name, r in branch_runs.items():
                per_branch.setdefault(g, {}).setdefault(name, []).append(r)
            for name, a in accs.items():
                per.setdefault(g, {}).setdefault(name, []).append(a)
            stats.setdefault(g, StateStats()).merge(st)
        print(f"[{i + 1}/{len(prompts)}] {pr.dataset}#{pr.index}: pdm alpha "
              f"{accs['pdm'].accepted / max(1, accs['pdm'].verified):.3f}", file=sys.stderr, flush=True)
    report = {"n": n, "head": ecfg.drafting.pdm, "max_new_tokens": args.max_new_tokens,
              "groups": {g: {name: _pooled(a, n) for name, a in pol.items()} for g, pol in per.items()},
              "states": {g: {str(f): row for f, row in sorted(s.by_fill.items())} | {"all": s.total()}
                         for g, s in stats.items()},
              "state_columns": ["count", "top1", "top2", "top4", "suffix_proposes", "suffix_correct"],
              "branches": {g: {name: branch_pooled(r, n) for name, r in pol.items()} for g, pol in per_branch.items()}}
    _print(report, file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        write_json(args.json, report)
    return 0


def _print(report: dict, file=sys.stdout) -> None:
    groups = list(report["groups"])
    print = functools.partial(builtins.print, file=file)  # noqa: A001
    print("policy".ljust(24) + "".join(f"{g:>22}" for g in groups))
    for name in POLICY_GRID:
        cells = []
        for g in groups:
            r = report["groups"][g].get(name)
            cells.append(f"{r['alpha']:.3f} / {r['eal']:.3f} ({r['prompts']})".rjust(22) if r and r["alpha"] else " " * 22)
        print(name.ljust(24) + "".join(cells))
    print("(alpha / pooled EAL (prompts))")
    for name in next(iter(report["branches"].values()), {}):
        cells = []
        for g in groups:
            r = report["branches"].get(g, {}).get(name)
            cells.append(f"{r['alpha']:.3f} / {r['eal']:.3f} x{r['tokens_per_step']:.2f}".rjust(22)
                         if r and r["alpha"] else " " * 22)
        print(name.ljust(24) + "".join(cells))
    if report["branches"]:
        print("(branch width W: alpha / pooled EAL x stage tokens per step)")
    print("draft states of the pdm-only driver, per fill: count, PDM top-1/2/4 recall, suffix coverage, precision")
    for g, by in report["states"].items():
        for f, (c, t1, t2, t4, sp, sc) in by.items():
            print(f"  {g:>12} fill {f:>3}: {c:6d}  {t1 / c:.3f} {t2 / c:.3f} {t4 / c:.3f}  "
                  f"{sp / c:.3f} {sc / sp if sp else float('nan'):.3f}")

