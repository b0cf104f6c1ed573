"""Efficiency next to accuracy: per task, what the decode and the likelihood estimator cost.

For ``generate_until`` the figures are the benchmark's (``psd_jax.cli.bench``), so a harness run and
a bench run on the same problems read the same way: NFE (model calls while a row decoded, summed
over requests), tokens (generated before the first EOS/EOT), TPF = tokens / NFE, tokens/s over
the timed decodes (compilation excluded and reported apart), and the sequences forwarded. For
``loglikelihood`` they are the estimator's model calls, rows forwarded and seconds. Fast-dLLM's
``show_speed`` prints the same quantities (tokens, seconds, tokens/s, NFE).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..core.records import Generation


@dataclasses.dataclass
class TaskEfficiency:
    requests: int = 0
    nfe: int = 0
    tokens: int = 0
    sequence_forwards: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0
    gen_lengths: dict[str, int] = dataclasses.field(default_factory=dict)  # max_gen_toks -> decoded length
    scored_requests: int = 0  # loglikelihood
    scoring_calls: int = 0
    scoring_rows: int = 0
    scoring_seconds: float = 0.0
    scoring_compile_seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if v}
        if self.requests:
            out["nfe_per_request"] = self.nfe / self.requests
            out["tpf"] = self.tokens / max(self.nfe, 1)
            out["tokens_per_second"] = self.tokens / self.seconds if self.seconds else None
        if self.scored_requests:
            out["scoring_seconds_per_request"] = self.scoring_seconds / self.scored_requests
        return out


class EfficiencyLog:
    """Per-task counters, filled by the harness model as it runs."""

    def __init__(self) -> None:
        self.tasks: dict[str, TaskEfficiency] = {}

    def task(self, name: str | None) -> TaskEfficiency:
        return self.tasks.setdefault(name or "unnamed", TaskEfficiency())

    def add_generations(self, task: str | None, results: list[Generation]) -> None:
        """One decoded batch (timings are per batch, so they are counted once)."""
        t = self.task(task)
        t.requests += len(results)
        t.nfe += sum(r.nfe for r in results)
        t.tokens += sum(r.tokens for r in results)
        t.sequence_forwards += results[0].sequence_forwards
        t.seconds += results[0].seconds
        t.compile_seconds += results[0].compile_seconds

    def add_scoring(self, task: str | None, requests: int, before: tuple, after: tuple) -> None:
        """Requests scored, with the scorer's (calls, rows, seconds, compile seconds) around them."""
        t = self.task(task)
        calls, rows, seconds, compile_seconds = (b - a for a, b in zip(before, after))
        t.scored_requests += requests
        t.scoring_calls += calls
        t.scoring_rows += rows
        t.scoring_seconds += seconds
        t.scoring_compile_seconds += compile_seconds

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {name: t.summary() for name, t in self.tasks.items()}

    def table(self) -> str:
        """The printed table: one line per task."""
        head = "| task | requests | NFE/request | TPF | tokens | tokens/s | decode s | compile s | scored | scoring s |"
        lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, t in self.tasks.items():
            s = t.summary()
            tps = s.get("tokens_per_second")
            lines.append(
                f"| {name} | {t.requests} | {s.get('nfe_per_request', 0):.1f} | {s.get('tpf', 0):.2f} | {t.tokens} | "
                f"{'–' if tps is None else f'{tps:.1f}'} | {t.seconds:.2f} | "
                f"{t.compile_seconds + t.scoring_compile_seconds:.2f} | {t.scored_requests} | {t.scoring_seconds:.2f} |"
            )
        return "\n".join(lines)


def report_path(output_path: str | None, started: float) -> Path | None:
    """Where the efficiency record goes: beside the harness's newest ``results_*.json`` written
    since ``started`` under ``output_path`` (same date suffix), else into ``output_path`` itself."""
    if not output_path:
        return None
    root = Path(output_path)
    base = root.parent if root.suffix == ".json" else root
    results = [p for p in base.rglob("*.json") if p.stat().st_mtime >= started and not p.name.startswith("efficiency")]
    if results:
        newest = max(results, key=lambda p: p.stat().st_mtime)
        suffix = newest.stem.split("_", 1)[1] if "_" in newest.stem else newest.stem
        return newest.with_name(f"efficiency_{suffix}.json")
    return base / "efficiency.json"


def write_report(record: dict[str, Any], output_path: str | None, started: float) -> Path | None:
    path = report_path(output_path, started)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def efficiency_files(root: str | Path) -> list[dict]:
    """The efficiency records written under ``root`` (newest last)."""
    files = sorted(Path(root).rglob("efficiency*.json"), key=lambda p: p.stat().st_mtime)
    return [json.loads(p.read_text()) for p in files]
