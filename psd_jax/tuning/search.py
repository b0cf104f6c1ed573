"""Successive halving over growing prefixes of the search split, judged by paired differences.

Pure logic on per-problem outcomes: the model is behind ``Evaluator.results`` (``tuning.log``
evaluates and logs; tests pass synthetic outcomes). What a candidate costs is the ``Objective``'s:
model calls, or seconds (measured on the device that decoded, or priced for a modeled one from the
decodes' calls by shape). docs/tuning.md states the design.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Protocol

import numpy as np

from ..cli.bench import paired_difference, rate_ratio_interval
from ..core.config import DecodeConfig

KEEP_MIN = 4  # a rung keeps at least this many candidates (or all there are)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One setting on one problem."""

    correct: int  # 1 if the answer was right
    nfe: int  # model calls
    tokens: int  # tokens before EOS
    seconds: float = 0.0  # its share of its batch's warm decode seconds, on the device that decoded it
    calls: tuple = ()  # its batch's model calls by shape (``calls.call_records``), shared by the batch
    rows: int = 1  # problems in that batch
    batch: int = 0  # which decode it was part of (problems of one batch share its seconds)


@dataclasses.dataclass(frozen=True)
class Objective:
    """What the search minimises per problem at equal accuracy: ``calls`` (model calls), or
    ``seconds`` on ``device``: measured (``this``: the decodes' own seconds) or priced for a modeled
    target (``price``: seconds of a problem from its outcome's calls)."""

    name: str = "seconds"  # "seconds" or "calls"
    device: str = "this"
    price: Callable[[Outcome], float] | None = None

    def cost(self, outcome: Outcome) -> float:
        if self.name == "calls":
            return float(outcome.nfe)
        return outcome.seconds if self.price is None else self.price(outcome)

    @property
    def unit(self) -> str:
        return "calls" if self.name == "calls" else "s"


CALLS = Objective("calls")


class NotEvaluated(LookupError):
    """An evaluator that only reads (a re-rank of a log) lacks a setting's outcomes on some problems."""


class Evaluator(Protocol):
    def results(self, name: str, settings: DecodeConfig, ids: list[int]) -> dict[int, Outcome]:
        """Outcomes of ``settings`` on the problems ``ids`` (evaluating only those not known yet;
        ``NotEvaluated`` from one that cannot evaluate)."""
        ...

    def plan(self, settings: list[DecodeConfig], ids: list[int]) -> None:
        """Told before a rung which settings will be asked for on ``ids`` (for a progress bar)."""
        ...


def split(n: int, confirm: int, seed: int) -> tuple[list[int], list[int]]:
    """Search and confirmation problem indices: one seeded permutation of ``range(n)``, its first
    ``confirm`` entries the confirmation split, the rest (in permuted order, so that every prefix
    is a random sample) the search split. Disjoint by construction."""
    order = [int(i) for i in np.random.default_rng(seed).permutation(n)]
    return order[confirm:], sorted(order[:confirm])


def default_rungs(n_search: int, first: int = 50) -> list[int]:
    """50, 100, 200, ... below the search split's size, then the whole split."""
    rungs, r = [], first
    while r < n_search:
        rungs.append(r)
        r *= 2
    return [*rungs, n_search]


def smoothed_se(won: int, lost: int, n: int) -> float:
    """Standard error of the mean of ``n`` paired differences (``won`` of +1, ``lost`` of −1, the
    rest 0) with one +1 and one −1 added. Without them, a candidate that agrees with the base on
    the first 50 problems would have SE 0 and look certainly lossless."""
    won, lost, n = won + 1, lost + 1, n + 2
    mean = (won - lost) / n
    variance = (won + lost - n * mean**2) / (n - 1)
    return math.sqrt(max(variance, 0.0) / n)


def corrected_z(z: float, tries: int) -> float:
    """The one-sided bound's width when up to ``tries`` candidates are confirmed on one split: the
    level ``1 - Phi(z)`` split between them (Bonferroni), so the chance that any one that loses more
    than the promised points passes stays at most the level of one. ``z`` 1.64 over 3 tries: 2.12."""
    normal = NormalDist()
    return normal.inv_cdf(1 - (1 - normal.cdf(z)) / tries)


def compare(
    base: dict[int, Outcome], other: dict[int, Outcome], ids: list[int], z: float, objective: Objective = CALLS
) -> dict:
    """``other`` against ``base`` on the same problems: accuracies, the paired difference
    (other − base, a fraction) with its standard error and the bounds ``difference ± z·SE``,
    NFE per prompt, TPF and the TPF ratio, and the ``objective``'s cost per prompt with the speedup
    over the base (tokens per unit of cost, over the base's: the tokens/s ratio when the cost is
    seconds). The SE is that of the per-problem differences with one problem won and one lost added
    (``smoothed_se``): agreement on every problem so far is not certainty. The base against itself
    has SE 0."""
    pair = paired_difference("".join(str(base[i].correct) for i in ids), "".join(str(other[i].correct) for i in ids))
    se = 0.0 if other is base else smoothed_se(pair["only_b"], pair["only_a"], len(ids))
    half = z * se
    nfe, base_nfe = (sum(o[i].nfe for i in ids) for o in (other, base))
    tokens, base_tokens = (sum(o[i].tokens for i in ids) for o in (other, base))
    tpf, base_tpf = tokens / max(nfe, 1), base_tokens / max(base_nfe, 1)
    cost, base_cost = (sum(objective.cost(o[i]) for i in ids) for o in (other, base))
    rate, base_rate = tokens / cost if cost else math.inf, base_tokens / base_cost if base_cost else math.inf
    return {
        "objective": objective.name,
        "device": objective.device,
        "cost_per_prompt": cost / len(ids),
        "base_cost_per_prompt": base_cost / len(ids),
        "speedup": rate / base_rate if base_rate not in (0, math.inf) else math.nan,
        "n": len(ids),
        "accuracy": float(pair["accuracy_b"]),
        "base_accuracy": float(pair["accuracy_a"]),
        "difference": pair["difference"],
        "standard_error": se,
        "lower": pair["difference"] - half,
        "upper": pair["difference"] + half,
        "only_base": pair["only_a"],
        "only_candidate": pair["only_b"],
        "nfe_per_prompt": nfe / len(ids),
        "base_nfe_per_prompt": base_nfe / len(ids),
        "tpf": tpf,
        "base_tpf": base_tpf,
        "tpf_ratio": tpf / base_tpf if base_tpf else math.nan,
    }


def speedup_interval(base: dict[int, Outcome], other: dict[int, Outcome], ids: list[int]) -> tuple[float, float]:
    """A 95% interval of the tokens/s ratio of ``other`` over ``base`` on ``ids``: a bootstrap over
    decodes (``rate_ratio_interval``). Problems decoded together share their batch's seconds, so the
    unit that varies is a batch, not a problem: the groups resampled are the problems one base batch
    and one ``other`` batch decoded."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i in ids:
        groups.setdefault((base[i].batch, other[i].batch), []).append(i)
    columns = [
        [sum(getattr(outcomes[i], field) for i in members) for members in groups.values()]
        for outcomes in (other, base)
        for field in ("tokens", "seconds")
    ]
    return rate_ratio_interval(*columns)


def _order(stats: dict) -> tuple:
    """Cheapest first (the objective's cost per prompt: seconds or model calls); ties: the smaller loss."""
    return (stats["cost_per_prompt"], -stats["difference"])


def _promise(stats: dict, max_loss: float) -> tuple:
    """Halving's order: candidates whose point estimate is within the loss first (each could be the
    choice on the evidence so far), then the others; each group cheapest first."""
    return (stats["difference"] < -max_loss, *_order(stats))


def _final_status(stats: dict, max_loss: float) -> str:
    if stats["lower"] >= -max_loss:
        return "within max loss (bound)"
    return "within max loss" if stats["difference"] >= -max_loss else "over max loss"


@dataclasses.dataclass
class SearchResult:
    rungs: list[dict]  # per rung: size, who was evaluated, who was dropped and why
    last: dict[str, dict]  # every candidate's numbers at the last rung it reached, with its status
    base: dict  # the base against itself on the last rung (accuracy, NFE, TPF)
    frontier: list[str]  # non-dominated settings of the last rung (base included), cheapest first
    choice: str | None  # the cheapest candidate within max_loss on the last rung (by its bound if any)
    ranked: list[str] = dataclasses.field(default_factory=list)  # every candidate that may be chosen, in order


def successive_halving(
    base_name: str,
    base: DecodeConfig,
    candidates: dict[str, DecodeConfig],
    rungs: list[int],
    search_ids: list[int],
    evaluator: Evaluator,
    max_loss: float,
    z: float,
    keep_min: int = KEEP_MIN,
    objective: Objective = CALLS,
) -> SearchResult:
    """At each rung (a prefix of ``search_ids``) the base and every surviving candidate are
    evaluated on the rung's problems. A candidate whose upper bound is below ``-max_loss`` (a
    fraction) is dropped as confidently too lossy. The cheapest candidate (``objective``'s cost per
    prompt) whose lower bound clears ``-max_loss`` is safe: every candidate that costs as much or more
    is dropped (it cannot be the choice while the safe one stays within the loss), and the safe one
    goes on. Of the rest, those whose point estimate is within the loss first, each group cheapest
    first, the leading half (at least ``keep_min``) goes on. On the last rung the cheapest
    candidate whose lower bound is within ``max_loss`` is chosen or, if none is, the cheapest one
    whose point estimate is: the fastest of many that look good enough is selected partly for its
    luck, and the bound asks for a margin against that."""
    survivors = list(candidates)
    last: dict[str, dict] = {}
    history: list[dict] = []
    base_stats: dict = {}
    for index, size in enumerate(rungs):
        ids = search_ids[:size]
        final = index == len(rungs) - 1
        evaluator.plan([base, *(candidates[n] for n in survivors)], ids)
        base_out = evaluator.results(base_name, base, ids)
        base_stats = compare(base_out, base_out, ids, z, objective)
        stats, unknown = {}, []
        for n in survivors:
            try:
                stats[n] = compare(base_out, evaluator.results(n, candidates[n], ids), ids, z, objective)
            except NotEvaluated:
                unknown.append(n)  # a re-rank: the log never had it this far
        for n in unknown:
            if n in last:
                last[n] = {**last[n], "status": "not in the log past this rung"}
        survivors = [n for n in survivors if n not in unknown]
        rung = _rung(survivors, stats, max_loss, keep_min, final)
        for n in survivors:
            last[n] = {"rung": size, "status": rung.status(n, stats[n], max_loss), **stats[n]}
        history.append({"rung": size, "evaluated": list(survivors), "not_in_the_log": unknown, **rung.record()})
        survivors = rung.kept
    final_stats = {n: s for n, s in last.items() if s["rung"] == rungs[-1]}
    ranked = ranked_choices(final_stats, survivors, max_loss)
    choice = ranked[0] if ranked else None
    if choice is not None:
        last[choice]["status"] = "chosen"
    frontier = pareto_frontier({base_name: base_stats, **final_stats})
    return SearchResult(history, last, base_stats, frontier, choice, ranked)


@dataclasses.dataclass
class Rung:
    """One rung's verdict on its survivors (``successive_halving``)."""

    lossy: list[str]  # upper bound below the loss
    safe: str | None  # the cheapest whose lower bound clears the loss
    beaten: list[str]  # cost as much as the safe one or more
    rest: list[str]  # the others, most promising first
    kept: list[str]  # those that go on
    final: bool

    def status(self, name: str, stats: dict, max_loss: float) -> str:
        if name in self.lossy:
            return "too lossy (bound)"
        if name in self.beaten:
            return "slower than a safe one"
        if self.final:
            return _final_status(stats, max_loss)
        return "kept" if name in self.kept else "halved"

    def record(self) -> dict:
        halved = [n for n in self.rest if n not in self.kept]
        return {"too_lossy": self.lossy, "safe": self.safe, "slower_than_safe": self.beaten, "halved": halved}


def _rung(survivors: list[str], stats: dict[str, dict], max_loss: float, keep_min: int, final: bool) -> Rung:
    lossy = [n for n in survivors if stats[n]["upper"] < -max_loss]
    rest = sorted((n for n in survivors if n not in lossy), key=lambda n: _order(stats[n]))
    safe = next((n for n in rest if stats[n]["lower"] >= -max_loss), None)
    beaten = []
    if safe is not None and not final:
        cost = stats[safe]["cost_per_prompt"]
        beaten = [n for n in rest if n != safe and stats[n]["cost_per_prompt"] >= cost]
    rest = sorted((n for n in rest if n not in beaten), key=lambda n: _promise(stats[n], max_loss))
    kept = rest
    if not final:
        kept = rest[: max(keep_min, math.ceil(len(rest) / 2))]
        if safe is not None and safe not in kept:
            kept.append(safe)
    return Rung(lossy, safe, beaten, rest, kept, final)


def ranked_choices(final_stats: dict[str, dict], survivors: list[str], max_loss: float) -> list[str]:
    """The candidates that may be chosen, in order: those within the loss by their lower bound,
    cheapest first, then those within it by their point estimate only, cheapest first. The first
    is the choice; the confirmation (``tuning.cli``) takes the next when one fails it."""
    feasible = [n for n in survivors if final_stats[n]["difference"] >= -max_loss]
    confident = sorted(
        (n for n in feasible if final_stats[n]["lower"] >= -max_loss), key=lambda n: _order(final_stats[n])
    )
    rest = sorted((n for n in feasible if n not in confident), key=lambda n: _order(final_stats[n]))
    return confident + rest


def pareto_frontier(stats: dict[str, dict]) -> list[str]:
    """The settings no other beats on both cost per prompt (less) and accuracy (higher or equal),
    cheapest first."""
    frontier, best = [], -math.inf
    for name in sorted(stats, key=lambda n: (stats[n]["cost_per_prompt"], -stats[n]["accuracy"])):
        if stats[name]["accuracy"] > best:
            frontier.append(name)
            best = stats[name]["accuracy"]
    return frontier
