"""The report's summary (pass / fail / not run over every item) and its markdown rendering
(OUT/gpu-check.md)."""
from __future__ import annotations

from spd_engine.bench.device_check.check_env import label


def summary(report: dict) -> dict:
    """Pass / fail / not run counts over every checked item."""
    statuses = [c["status"] for c in report["lossless"]["cases"]]
    s = report["lossless"]["sampling"]
    statuses += [s.get("sampling_twice", s).get("status", "error"), s.get("branch_width_2", s).get("status", "error")]
    statuses += [v["status"] for v in report["training"].values()]
    t = report["timings"]
    for item in (t["anchor_gather"], t["syncs_per_tick"], *t["shapes"].values()):
        statuses.append((item or {}).get("status", "error"))
    failed = [x for x in statuses if x.startswith(("fail", "error"))]
    skipped = [x for x in statuses if x.startswith(("skipped", "not run"))]
    return {"items": len(statuses), "failed": len(failed), "not_run": len(skipped),
            "passed_or_measured": len(statuses) - len(failed) - len(skipped), "ok": not failed}


def _f(x, fmt: str = ".3f") -> str:
    return "-" if x is None else (format(x, fmt) if isinstance(x, (int, float)) else str(x))


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# spd gpu-check ({report['mode']})", "", f"Every figure: {label(env)}; {env['date_utc']}.", ""]
    s = report["summary"]
    lines += [f"Items: {s['items']}, passed or measured {s['passed_or_measured']}, failed {s['failed']}, "
              f"not run {s['not_run']}; {s['seconds']} s.", "", "## Lossless (SPD against greedy through the "
              "same steps on the same device)", "", "| shape | layers | n | steps | dtype | status | forced accepted "
              "| graphs captured | s |", "|---|---|---|---|---|---|---|---|---|"]
    for c in report["lossless"]["cases"]:
        k = c["case"]
        lines.append(f"| {k['shape']} | {k['layers'] or 'all'} | {k['n']} | {k['step_mode']} | {k['dtype']} | "
                     f"{c['status']}{' ' + c.get('error', c.get('why', '')) if c['status'] != 'pass' else ''} | "
                     f"{_f(c.get('forced_accepted'), 'd')} | "
                     f"{_f(c.get('graphed'), 'd')}/{_f(c.get('step_graphs'), 'd')} "
                     f"| {_f(c.get('seconds'), '.1f')} |")
    smp = report["lossless"]["sampling"]
    lines += ["", f"T > 0 keyed sampling twice: {smp.get('sampling_twice', smp).get('status')}; branch width 2: "
              f"{smp.get('branch_width_2', smp).get('status')}.", "", "## Timings (ms, medians)", ""]
    t = report["timings"]
    lines.append(f"One host sync: {_f(t['host_sync_us'], '.1f')} us; host syncs per decode tick: "
                 f"{_f((t['syncs_per_tick'] or {}).get('per_tick'), '.2f')} "
                 f"({(t['syncs_per_tick'] or {}).get('status')}).")
    lines += ["", "| shape | AR eager | AR graph | verify eager | verify graph | n | max stage eager | max stage graph "
              "| PDM eager | PDM graph |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape, v in t["shapes"].items():
        if v.get("status") != "measured":
            lines.append(f"| {shape} | {v.get('status')} {v.get('error', '')} |||||||||")
            continue
        raw = v["raw"]
        for n, st in raw["stage_ms"].items():
            p = raw["pdm_ms"][n]
            lines.append(f"| {shape} | {_f(raw['ar_ms']['eager'])} | {_f(raw['ar_ms']['graphed'])} | "
                         f"{_f(raw['verify_ms']['eager'])} | {_f(raw['verify_ms']['graphed'])} | {n} | "
                         f"{_f(max(st['eager']))} | {_f(max(st['graphed']) if st['graphed'] else None)} | "
                         f"{_f(p['eager'])} | {_f(p['graphed'])} |")
    lines += ["", "PDM step by K (n + 1 rows):", ""]
    for shape, v in t["pdm_k"].items():
        ms = v.get("ms", {})
        lines.append(f"- {shape} n={v.get('n')}: " + ", ".join(
            f"K={k} {_f(d['eager'])} eager / {_f(d['graphed'])} graph" for k, d in ms.items()) or v.get("status", ""))
    lines += ["", "Stage step carrying W tokens (eager):", ""]
    for shape, v in t["stage_width"].items():
        lines.append(f"- {shape}, {v.get('layers')} layers: " + ", ".join(
            f"W={w} {_f(ms)}" for w, ms in v.get("ms", {}).items()))
    ag = t["anchor_gather"] or {}
    lines += ["", f"Anchor gather ({ag.get('status')}):", ""]
    for shape, r in (ag.get("shapes") or {}).items():
        lines.append(f"- {shape} (H={r['hidden']}, {r['rows']} rows, {r['dtype']}): kernel "
                     f"{_f(r.get('kernel_eager_us'), '.1f')} us eager / "
                     f"{_f(r.get('kernel_graph_us'), '.1f')} us graph, "
                     f"torch reference {_f(r.get('torch_eager_us'), '.1f')} / {_f(r.get('torch_graph_us'), '.1f')} us; "
                     f"rel. err. {_f(r.get('rel_err_vs_torch'), '.1e')}")
    cpu_note = (" On the CPU the ranks' threads run on several cores at once, so the sum is no bound there and the "
                "dry run's shares mean nothing." if report["environment"]["device"] == "cpu" else "")
    lines += ["", "Co-located tick against its compute (all stages on one device, so compute = the sum of the "
              "steps)." + cpu_note, "", "| shape | n | steps | tick ms | compute ms | overhead ms | share of a stage |",
              "|---|---|---|---|---|---|---|"]
    for shape, ticks in t["colocated_tick"].items():
        for n, c in ticks.items():
            if "tick_ms" not in c:
                lines.append(f"| {shape} | {n} | {c.get('status')} |||||")
                continue
            lines.append(f"| {shape} | {n} | {c['step_mode']} | {c['tick_ms']:.3f} | {c['compute_ms']:.3f} | "
                         f"{c['overhead_ms']:.3f} | {c['overhead_share_of_stage']:.2f} |")
    lines += ["", "Profiles for `spd plan --profile`: " + ", ".join(
        f for files in t["profiles"].values() for f in files), ""]
    for shape, pl in t["plans"].items():
        lines += [f"`spd plan` on {shape}, ASSUMED link {pl['assumed_link']} (us, GB/s, all-reduce us), ASSUMED alpha "
                  f"{pl['assumed_alpha']}: tokens/s", "", "| profile | n | AR | PP | TP | SPD co-located | SPD separate |",
                  "|---|---|---|---|---|---|---|"]
        for which, res in pl["profiles"].items():
            for n, row in res["tok_s_by_n"].items():
                lines.append(f"| {which} | {n} | {_f(row.get('ar'), '.1f')} | {_f(row.get('pp'), '.1f')} | "
                             f"{_f(row.get('tp'), '.1f')} | {_f(row.get('spd_coloc'), '.1f')} | "
                             f"{_f(row.get('spd_sep'), '.1f')} |")
        lines.append("")
    lines += ["## Training", ""]
    for method, r in report["training"].items():
        losses = r.get("losses") or []
        lines.append(f"- {method}: {r['status']}{' ' + r.get('error', '') if r.get('error') else ''}; "
                     f"{r.get('dtype', '-')}, {r.get('steps', 0)} steps, loss {_f(losses[0] if losses else None)} -> "
                     f"{_f(losses[-1] if losses else None)}, {_f(r.get('tokens_per_s'), '.0f')} tokens/s")
    lines += ["", "## Not checked here", ""] + [f"- {x}" for x in report["not_checked"]]
    return "\n".join(lines) + "\n"
