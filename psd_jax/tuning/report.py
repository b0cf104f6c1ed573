"""The tuner's outputs: ``tune.json``, ``tune.md`` (frontier and candidate tables) and ``frontier.png``."""

from __future__ import annotations

import json
from pathlib import Path

from ..cli.bench import pareto_plot
from .search import SearchResult


def _points(x: float) -> str:
    return f"{100 * x:+.1f}"


def _cost(s: dict) -> str:
    """The objective's cost per prompt: seconds (ms) or model calls."""
    if s.get("objective") == "calls":
        return f"{s['cost_per_prompt']:.1f} calls"
    return f"{1000 * s['cost_per_prompt']:.3g} ms"


def table(rows: list[tuple[str, dict]], chosen: str | None, base_name: str, status: bool = False) -> str:
    """Markdown: the objective's speedup over the base (tokens per second, or per call, over the
    base's) and cost per prompt, accuracy, paired difference to the base ± SE (points), NFE/prompt,
    TPF and its ratio over the base; the chosen row and the base marked."""
    head = "| setting | speedup | cost/prompt | accuracy | diff vs base ± SE (points) | NFE/prompt | TPF | TPF / base |"
    rule = "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    if status:
        head, rule = head + " problems | status |", rule + " ---: | --- |"
    lines = [head, rule]
    for name, s in rows:
        mark = " **(chosen)**" if name == chosen else " (base)" if name == base_name else ""
        line = (
            f"| {name}{mark} | {s['speedup']:.2f}x | {_cost(s)} | {100 * s['accuracy']:.1f}% | "
            f"{_points(s['difference'])} ± {100 * s['standard_error']:.1f} | "
            f"{s['nfe_per_prompt']:.1f} | {s['tpf']:.2f} | {s['tpf_ratio']:.2f}x |"
        )
        if status:
            line += f" {s['n']} | {s.get('status', '')} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _rate(meta: dict) -> str:
    return "tokens per call" if meta["objective"] == "calls" else "tokens/s"


def interval(s: dict, z: float) -> str:
    return (
        f"{_points(s['difference'])} ± {100 * s['standard_error']:.1f} points "
        f"(interval {_points(s['lower'])} to {_points(s['upper'])} at z = {z:g})"
    )


def write_reports(
    out: Path,
    meta: dict,
    result: SearchResult,
    base_name: str,
    confirmation: dict | None,
    dropped: list,
    settings: dict[str, dict],
    failed: list[dict] | None = None,
    final: dict | None = None,
) -> str:
    """Write the three files; return the text to print (frontier table and the choice).
    ``settings``: each candidate's ``DecodeConfig`` fields, stored with its numbers; ``failed``: the
    candidates whose confirmation did not hold, in the order they were tried; ``final``: the
    choice on the final set."""
    failed = failed or []
    out.mkdir(parents=True, exist_ok=True)
    last_rung = meta["rungs"][-1]
    last_rung_stats = {n: s for n, s in result.last.items() if s["rung"] == last_rung}
    stats = {base_name: {**result.base, "status": "base"}, **last_rung_stats}
    frontier_rows = [(n, stats[n]) for n in result.frontier]
    report = {
        "meta": meta,
        "base": {"name": base_name, **result.base},
        "candidates": {n: {**s, "settings": settings[n]} for n, s in result.last.items()},
        "rungs": result.rungs,
        "frontier": result.frontier,
        "choice": result.choice,
        "confirmation": confirmation,
        "final": final,
        "failed_confirmation": failed,
        "dropped_from_space": [{"settings": f, "reason": why} for f, why in dropped],
    }
    (out / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
    verdict = verdict_text(meta, result, confirmation, failed, final)
    frontier_md = table(frontier_rows, result.choice, base_name)
    ordered = sorted(result.last.items(), key=lambda item: (-item[1]["rung"], item[1]["cost_per_prompt"]))
    final_part = f", final {meta['final_size']}" if meta.get("final_size") else ""
    md = (
        f"# Tuning: {meta['model']} on {meta['data']}\n\n"
        f"Base {base_name}; objective {meta['objective']} on {meta['device']}; max loss {meta['max_loss']:g} points; "
        f"search {meta['search_size']} problems "
        f"(rungs {', '.join(map(str, meta['rungs']))}), confirmation {meta['confirm_size']}"
        f"{final_part}.\n\n"
        f"## Frontier (last rung, {last_rung} problems)\n\n{frontier_md}\n{verdict}\n\n"
        f"## Every candidate at the last rung it reached\n\n"
        f"{table([(base_name, stats[base_name]), *ordered], result.choice, base_name, status=True)}"
    )
    (out / "tune.md").write_text(md)
    plotted = [{"name": n, **s} for n, s in stats.items()]
    pareto_plot(
        plotted,
        out / "frontier.png",
        f"{Path(meta['model']).name}: last rung, {last_rung} problems",
        axes=(("speedup", f"speedup over the base ({_rate(meta)})"), ("tpf", "tokens per forward (TPF)")),
        frontier=result.frontier,
        chosen=result.choice,
    )
    return f"{frontier_md}\n{verdict}\nwrote {out / 'tune.json'}, {out / 'tune.md'}, {out / 'frontier.png'}"


def verdict_text(
    meta: dict, result: SearchResult, confirmation: dict | None, failed: list[dict], final: dict | None = None
) -> str:
    """The search's outcome in words: the confirmations that failed, then the choice, its
    confirmation and final measurement with the selection effect (the choice's difference on
    search, confirmation and final problems), or why there is none."""
    z = meta["z"]
    last_rung = meta["rungs"][-1]
    confirm_z = meta.get("confirm_z", z)
    tried = "".join(
        f"{f['name']} failed its confirmation ({_points(f['difference'])} ± {100 * f['standard_error']:.1f} points "
        f"on {meta['confirm_size']} problems, bound {_points(f.get('gate', f['difference']))} at z = {confirm_z:.2f}); "
        for f in failed
    )
    if result.choice is None and failed:
        verdict = f"{tried}no candidate held on the confirmation split: nothing chosen."
    elif result.choice is None:
        verdict = (
            f"No candidate is within {meta['max_loss']:g} points of the base on the last rung "
            f"({last_rung} problems): nothing chosen."
        )
    else:
        chosen = result.last[result.choice]
        verdict = tried + (
            f"Chosen ({meta['objective']} on {meta['device']}): {result.choice}: {chosen['speedup']:.2f}x the base's "
            f"{_rate(meta)}, {_cost(chosen)} per prompt against {_cost(result.base)}, "
            f"{chosen['nfe_per_prompt']:.1f} NFE/prompt against {result.base['nfe_per_prompt']:.1f}; search difference "
            f"{interval(chosen, z)} on {last_rung} problems."
        )
        if confirmation is not None:
            verdict += (
                f"\nConfirmation ({confirmation['n']} held-out problems): {interval(confirmation, z)}; "
                f"accuracy {100 * confirmation['accuracy']:.1f}% against {100 * confirmation['base_accuracy']:.1f}%, "
                f"{confirmation['speedup']:.2f}x the base's {_rate(meta)}, "
                f"NFE/prompt {confirmation['nfe_per_prompt']:.1f} against {confirmation['base_nfe_per_prompt']:.1f}, "
                f"TPF ratio {confirmation['tpf_ratio']:.2f}x; its loss bound "
                f"{_points(confirmation['gate'])} at z = {confirm_z:.2f} is within {meta['max_loss']:g} points."
            )
        if final is not None:
            spread = final.get("speedup_interval")
            verdict += (
                f"\nFinal ({final['n']} problems that neither the search nor the confirmation read): "
                f"{interval(final, z)}; accuracy {100 * final['accuracy']:.1f}% against "
                f"{100 * final['base_accuracy']:.1f}%, {final['speedup']:.2f}x the base's {_rate(meta)}"
                + (f" (95% interval {spread[0]:.2f}-{spread[1]:.2f}x over batches)" if spread else "")
                + f", TPF ratio {final['tpf_ratio']:.2f}x."
            )
            verdict += (
                f"\nSelection effect (the choice's difference from the base): search {_points(chosen['difference'])}, "
                f"confirmation {_points(confirmation['difference'])}, final {_points(final['difference'])} points."
            )
    return verdict
