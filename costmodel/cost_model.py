"""Cost model: predict SPD tick time, decode tokens/s and speedup, and the resource-matched
alternatives (tensor parallel, plain pipeline parallel, TP-inside-node x SPD hybrids), from
measured inputs, and pick the best per device count. Pure arithmetic: no torch, no
torch.distributed. Times are milliseconds.

By concern: costmodel/cost_inputs.py (profile, links, acceptance, wire sizes), costmodel/cost_model_spd.py
(the SPD tick as a timed event graph, simulated on engine/protocol/tick.py's tick protocol),
costmodel/cost_alternatives.py (AR, PP, TP per token), costmodel/cost_partitions.py (stage splits);
this file is the plan over all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

from spd_engine.costmodel.cost_alternatives import (
    ar_token_ms,
    pp_token_ms,
    tp_reduce_ms,
    tp_shard_layer_ms,
    tp_token_ms,
    vocab_parallel_head_ms,
)
from spd_engine.costmodel.cost_inputs import AlphaCurve, LinkModel, Profile, note
from spd_engine.costmodel.cost_model_spd import build_spd_case, predict_spd, verifies_on_last
from spd_engine.costmodel.cost_partitions import balanced_partition, stage_times
from spd_engine.engine.protocol.topology import default_stage_layers


@dataclass(frozen=True)
class Links:
    """Link classes and device placement: devices 0..D-1 fill nodes of `gpus_per_node` in order."""

    intra: LinkModel
    inter: LinkModel | None = None
    gpus_per_node: int | None = None

    def between_nodes(self, node_a: int, node_b: int) -> LinkModel:
        return self.intra if node_a == node_b or self.inter is None else self.inter

    def of_devices(self, a: int, b: int) -> LinkModel:
        if self.gpus_per_node is None:
            return self.intra
        return self.between_nodes(a // self.gpus_per_node, b // self.gpus_per_node)


def _spd_row(profile: Profile, stage_ms: list[float], counts: list[int] | None, n: int, alpha: float,
             colocate: bool, link_of, label: str, devices: int, notes: list[str], sim_tokens: int, seed: int,
             verify_at: str, verify_ms: float | None = None) -> dict:
    """One SPD row; `verify_ms`: the head's time where it runs (default the profile's)."""
    verify = profile.verify_ms if verify_ms is None else verify_ms
    case = build_spd_case(stage_ms, profile.driver_work_for(n, notes), verify, alpha, colocate,
                          profile.hidden, profile.dtype_bytes, profile.anchors, link_of,
                          verify_on_last=verifies_on_last(verify_at, colocate))
    pred = predict_spd(case, sim_tokens, seed)
    return {"method": "spd", "n": n, "devices": devices, "layout": "coloc" if colocate else "sep",
            "partition": label, "stage_layers": counts, "stage_ms": [round(c, 4) for c in stage_ms],
            "alpha": alpha, **pred}


def plan(profile: Profile, links: Links, alpha: AlphaCurve, ns: list[int], sim_tokens: int = 1000,
         seed: int = 0, verify_at: str = "auto") -> dict:
    """Predictions for SPD (separate / co-located driver, even / balanced split), PP, TP and
    TP x SPD hybrids at every n, with the best method per device count. `verify_at`: where SPD
    rows verify at T=0, as the runtime's --verify-at (costmodel/cost_model_spd.py verifies_on_last)."""
    verifies_on_last(verify_at, False)  # a bad choice fails here, before any row
    notes: list[str] = []
    if links.intra.assumed or (links.inter is not None and links.inter.assumed):
        note(notes, "ASSUMPTION: some link numbers are assumed, not measured (see links)")
    ar_ms = ar_token_ms(profile)
    rows: list[dict] = []
    for n in ns:
        if n > profile.num_layers:
            continue
        a = alpha(n, notes)
        for colocate in (False, True):
            devices = n if colocate else n + 1
            link_of = links.of_devices  # devices: driver 0, stage p on p (co-located) or p + 1
            if n in profile.stage_ms:
                rows.append(_spd_row(profile, list(profile.stage_ms[n]), None, n, a, colocate, link_of,
                                     "measured", devices, notes, sim_tokens, seed, verify_at))
                continue
            even = default_stage_layers(profile.num_layers, n)
            extra = _stage_extra_ms(profile, n, colocate, verifies_on_last(verify_at, colocate), notes)
            bal = balanced_partition(profile.layer_ms, n, extra)
            worst = lambda counts: max(t + e for t, e in zip(stage_times(profile, counts), extra))  # noqa: E731
            for label, counts in (("even", even), ("balanced", bal)):
                if label == "balanced" and worst(bal) >= worst(even) - 1e-9:
                    continue  # no better than the default split
                rows.append(_spd_row(profile, stage_times(profile, counts), counts, n, a, colocate, link_of,
                                     label, devices, notes, sim_tokens, seed, verify_at))
        rows.append(_pp_row(profile, n, links))
        spans = links.gpus_per_node is not None and n > links.gpus_per_node and links.inter is not None
        tp, comm = tp_token_ms(profile, n, links.inter if spans else links.intra, notes)
        rows.append({"method": "tp", "n": n, "devices": n, "layout": "across nodes" if spans else "one node",
                     "partition": "-", "token_ms": tp, "tok_s": 1e3 / tp, "comm_ms": comm})
        rows.extend(_hybrid_rows(profile, links, n, alpha, notes, sim_tokens, seed, verify_at))
    for r in rows:
        r["speedup_vs_ar"] = ar_ms / r["token_ms"]
    return {"profile": profile.name, "ar_token_ms": ar_ms, "ar_tok_s": 1e3 / ar_ms, "rows": rows,
            "verify_at": verify_at,
            "best_by_devices": _best_by_devices(rows), "notes": notes,
            "links": {"intra": _link_label(links.intra), "inter": links.inter and _link_label(links.inter),
                      "gpus_per_node": links.gpus_per_node}}


def _stage_extra_ms(profile: Profile, n: int, colocate: bool, verify_on_last: bool, notes: list[str]) -> list[float]:
    """Per-stage work besides the stage's layers, what a balanced split evens out: the driver's
    on stage 0's device when co-located (PDM and host work, + the head where the driver
    verifies), the head on the last stage where it verifies."""
    extra = [0.0] * n
    if colocate:
        extra[0] = profile.driver_work_for(n, notes) + (0.0 if verify_on_last else profile.verify_ms)
    if verify_on_last:
        extra[-1] += profile.verify_ms
    return extra


def _pp_row(profile: Profile, n: int, links: Links) -> dict:
    """Plain pipeline parallel at n. Stage times, best first: measured in a pp run (head included;
    stages that idle between tokens can compute slower than SPD's busy ones, as on a CPU host),
    measured in an SPD run (+ verify for the head), or the stages' share of the layers."""
    counts = None
    if n in profile.pp_stage_ms:
        stages, head, label = list(profile.pp_stage_ms[n]), 0.0, "measured (pp)"
    elif n in profile.stage_ms:
        stages, head, label = list(profile.stage_ms[n]), profile.verify_ms, "measured"
    else:
        counts = default_stage_layers(profile.num_layers, n)
        stages, head, label = stage_times(profile, counts), profile.verify_ms, "even"
    pp = pp_token_ms(profile, stages, links.of_devices, head)
    return {"method": "pp", "n": n, "devices": n, "layout": "-", "partition": label, "stage_layers": counts,
            "stage_ms": [round(c, 4) for c in stages], "token_ms": pp, "tok_s": 1e3 / pp}


def _link_label(link: LinkModel) -> str:
    return link.name + (" (assumed)" if link.assumed else "")


def _hybrid_rows(profile: Profile, links: Links, n: int, alpha: AlphaCurve, notes: list[str], sim_tokens: int,
                 seed: int, verify_at: str) -> list[dict]:
    """g-way TP inside a node, s = n / g SPD stages across nodes (stage group p on node p);
    acceptance is that of an s-stage pipeline. A verifying last stage group runs the head
    vocab-parallel over its g ranks (docs/design.md 3.9); the driver's head is unsharded."""
    rows = []
    for g in (2, 4, 8, 16):
        s = n // g
        if n % g or s < 2 or (links.gpus_per_node is not None and g > links.gpus_per_node):
            continue
        shard = tp_shard_layer_ms(profile, g, notes)
        per_layer_ar = 2 * tp_reduce_ms(profile, g, links.intra, notes)
        counts = default_stage_layers(profile.num_layers, s)
        stage_ms = stage_times(profile, counts, shard, per_layer_ar)
        for colocate in (False, True):
            head = vocab_parallel_head_ms(profile, g, links.intra, notes) if verifies_on_last(verify_at, colocate) \
                else profile.verify_ms
            row = _spd_row(profile, stage_ms, counts, s, alpha(s, notes), colocate, _group_links(links, colocate),
                           "even", g * s + (0 if colocate else 1), notes, sim_tokens, seed, verify_at, head)
            row.update(method=f"tp{g}xspd", n=n, spd_stages=s, tp=g)
            rows.append(row)
    return rows


def _group_links(links: Links, colocate: bool):
    """link_of for hybrids: stage group p sits on node p; a separate driver shares node 0."""
    def node(device: int) -> int:
        return device if colocate else max(0, device - 1)

    return lambda a, b: links.between_nodes(node(a), node(b))


def _best_by_devices(rows: list[dict]) -> dict[int, dict]:
    best: dict[int, dict] = {}
    for r in rows:
        d = r["devices"]
        if d not in best or r["tok_s"] > best[d]["tok_s"]:
            best[d] = {"method": r["method"], "layout": r.get("layout"), "partition": r.get("partition"),
                       "tok_s": r["tok_s"], "n": r["n"]}
    return dict(sorted(best.items()))


def recommendation(result: dict) -> list[str]:
    """Plain statements from the numbers: the fastest setup, who wins on the same devices, why."""
    rows = result["rows"]
    top = max(rows, key=lambda r: r["tok_s"])
    lines = [f"fastest overall: {_label(top)} on {top['devices']} devices, {top['tok_s']:.1f} tok/s "
             f"({top['speedup_vs_ar']:.2f}x one-device autoregressive)"]
    wins: dict[str, list[int]] = {}
    for n in sorted({r["n"] for r in rows}):
        same = [r for r in rows if r["devices"] == n]  # resource-matched: exactly n devices
        if same:
            best = max(same, key=lambda r: r["tok_s"])
            who = {"spd": "SPD", "pp": "PP", "tp": "TP"}.get(best["method"], "TP x SPD (hybrid)")
            wins.setdefault(who, []).append(n)
    lines += [f"on the same n devices, {who} is fastest for n = {_ranges(ns)}" for who, ns in wins.items()]
    for n in (min(r["n"] for r in rows), max(r["n"] for r in rows)):
        tp = next((r for r in rows if r["method"] == "tp" and r["n"] == n), None)
        spd = max((r for r in rows if r["method"] == "spd" and r["layout"] == "coloc" and r["n"] == n),
                  key=lambda r: r["tok_s"], default=None)
        if tp and spd:
            lines.append(f"n={n}: TP {tp['token_ms']:.3f} ms/token (all-reduces {tp['comm_ms']:.3f} ms of it); "
                         f"SPD co-located {spd['token_ms']:.3f} ms/token = tick {spd['tick_ms']:.3f} ms x n / EAL "
                         f"{spd['eal']:.2f}, bound by {spd['critical'].split(' (')[0]}")
    lines.append("SPD pays one small hop per stage per tick and hides it behind stage compute; TP pays two "
                 "all-reduces per layer per token: slow or high-latency links favour SPD, fast links favour TP")
    return lines


def _label(r: dict) -> str:
    if r["method"] == "spd":
        return f"SPD n={r['n']} ({r['layout']}, {r['partition']})"
    if r["method"].endswith("xspd"):
        return f"TP{r['tp']} x SPD{r['spd_stages']} ({r['layout']})"
    return f"{r['method'].upper()} n={r['n']}"


def _ranges(xs: list[int]) -> str:
    xs = sorted(xs)
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


# ---------------------------------------------------------------- validation against the tick replay
