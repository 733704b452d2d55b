"""The GPU window's summary (what passed, how long each part took) and its markdown (OUT/gpu-window.md)."""
from __future__ import annotations

from spd_engine.bench.device_check.check_env import label


def phases(report: dict) -> dict[str, float | None]:
    """Seconds of each part of the window, in the order they ran."""
    out = {"check": report["check"].get("seconds"), "target": report["target"].get("seconds"),
           "corpus": report["corpus"].get("seconds")}
    for name, r in report["training"].items():
        if isinstance(r, dict):
            out[f"train {name}"] = r.get("seconds")
    out["evaluation"] = report["evaluation"].get("seconds")
    out["outputs"] = report["outputs"].get("seconds")
    return out


def summary(report: dict, seconds: float, after_check_s: float) -> dict:
    runs = {k: v for k, v in report["training"].items() if isinstance(v, dict)}
    bad = [k for k, v in runs.items() if v.get("status") in ("fail", "error")]
    bad += [k for k, v in report["evaluation"].get("heads", {}).items() if v.get("status") == "error"]
    if "error" in report["training"] and not isinstance(report["training"]["error"], dict):
        bad.append("training")
    ok = report["check"]["status"] in ("pass", "not run (--no-check)") and report["target"]["status"] == "pass" \
        and not bad
    budget = report["plan"]["budget_s"]
    return {"ok": ok, "failed": bad, "trained": [k for k, v in runs.items() if v.get("status") == "pass"],
            "guard_stopped": [k for k, v in runs.items() if v.get("stopped_by") == "guard"],
            "tokens": sum(v.get("tokens", 0) for v in runs.values()), "seconds": round(seconds, 1),
            "seconds_after_check": round(after_check_s, 1), "budget_s": budget, "within_budget": seconds <= budget,
            "phases": phases(report)}


def _f(x, fmt: str = ".3f") -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    return "-" if x is None else (format(x, fmt) if isinstance(x, (int, float)) else str(x))


def window_markdown(report: dict) -> str:
    s, env = report["summary"], report["environment"]
    lines = [f"# spd gpu-check --window ({report['mode']})", "", f"Every figure: {label(env)}; {env['date_utc']}.", "",
             f"{'OK' if s['ok'] else 'NOT OK'}: {s['seconds']} s of a {s['budget_s']:.0f} s budget; "
             f"{s['tokens']:,} training tokens; trained {', '.join(s['trained']) or 'nothing'}"
             f"{'; failed ' + ', '.join(s['failed']) if s['failed'] else ''}"
             f"{'; stopped by the time guard: ' + ', '.join(s['guard_stopped']) if s['guard_stopped'] else ''}.", "",
             "| part | s |", "|---|---|"] + [f"| {k} | {_f(v, '.1f')} |" for k, v in s["phases"].items()]
    c, t = report["check"], report["target"]
    lines += ["", f"GPU check: {c['status']} {c.get('summary', c.get('error', ''))}",
              f"Target: {t['status']} {t.get('gguf', t.get('model', ''))} {t.get('error', '')}"]
    corpus = report["corpus"]
    if corpus:
        lines.append(f"Corpus: {corpus.get('path')}, {corpus.get('train_tokens'):,} training tokens, "
                     f"{corpus.get('holdout_tokens'):,} held out; self-distillation: "
                     f"{corpus.get('self_distill', {}).get('status')}")
    lines += ["", "## Training", "", "| head | n | K | from | steps | stopped by | tokens | s | tokens/s | loss |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["training"].items():
        if not isinstance(r, dict) or r.get("status") != "pass":
            lines.append(f"| {name} | {r if not isinstance(r, dict) else r.get('status')} "
                         f"{r.get('error', '') if isinstance(r, dict) else ''} |||||||||")
            continue
        lines.append(f"| {name} | {len(r['stage_layers'])} | {r['pdm_layers']} | {r['init_head'] or 'target layers'} | "
                     f"{r['steps']} | {r['stopped_by']} | {r['tokens']:,} | {r['seconds']} | "
                     f"{_f(r['tokens_per_s'], '.0f')} | "
                     f"{_f(r['loss_first'])} -> {_f(r['loss_last'])} |")
    ev = report["evaluation"]
    lines += ["", f"## Evaluation on the device ({ev.get('sequences', 0)} held-out sequences; top-1 agreement "
              "with the target, weighted by fill)", "", "| head | start | trained | better |", "|---|---|---|---|"]
    for name, r in ev.get("heads", {}).items():
        lines.append(f"| {name} | {_f(r.get('agree_start'), '.4f')} | {_f(r.get('agree_trained'), '.4f')} | "
                     f"{_f(r.get('better_than_start'))} {r.get('error', '') if r['status'] != 'measured' else ''} |")
    o = report["outputs"]
    left = f"; left out: {', '.join(o['left_out'])}" if o["left_out"] else ""
    lines += ["", f"Files: {', '.join(o['files'])} ({o['bytes'] / 2**20:.1f} MiB; rejoin with "
              f"`cat gpu-window-files.tar.* | tar x`){left}."]
    return "\n".join(lines) + "\n"
