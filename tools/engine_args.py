"""The run-config flags every engine command takes (model, topology, dtypes, kernels, draft sources,
the eagle baseline) and the RunConfig they make, refusing flags the run would ignore."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spd_engine.engine.comm.iface import use_iface
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.protocol.branching import WHEN
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.measured_split import BALANCED
from spd_engine.engine.runtime.run_config import (
    DEFAULT_BRANCHES,
    DEFAULT_SUFFIX_RUN,
    MODES,
    STEP_MODES,
    TRANSPORTS,
    VERIFY_AT,
    Drafting,
    Mode,
    ModelSpec,
    ParallelLayout,
    RunConfig,
    Runtime,
    random_preset,
)
from spd_engine.tools.cli_conventions import engine_dtype_name, refuse_ignored, resolve_dtype, run_default
from spd_engine.tools.measured_args import balanced_split, with_measured_layouts
from spd_engine.tools.model_args import carried_or_given, check_tokenizer, default_head, model_config, resolve_model


def add_engine_arguments(p: argparse.ArgumentParser, default_mode: str = "spd", mode_flags: bool = True,
                         branch_flags: bool = True) -> None:
    """The run-config flags; defaults are RunConfig's. mode_flags=False: the command picks mode and layout;
    branch_flags=False: the command scores branch widths itself (spd draft-policies)."""
    g = p.add_argument_group("model and topology")
    g.add_argument("--model", "--ckpt", "--load", dest="model", default="smollm2-135m",
                   help="built-in name, engine checkpoint dir, HF dir, GGUF file, model id in the local "
                        "Hugging Face cache (org/name[@revision]), or random:<preset> (--load: Megatron-LM's "
                        "spelling; a Megatron checkpoint is imported first: spd convert import-megatron)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the model's tokenizer: an HF tokenizer directory, a tokenizer.json, or a SentencePiece "
                        ".model (needs the sentencepiece package); default: the model's own, if it has one")
    g.add_argument("--spec", default=None,
                   help="PDM head directory (or a carried-head manifest's, built on first use), or 'random' "
                        "(default: the shipped head for the model and n, else an untrained one)")
    g.add_argument("--stages", "--pipeline-parallel-size", "--pipeline-model-parallel-size", "-pp", dest="stages",
                   type=int, default=4, help="pipeline stages n (vLLM's and Megatron's spellings accepted)")
    g.add_argument("--stage-layers", default=None,
                   help="explicit split, e.g. 8,8,7,7, or 'balanced': the split balancing the per-tick costs "
                        "`spd bench` measured for this model, n and device (default: even split)")
    g.add_argument("--tp", "--tensor-parallel-size", "--tensor-model-parallel-size", "-tp", dest="tp", type=int,
                   default=1, help="tensor-parallel ranks per stage T (must divide the heads and KV heads; world "
                                   "n*T (+1); vLLM's and Megatron's spellings accepted)")
    if mode_flags:
        g.add_argument("--mode", choices=MODES, default=default_mode,
                       help="spd, or a baseline: pp (pipeline-parallel autoregressive), tp (one stage over "
                            "--tp ranks, autoregressive), ar (one rank), eagle (serial draft-then-verify with an "
                            "EAGLE-3-style head, one rank)")
        g.add_argument("--colocate", action="store_true", help="driver on the same rank as stage 0 (world size n)")
    g.add_argument("--pdm-layers", type=int, default=run_default("drafting.pdm_layers"), help="K of an untrained head")
    g.add_argument("--capacity", "--max-model-len", dest="capacity", type=int, default=None,
                   help=f"KV cache positions per request: prompt + generated tokens (default "
                        f"min({run_default('runtime.capacity')}, the model's max positions))")
    g.add_argument("--prefill-chunk", type=int, default=run_default("runtime.prefill_chunk"),
                   help="prompt tokens per prefill message")
    g.add_argument("--timeout", type=float, default=run_default("runtime.timeout_s"), help="receive timeout inside a request (s)")
    g.add_argument("--stage-ms", default=None, metavar="MS[,MS...]",
                   help="synthetic decode step time per stage: each stage's step is padded with sleep to at least "
                        "this long (one value for every stage, or n values); stands in for a larger model's stages "
                        "(the tokens do not change)")
    g.add_argument("--threads", type=int, default=run_default("parallel.threads"),
                   help="torch threads per rank (default cores // ranks)")
    g.add_argument("--dtype", type=engine_dtype_name, default="auto", metavar="{auto,float32,bfloat16,float16}",
                   help="weights and activations: auto = bfloat16 on cuda, float32 elsewhere (aliases fp32, "
                        "bf16, fp16)")
    g.add_argument("--device", default=run_default("parallel.device"), help="cpu, cuda or cuda:N")
    g.add_argument("--backend", default=None, choices=["gloo", "nccl"],
                   help=f"default: nccl on cuda, else {run_default('parallel.backend')}")
    g.add_argument("--transport", default=run_default("parallel.transport"), choices=TRANSPORTS,
                   help="rank-to-rank messages: shm (shared-memory rings, CPU ranks of one host), gloo (the "
                        "backend), auto (shm for the CPU ranks this command launches, else the backend)")
    g.add_argument("--iface", default=None, metavar="NAME",
                   help="network interface the ranks' process group binds to across nodes (default: the one whose "
                        "route reaches the rendezvous address, unless GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME are set)")
    g.add_argument("--link-delay-us", type=float, default=run_default("parallel.link_delay_us"), metavar="US",
                   help="emulated link latency: every message between ranks (and each step of a TP collective) is "
                        "delivered this many microseconds after it was sent (default 0: none; for ranks of one host, "
                        "e.g. network-namespace nodes: docs/cluster.md)")
    g.add_argument("--seed", type=int, default=run_default("runtime.seed"), help="seed of random weights / untrained heads")
    g.add_argument("--step-mode", default=run_default("runtime.step_mode"), choices=STEP_MODES,
                   help="one-token decode steps: CUDA graphs (auto on cuda), eager (auto elsewhere; the "
                        "fallback), or static (the graph path's buffers without capture)")
    g.add_argument("--verify-at", default=run_default("parallel.verify_at"), choices=VERIFY_AT,
                   help="SPD at T=0: the target's argmax of the token leaving the pipeline is computed by the last "
                        "stage, which then holds the head too (last), or by the driver (driver); auto: last when "
                        "co-located (the driver's rank also runs stage 0), else driver")
    g.add_argument("--head-screen", choices=("on", "off"), default="on" if run_default("model.head_screen") else "off",
                   help="T=0 tokens of the head stage from an int8 screen of the LM head, the few candidate rows "
                        "recomputed in fp32 (same tokens; used where supported: a CPU, fp32 weights)")
    g.add_argument("--pdm-dtype", default=run_default("drafting.pdm_dtype"),
                   choices=("auto", "int8", "float32", "bfloat16", "float16"),
                   help="the PDM's dtype: int8 = its matmuls over int8 weight rows, bf16 activations; auto = int8 "
                        "for an fp32 run on a CPU with torch's int8 kernel, else bfloat16 on a CPU with bf16 matmul "
                        "instructions, else the run's (drafting only: the output does not change)")
    g.add_argument("--weight-layout", default=run_default("model.weight_layout"),
                   choices=("auto", "row", "col", "packed", "mixed"),
                   help="fp32 linear weights in memory (the same values, another kernel): row- or column-major, "
                        "packed (oneDNN's blocked weight: up to ~6 rows for one's price, one step over every thread), "
                        "mixed (packed, one row over a column-major copy; not batch-invariant: a request's rows round "
                        "otherwise in a batch); auto: on a CPU the layout `spd bench` measured fastest there for the "
                        "rank's threads (packed for mixed), else packed (col without oneDNN); row on a GPU")
    g.add_argument("--overlap-stage0", choices=("on", "off"), default="on" if run_default("parallel.overlap_stage0") else "off",
                   help="co-located (n >= 2): stage 0 steps on its own thread while the driver drafts and verifies")
    e = p.add_argument_group("eagle baseline (serial draft-then-verify on one rank)")
    e.add_argument("--eagle-head", default=None,
                   help="EAGLE head directory, or 'random' (default: the shipped head for the model, else an untrained one)")
    e.add_argument("--eagle-k", type=int, default=run_default("drafting.eagle_k"),
                   help="drafts per round, verified in one target pass of k+1 tokens")
    d = p.add_argument_group("draft sources")
    d.add_argument("--suffix-drafts", choices=("on", "off"), default="on" if run_default("drafting.suffix_drafts") else "off",
                   help="also draft the token that followed the longest earlier occurrence of the context's suffix")
    d.add_argument("--suffix-min-match", type=int, default=run_default("drafting.suffix_min_match"),
                   help="shortest suffix match (tokens) that may draft")
    d.add_argument("--suffix-pdm-margin", type=float, default=run_default("drafting.suffix_pdm_margin"),
                   help="a suffix draft wins only where the PDM's top-1 minus top-2 logit is below this")
    d.add_argument("--suffix-run", type=int, default=run_default("drafting.suffix_run"), metavar="K",
                   help="tokens a suffix draft may carry through the stages as one entry: the tokens after it in "
                        "the matched occurrence, verified together when they leave (docs/design.md 3.13); 1: none "
                        f"(default: {DEFAULT_SUFFIX_RUN} for SPD at n >= 2 with one chain and one TP rank, else 1)")
    if branch_flags:
        d.add_argument("--branches", type=int, default=None, metavar="W",
                       help=f"branch width: a draft position may carry up to W candidate chains (docs/design.md "
                            f"3.11; default {DEFAULT_BRANCHES})")
        d.add_argument("--branch-when", choices=WHEN, default=run_default("drafting.branch_when"),
                       help="where a branch point may start: after a rejection (refill) or whenever none is in flight")
    d.add_argument("--suffix-cross-request", choices=("on", "off"),
                   default="on" if run_default("drafting.suffix_cross_request") else "off",
                   help="suffix drafts also from this process's earlier requests (prompts and outputs)")


def _check_ignored_engine_flags(args: argparse.Namespace, mode: Mode, spec: str, seed_used: bool,
                                eagle_head: str | None) -> None:
    """eagle_head: the eagle baseline's head when the command runs it, else None."""
    seeds_head = (mode is Mode.SPD and spec == "random") or eagle_head == "random"
    if not seed_used and random_preset(args.model) is None and not seeds_head:
        refuse_ignored(args, ["seed"], "with real weights and a trained head or no head (it seeds random "
                                       "weights and untrained heads; --sampling-seed seeds sampling)")
    if eagle_head is None:
        refuse_ignored(args, ["eagle_head", "eagle_k"], "without the eagle baseline (--mode eagle)")
    if mode is Mode.EAGLE:
        refuse_ignored(args, ["step_mode"], "with --mode eagle (its steps run eagerly)")
    if mode is not Mode.SPD:
        refuse_ignored(args, ["spec", "pdm_layers", "colocate", "suffix_drafts", "suffix_min_match", "suffix_pdm_margin",
                                "suffix_cross_request", "suffix_run", "overlap_stage0", "branches", "branch_when"],
                       f"with --mode {mode} (no SPD speculation module)")
    elif hasattr(args, "colocate") and not args.colocate:
        refuse_ignored(args, ["overlap_stage0"], "without --colocate (stage 0 has a rank of its own)")
    if mode in (Mode.AR, Mode.EAGLE) and args.stages != 1:
        refuse_ignored(args, ["stages", "stage_layers"], f"with --mode {mode} (one rank runs the whole model)")
    if mode is Mode.TP and args.stages != 1:
        refuse_ignored(args, ["stages", "stage_layers"], "with --mode tp (one stage over the --tp ranks)")
    if spec != "random":
        refuse_ignored(args, ["pdm_layers"], f"with a trained head ({spec}: its K is in its pdm.json)")


def _stage_ms(text: str | None, n: int) -> tuple[float, ...] | None:
    """--stage-ms: one value for every stage or one per stage, finite and non-negative."""
    if text is None:
        return None
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--stage-ms takes milliseconds, one or {n} comma-separated, got {text!r}") from None
    if len(values) == 1:
        values *= n
    if len(values) != n or not all(0 <= v < float("inf") for v in values):
        raise ValueError(f"--stage-ms needs one or {n} finite non-negative values (milliseconds), got {text!r}")
    return values


def _model_spec(args: argparse.Namespace, engine_spec: str, cfg: ModelConfig) -> ModelSpec:
    return ModelSpec(source=engine_spec, cfg=cfg, dtype=resolve_dtype(args.dtype, args.device),
                     head_screen=getattr(args, "head_screen", "on") == "on",
                     weight_layout=getattr(args, "weight_layout", run_default("model.weight_layout")))


def _parallel(args: argparse.Namespace, topo: Topology, backend: str) -> ParallelLayout:
    return ParallelLayout(topology=topo, device=args.device, backend=backend, transport=args.transport,
                          link_delay_us=args.link_delay_us, threads=args.threads, verify_at=args.verify_at,
                          overlap_stage0=args.overlap_stage0 == "on")


def _drafting(args: argparse.Namespace, spec: str, eagle_head: str) -> Drafting:
    """The draft settings; a command without the branch flags (spd draft-policies) gets the defaults."""
    return Drafting(pdm=spec, pdm_layers=args.pdm_layers, pdm_dtype=getattr(args, "pdm_dtype", run_default("drafting.pdm_dtype")),
                    suffix_drafts=args.suffix_drafts == "on", suffix_min_match=args.suffix_min_match,
                    suffix_pdm_margin=args.suffix_pdm_margin, suffix_cross_request=args.suffix_cross_request == "on",
                    suffix_run=getattr(args, "suffix_run", run_default("drafting.suffix_run")),
                    branches=getattr(args, "branches", None),
                    branch_when=getattr(args, "branch_when", run_default("drafting.branch_when")),
                    eagle_head=eagle_head, eagle_k=args.eagle_k)


def _runtime(args: argparse.Namespace, cfg: ModelConfig, n: int) -> Runtime:
    return Runtime(capacity=args.capacity or min(run_default("runtime.capacity"), cfg.max_position),
                   prefill_chunk=args.prefill_chunk, timeout_s=args.timeout, seed=args.seed, step_mode=args.step_mode,
                   stage_ms=_stage_ms(getattr(args, "stage_ms", None), n))


def engine_config(args: argparse.Namespace, seed_used: bool = False, eagle_used: bool = False
                  ) -> tuple[RunConfig, Path | None]:
    """The RunConfig of the engine flags (and the tokenizer directory); `seed_used`: the command reads
    --seed for something else too, so it is never an ignored flag; `eagle_used`: the command runs
    the eagle baseline beside the mode's run (its flags are not ignored)."""
    mode = Mode.parse(getattr(args, "mode", "spd"))
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    use_iface(getattr(args, "iface", None))  # checked here, read when the ranks join (engine/comm/dist.py)
    engine_spec, tok_dir = resolve_model(args.model)
    cfg = model_config(engine_spec)
    if getattr(args, "tokenizer", None) is not None:  # loaded once here: a bad one fails before any rank starts
        tok_dir = check_tokenizer(args.tokenizer, cfg)
    n = 1 if mode.one_stage else args.stages
    balanced = args.stage_layers == BALANCED
    given = None if balanced else args.stage_layers
    topo = Topology.build(cfg.num_layers, n=None if given else n, stage_layers=given,
                          colocate=getattr(args, "colocate", False), tp=args.tp)
    spec = carried_or_given(args.spec, args.model) if args.spec else default_head(args.model, topo.n)
    eagle_head = args.eagle_head or default_head(args.model, 1, "eagle")
    _check_ignored_engine_flags(args, mode, spec, seed_used, eagle_head if eagle_used or mode is Mode.EAGLE else None)
    backend = args.backend or ("nccl" if str(args.device).startswith("cuda") else run_default("parallel.backend"))
    ecfg = RunConfig(model=_model_spec(args, engine_spec, cfg), parallel=_parallel(args, topo, backend), mode=mode,
                     drafting=_drafting(args, spec, eagle_head), runtime=_runtime(args, cfg, topo.n))
    ecfg = with_measured_layouts(ecfg)
    if balanced and topo.n > 1:
        ecfg, why = (balanced_split(ecfg, topo.colocate) if mode is Mode.SPD else
                     (ecfg, f"splits are measured for SPD runs: the even split {list(topo.stage_layers)}"))
        where = "driver co-located with stage 0" if topo.colocate else "driver on a rank of its own"
        print(f"--stage-layers balanced ({where}): {why}", file=sys.stderr)
    return ecfg, tok_dir
