"""The two-node comparison at emulated links (docs/results/two-node-links.md).

ar on one node, then pp, tp and SPD (co-located, and with a driver rank of its own) with their
ranks spread over two network-namespace nodes (tests/multinode/nodes.py), at each link setting:
tc's token bucket at a rate on both ends of the veth pair (none: the veth as it is) plus the
engine's --link-delay-us on every message between the nodes. Every row is one `spd generate`
(under torchrun on both nodes; ar plainly on node 0) of the same prompt, its tokens checked
against ar's of the same link setting. Needs root. Prints a markdown table and writes the rows
as JSON:

    .venv/bin/python tests/multinode/two_node_links.py --out runs/two-node-links.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nodes import Nodes, namespaces_unusable  # noqa: E402

from spd_engine.engine.comm.iface import GLOO_ENV, IFACE_ENV, NCCL_ENV  # noqa: E402
from spd_engine.engine.runtime.launch import spd_script  # noqa: E402

# (label, tc rate or None, --link-delay-us): what a veth pair on a 2-core host can stand in for
LINKS = (("veth as it is", None, 0.0), ("400 Mbit/s + 50 us", "400mbit", 50.0),
         ("100 Mbit/s + 200 us", "100mbit", 200.0))
# row -> (ranks on node 0, ranks on node 1), its flags; torchrun places ranks 0.. on node 0
ROWS = {
    "pp": ((2, 2), ["--mode", "pp", "--stages", "4"]),
    "tp": ((2, 1), ["--mode", "tp", "--stages", "1", "--tp", "3"]),  # SmolLM2's 3 KV heads: T = 3 (--tp)
    "spd-colocate": ((2, 2), ["--stages", "4", "--colocate"]),
    "spd": ((3, 2), ["--stages", "4"]),  # the driver on rank 0 of its own
}


def set_tp(tp: int) -> None:
    """The tp row over `tp` ranks, the first half (rounded up) on node 0."""
    ROWS["tp"] = (((tp + 1) // 2, tp // 2), ["--mode", "tp", "--stages", "1", "--tp", str(tp)])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (GLOO_ENV, NCCL_ENV, IFACE_ENV)}
    return {**env, "OMP_NUM_THREADS": "1"}


def _run(nodes: Nodes, name: str, common: list[str], delay_us: float, port: int, work: Path) -> dict:
    """One row: `spd generate` with the row's flags; its JSON record (rank 0's) and wall time."""
    out = work / f"{name}-{port}.json"
    args = [*common, "--json", str(out)]
    if name == "ar":
        cmd = [sys.executable, spd_script(), "generate", *args, "--mode", "ar", "--stages", "1"]
        procs = [nodes.popen(0, cmd, env=_env(), cwd=work)]
    else:
        split, flags = ROWS[name]
        flags = [*flags, "--link-delay-us", str(delay_us)] if delay_us else flags
        procs = []
        for node, nproc in enumerate(split):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
                   "--node-rank", str(node), "--master-addr", nodes.addrs[0], "--master-port", str(port),
                   spd_script(), "generate", *args, *flags]
            procs.append(nodes.popen(node, cmd, env=_env(), cwd=work))
    t0 = time.monotonic()
    for p in procs:
        _, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"{name} failed ({p.returncode}): {err[-3000:]}")
    record = json.loads(out.read_text().splitlines()[0])
    return {**record, "wall_s": time.monotonic() - t0}


def _row(name: str, link: tuple, rec: dict, ar: dict) -> dict:
    b = rec["breakdown_ms_per_tick"]
    ticks, tokens = max(1, rec["ticks"]), max(1, rec["decode_tokens"])
    tp_ms = sum(v for k, v in b.items() if k.endswith("_tp_collective_ms")) * ticks / tokens
    return {"link": link[0], "rate": link[1], "delay_us": link[2], "config": name,
            "ranks": sum(ROWS[name][0]) if name in ROWS else 1, "tok_s": rec["decode_tok_s"],
            "ms_per_token": 1e3 * rec["decode_s"] / tokens, "ticks": rec["ticks"], "alpha": rec["alpha"],
            "tp_collective_ms_per_token": tp_ms, "lossless": rec["token_ids"] == ar["token_ids"],
            "token_ids": rec["token_ids"]}


def markdown_table(rows: list[dict]) -> str:
    """Per link and config: the median tok/s over repeats (min-max), ms/token, the ratios of the
    medians, the TP collectives' share, and whether every repeat was lossless."""
    from statistics import median

    keys = list(dict.fromkeys((r["link"], r["config"]) for r in rows))
    group = {k: [r for r in rows if (r["link"], r["config"]) == k] for k in keys}
    tok_s = {k: median(r["tok_s"] for r in g) for k, g in group.items()}
    lines = ["| link | config | ranks | tok/s median (min-max) | ms/token | x ar | x tp | x pp | "
             "TP collectives ms/token | alpha | lossless |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (link, name), g in group.items():
        ratio = lambda base: f"{tok_s[(link, name)] / tok_s[(link, base)]:.2f}" if (link, base) in tok_s else "-"  # noqa: E731
        lo, hi = min(r["tok_s"] for r in g), max(r["tok_s"] for r in g)
        lines.append(f"| {link} | {name} | {g[0]['ranks']} | {tok_s[(link, name)]:.2f} ({lo:.2f}-{hi:.2f}) | "
                     f"{1e3 / tok_s[(link, name)]:.0f} | {ratio('ar')} | {ratio('tp')} | {ratio('pp')} | "
                     f"{median(r['tp_collective_ms_per_token'] for r in g):.0f} | "
                     f"{median(r['alpha'] for r in g):.2f} | {all(r['lossless'] for r in g)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", default="The history of the printing press begins")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--configs", default="pp,tp,spd-colocate,spd")
    p.add_argument("--tp", type=int, default=3, help="the tp row's ranks (must divide the model's KV heads)")
    p.add_argument("--repeats", type=int, default=2, help="runs of every row per link setting")
    p.add_argument("--links", default="0,1,2", help=f"which of the link settings, by index: {LINKS}")
    p.add_argument("--out", default="runs/two-node-links.json")
    args = p.parse_args(argv)
    set_tp(args.tp)
    why = namespaces_unusable()
    if why:
        print(f"two_node_links: {why}", file=sys.stderr)
        return 2
    common = ["--model", args.model, "--threads", "1", "--timeout", "120", "--max-new-tokens",
              str(args.max_new_tokens), "--ignore-eos", "--quiet", "--prompt", args.prompt]
    rows, port = [], 29600
    nodes = Nodes(2)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for link in (LINKS[int(i)] for i in args.links.split(",")):
                if link[1] is not None:
                    for node in (0, 1):
                        nodes.shape(node, link[1])
                for repeat in range(args.repeats):  # every row once, then again: the host's load drifts
                    ar = _run(nodes, "ar", common, 0.0, port, Path(tmp))
                    rows.append({**_row("ar", link, ar, ar), "repeat": repeat})
                    for name in args.configs.split(","):
                        port += 1
                        rec = _run(nodes, name, common, link[2], port, Path(tmp))
                        rows.append({**_row(name, link, rec, ar), "repeat": repeat})
                        print(json.dumps({k: v for k, v in rows[-1].items() if k != "token_ids"}), file=sys.stderr,
                              flush=True)
    finally:
        nodes.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp_out = Path(args.out).with_suffix(".tmp")
    tmp_out.write_text(json.dumps({"model": args.model, "prompt": args.prompt, "max_new_tokens": args.max_new_tokens,
                                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, indent=1))
    tmp_out.replace(args.out)
    print(markdown_table(rows))
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
