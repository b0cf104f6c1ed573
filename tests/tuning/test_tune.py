"""``python -m psd_jax.tune``: the selection rule on outcomes whose answer is known, one small run on
the shipped model (splits, resuming, ``--write``) and its bad-input messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from processes import finish, start

from models import load_config
from psd_jax import tune
from psd_jax.core.config import DecodeConfig
from psd_jax.model_dir import DEFAULT_MODEL_DIR, model_settings
from psd_jax.recommended import RECOMMENDED_FILE, read_recommended
from psd_jax.tuning import log as tune_log
from psd_jax.tuning.cli import KEPT_PROGRAMS
from psd_jax.tuning.search import Outcome, corrected_z, speedup_interval, split, successive_halving
from psd_jax.tuning.space import build_space, default_space, small_space

# ---------------------------------------------------------------- the selection rule, synthetic


class Table:
    """Outcomes given per setting as functions of the problem index; counts what is asked."""

    def __init__(self, rules: dict[str, tuple[int, callable]]):
        self.rules, self.asked = rules, []

    def plan(self, settings, ids):
        pass

    def results(self, name, settings, ids):
        self.asked.append((name, len(ids)))
        nfe, correct = self.rules[name]
        return {i: Outcome(int(correct(i)), nfe, 10) for i in ids}


BASE_RIGHT = lambda i: i % 10 != 0  # noqa: E731  the base misses every tenth problem


def search(rules, keep_min=2, rungs=(250, 600, 1000), max_loss=0.01):
    table = Table({"base": (40, BASE_RIGHT), **rules})
    names = {n: DecodeConfig() for n in rules}
    result = successive_halving(
        "base", DecodeConfig(), names, list(rungs), list(range(1000)), table, max_loss, 1.64, keep_min
    )
    return result, table


def test_search_chooses_the_fastest_lossless_candidate():
    """A fast candidate losing a fifth of the answers is dropped at the first rung on its bound; a
    faster one losing 1.4% survives the bounds but not the point rule; of the lossless ones the
    faster is chosen, and the slow ones stop at the first rung (slower than a safe one)."""
    result, table = search(
        {
            "lossy": (5, lambda i: BASE_RIGHT(i) and i % 5 != 1),
            "slight": (8, lambda i: BASE_RIGHT(i) and i % 67 != 7),
            "lossless": (12, BASE_RIGHT),
            "slow": (20, BASE_RIGHT),
            "better-slower": (30, lambda i: True),
        }
    )
    assert result.choice == "lossless"
    assert result.rungs[0]["too_lossy"] == ["lossy"]
    assert result.rungs[0]["safe"] == "lossless"
    assert result.rungs[0]["slower_than_safe"] == ["slow", "better-slower"] and result.rungs[0]["halved"] == []
    assert result.last["slight"]["status"] == "over max loss"
    assert result.last["slight"]["difference"] == pytest.approx(-0.014)
    assert result.last["slight"]["upper"] > -0.01  # not confidently too lossy: only the point rule drops it
    assert result.last["lossless"]["rung"] == 1000
    assert result.last["slow"]["rung"] == 250 and result.last["lossy"]["rung"] == 250
    # Only survivors reach the larger rungs: 5 + base at 250, 2 + base at 600 and 1000.
    assert sorted(n for n, k in table.asked if k == 1000) == ["base", "lossless", "slight"]
    assert result.frontier == ["slight", "lossless"]  # lossless: the base's accuracy in fewer calls


def test_agreement_on_a_first_rung_is_not_certainty():
    """A candidate that agrees with the base on all of a small first rung is not safe yet: the SE
    counts one problem won and one lost more, so it drops no slower candidate on that evidence."""
    result, _ = search({"agrees": (6, BASE_RIGHT), "slower": (9, BASE_RIGHT)}, rungs=(20, 1000))
    assert result.rungs[0]["safe"] is None and result.rungs[0]["slower_than_safe"] == []
    assert result.last["agrees"]["standard_error"] > 0 and result.last["slower"]["rung"] == 1000
    assert result.choice == "agrees"


def test_search_keeps_the_fastest_safe_candidate_beyond_the_half():
    """With room for one survivor, the lowest-NFE one is promising but not yet safe; the fastest
    candidate whose lower bound clears the loss goes on too, so a lossless choice remains should
    the promising one fail later."""
    losses = (33, 47, 71, 301, 321, 341, 361, 381, 411, 431)
    unsure = lambda i: (BASE_RIGHT(i) or i == 0) and i not in losses  # noqa: E731
    result, _ = search({"unsure": (8, unsure), "lossless": (12, BASE_RIGHT)}, 1)
    assert result.rungs[0]["halved"] == [] and result.rungs[1]["evaluated"] == ["unsure", "lossless"]
    assert result.last["unsure"]["rung"] == 600 and result.last["unsure"]["difference"] < -0.01  # then lossy
    assert result.choice == "lossless"


def test_halving_keeps_promising_candidates_before_faster_lossy_ones():
    """Three fast candidates that will prove too lossy, one a little slower that is within the
    loss (as many problems won as lost) but not yet safe by its bound, and a slow safe one:
    halving keeps the promising one (point estimate within the loss) ahead of the faster lossy
    ones, so it is the choice, not the safe fallback; the safe one's slower peers stop at once."""
    lossy = lambda k: lambda i: BASE_RIGHT(i) and i % 50 != k  # noqa: E731
    result, _ = search(
        {
            "fast-a": (3, lossy(1)),
            "fast-b": (4, lossy(2)),
            "fast-c": (5, lossy(3)),
            "promising": (6, lambda i: (BASE_RIGHT(i) or i in (0, 10)) and i not in (5, 15)),
            "safe": (9, BASE_RIGHT),
            "slower": (10, BASE_RIGHT),
        },
        keep_min=1,
    )
    first = result.rungs[0]
    assert first["safe"] == "safe" and first["slower_than_safe"] == ["slower"]
    assert first["halved"] == ["fast-b", "fast-c"] and "promising" in result.rungs[1]["evaluated"]
    assert result.choice == "promising"


def test_the_choice_asks_for_the_lower_bound_when_a_candidate_meets_it():
    """A faster candidate within the loss by its point estimate only (20 problems lost, 20 won:
    lower bound below -1 point) gives way to a slower one that is within it by its bound; alone,
    it is the choice on its point estimate."""
    lucky = lambda i: (BASE_RIGHT(i) and i % 50 != 25) or i % 50 == 30  # noqa: E731
    both, _ = search({"lucky": (6, lucky), "steady": (8, BASE_RIGHT)})
    assert both.last["lucky"]["difference"] == 0 and both.last["lucky"]["lower"] < -0.01
    assert both.last["lucky"]["status"] == "within max loss"
    assert both.last["steady"]["status"] == "chosen" and both.choice == "steady"
    alone, _ = search({"lucky": (6, lucky)})
    assert alone.choice == "lucky"


def test_a_choice_that_fails_its_confirmation_gives_way_to_the_next():
    """The cheapest candidate within the loss on the search split that loses 3 points on the
    confirmation split is not chosen: the next one in the ranking is confirmed and chosen; with
    every candidate failing, nothing is."""
    from types import SimpleNamespace

    from psd_jax.tuning.cli import confirm
    from psd_jax.tuning.search import CALLS

    confirm_ids = list(range(1000, 1600))
    # Both within the loss on the 200 search problems by their point estimates, neither by its bound.
    unlucky = lambda i: BASE_RIGHT(i) and i != 7 and not (i >= 1000 and i % 33 == 0)  # noqa: E731  -3 points
    rules = {"fast": (5, unlucky), "steady": (9, BASE_RIGHT)}
    result, table = search(rules, rungs=(100, 200))
    assert result.choice == "fast" and result.ranked == ["fast", "steady"]
    plan = SimpleNamespace(
        candidates={n: DecodeConfig() for n in rules}, base=DecodeConfig(), base_name="base",
        confirm_ids=confirm_ids, objective=CALLS,
    )  # fmt: skip
    args = SimpleNamespace(z=1.64, max_loss=1.0, confirm_z=None)
    table.phase = None
    held, failed = confirm(plan, args, table, result)
    assert held["name"] == result.choice == "steady" and held["difference"] == 0
    assert held["confirm_z"] == pytest.approx(2.12, abs=0.01) and held["gate"] >= -0.01
    assert [f["name"] for f in failed] == ["fast"] and failed[0]["difference"] == pytest.approx(-17 / 600)
    assert result.last["fast"]["status"] == "failed confirmation" and result.last["steady"]["status"] == "chosen"
    lossy, _ = search({"fast": (5, unlucky)}, rungs=(100, 200))
    assert confirm(plan, args, table, lossy) == (None, failed) and lossy.choice is None
    # Two more that answer as "fast" does (one decoder under other caches) fail alike and count as
    # one failure with it: "steady" is still confirmed after them, the fourth tried.
    alike = {"fast": (5, unlucky), "fast-b": (6, unlucky), "fast-c": (7, unlucky)}
    result, table = search({**alike, "steady": (9, BASE_RIGHT)}, keep_min=4, rungs=(100, 200))
    assert result.ranked == [*alike, "steady"]
    plan.candidates = {n: DecodeConfig() for n in result.ranked}
    table.phase = None
    held, failed = confirm(plan, args, table, result)
    assert held["name"] == result.choice == "steady" and [f["name"] for f in failed] == list(alike)


def test_a_confirmation_holds_by_its_bound_widened_for_the_tries():
    """A candidate that loses 2 of 600 confirmation problems and wins none is within one point by
    its point estimate, and by the bound at z 1.64 (-0.9 points), but not by the bound widened for
    the three candidates a confirmation may try (z 2.12: -1.04 points): it fails, and the lossless
    one after it is chosen. With ``--confirm-z 1.64`` or ``0`` (the point estimate) it holds."""
    from types import SimpleNamespace

    from psd_jax.tuning.cli import confirm
    from psd_jax.tuning.search import CALLS

    assert corrected_z(1.64, 1) == pytest.approx(1.64) and corrected_z(1.64, 3) == pytest.approx(2.124, abs=1e-3)
    edge = lambda i: BASE_RIGHT(i) and i not in (1001, 1002)  # noqa: E731
    rules = {"edge": (5, edge), "steady": (9, BASE_RIGHT)}
    plan = SimpleNamespace(
        candidates={n: DecodeConfig() for n in rules}, base=DecodeConfig(), base_name="base",
        confirm_ids=list(range(1000, 1600)), objective=CALLS,
    )  # fmt: skip
    for confirm_z, chosen in ((None, "steady"), (1.64, "edge"), (0.0, "edge")):
        result, table = search(rules, rungs=(100, 200))
        assert result.ranked[0] == "edge"
        table.phase = None
        held, failed = confirm(plan, SimpleNamespace(z=1.64, max_loss=1.0, confirm_z=confirm_z), table, result)
        assert held["name"] == chosen and held["gate"] >= -0.01
        if chosen == "steady":
            assert [f["name"] for f in failed] == ["edge"] and failed[0]["difference"] == pytest.approx(-2 / 600)
            assert -0.0105 < failed[0]["gate"] < -0.0102


def test_the_speedup_interval_resamples_batches():
    """Problems decoded together share their batch's seconds: the interval resamples batches, so
    batches that all ran at 2x give exactly 2x, and unequal ones an interval around the ratio of
    the sums."""
    ids = list(range(40))
    base = {i: Outcome(1, 10, 10, seconds=0.1, batch=i // 10) for i in ids}
    even = {i: Outcome(1, 2, 10, seconds=0.05, batch=100 + i // 10) for i in ids}
    assert speedup_interval(base, even, ids) == pytest.approx((2.0, 2.0))
    uneven = {i: Outcome(1, 2, 10, seconds=0.05 * (1 + (i // 10) % 2), batch=100 + i // 10) for i in ids}
    low, high = speedup_interval(base, uneven, ids)
    assert 1.0 <= low < 0.4 / 0.3 < high <= 2.0  # the sums: 0.4 s against 0.3 s


def test_search_reports_when_no_candidate_is_within_the_loss():
    result, _ = search({"lossy": (5, lambda i: BASE_RIGHT(i) and i % 5 != 1)})
    assert result.choice is None and result.last["lossy"]["status"] == "too lossy (bound)"


def test_a_modeled_problem_pays_its_batch_share_or_alone_its_own_calls():
    """At 32 rows per call a problem is charged 1/32 of its batch's calls; at one row per call its
    own: a batch of 50 whose slowest row took 20 calls charges a row of 5 calls 5 calls, not 20."""
    from paths import HF_CONFIGS

    from psd_jax.core.calls import CallShape
    from psd_jax.costs import CHIPS, roofline_call_cost
    from psd_jax.tuning.devices import Target, objective_for

    llada = HF_CONFIGS / "LLaDA-8B-Instruct"
    mcfg, shape = load_config(llada), CallShape("full", 1, 112)
    call = {"kind": "full", "candidates": 1, "positions": 112, "batch": 50, "count": 20, "logits": 32}
    outcome = Outcome(correct=1, nfe=5, tokens=30, calls=(call,), rows=50)
    for rows, charged in ((32, 20 / 32), (1, 5)):
        priced = objective_for("seconds", Target("h200", llada, rows), 16).price(outcome)
        assert priced == pytest.approx(charged * roofline_call_cost(mcfg, CHIPS["h200"], shape, rows, 16, 32))


def test_split_is_a_seeded_disjoint_partition():
    search_ids, confirm_ids = split(50, 15, seed=3)
    assert len(confirm_ids) == 15 and sorted(search_ids + confirm_ids) == list(range(50))
    assert split(50, 15, seed=3) == (search_ids, confirm_ids) != split(50, 15, seed=4)


def test_space_is_validated_with_reasons():
    """The default space at the shipped model's lengths: a few dozen valid candidates. At block
    length 4 the depth-7 settings are dropped, each with the reason."""
    mcfg = load_config(DEFAULT_MODEL_DIR)
    base = DecodeConfig(gen_length=48, block_length=16)
    space = build_space(default_space(48, 16), 48, mcfg, base)
    assert len(space.candidates) == 101 and not space.dropped
    assert {
        "threshold-0.98/dual+v4/b16",
        "threshold-0.95/dual+v8/b16",
        "psd-fixed-1-d15/dual/b16",
        "psd-fixed-1-d30-next-conf0.98/none/b16",
        "psd-fixed-1-d15-conf0.95/none/b16",
        "psd-threshold-0.9-d23/dual/b24",
        "rps-threshold-0.9-k5/dual/b16",
        "psd-fixed-1-d30-next/none/b16",
        "edit-schedule-0.7-e0.5/none/b16",
    } <= set(space.candidates)
    small = build_space(default_space(48, 4), 48, mcfg, base)
    reasons = [why for fields, why in small.dropped if fields.get("depth") == 7]
    within = [why for fields, why in small.dropped if fields.get("depth") == 7 and not fields.get("draft_next_block")]
    assert within and all("exceeds block_length - 1 = 3" in why for why in within)
    assert len(reasons) > len(within) and all("exceeds" in why for why in reasons)
    assert len(build_space(small_space(48, 16), 48, mcfg, base).candidates) == 4


# ---------------------------------------------------------------- one small run on the shipped model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The shipped model's files linked into a directory of its own, for ``--write`` to write to."""
    directory = tmp_path_factory.mktemp("model")
    for file in DEFAULT_MODEL_DIR.iterdir():
        if file.name != RECOMMENDED_FILE:
            (directory / file.name).symlink_to(file)
    return directory


PROBLEM_FILES = {"dev": (0, 8), "confirm": (8, 12), "final": (12, 16)}  # lines of the held-out set


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> dict[str, Path]:
    """Search, confirmation and final problems: three disjoint files."""
    lines = (DEFAULT_MODEL_DIR / "test.jsonl").read_text().splitlines()
    folder = tmp_path_factory.mktemp("data")
    for name, (first, stop) in PROBLEM_FILES.items():
        (folder / f"{name}.jsonl").write_text("\n".join(lines[first:stop]) + "\n")
    return {name: folder / f"{name}.jsonl" for name in PROBLEM_FILES}


@pytest.fixture(scope="module")
def dev(problems) -> Path:
    return problems["dev"]


def args(model_dir, dev, out, *extra):
    """The search on ``dev``, confirmed on the file beside it and measured once on the final one; a
    point-estimate confirmation (``--confirm-z 0``), since no bound certifies a loss of 0 on 4 problems."""
    files = ["--confirm-data", str(dev.with_name("confirm.jsonl")), "--final-data", str(dev.with_name("final.jsonl"))]
    return ["--model", str(model_dir), "--data", str(dev), *files, "--confirm-z", "0", "--space", "small",
            "--rungs", "4,8", "--batch", "4", "--max-loss", "0", "--out", str(out), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def run(model_dir, dev, tmp_path_factory):
    """The search as a user starts it: ``python -m psd_jax.tune`` on the shipped model's files."""
    out = tmp_path_factory.mktemp("tune")
    finish(start("psd_jax.tune", args(model_dir, dev, out, "--write"), out, "tune", devices=1), timeout_s=600)
    return out, json.loads((out / "tune.json").read_text())


def test_tune_chooses_within_the_loss_and_strict_psd_is_lossless(run):
    """Strict PSD over one token per step decodes the base's tokens in fewer calls: its paired
    difference is exactly zero on every problem, so it is within a zero loss, and the chosen
    setting is at least as fast."""
    out, report = run
    strict = report["candidates"]["psd-strict-fixed-1-d3/none/b16"]
    assert (strict["difference"], strict["only_base"], strict["only_candidate"]) == (0.0, 0, 0)
    assert strict["nfe_per_prompt"] < report["base"]["nfe_per_prompt"]
    chosen = report["candidates"][report["choice"]]
    within = [c for c in report["candidates"].values() if c["status"] in ("within max loss", "chosen")]
    assert report["meta"]["objective"] == "seconds" and report["meta"]["device"] == "this"
    assert chosen["difference"] >= 0 and chosen["cost_per_prompt"] == min(c["cost_per_prompt"] for c in within)
    # seconds per prompt: the problems' shares of their batches' measured seconds
    lines = [json.loads(line) for line in (out / "tune.jsonl").read_text().splitlines()]
    base_lines = [e for e in lines if e["name"] == report["base"]["name"] and e["phase"] == "search"]
    assert report["base"]["cost_per_prompt"] == pytest.approx(sum(e["seconds"] for e in base_lines) / 8)
    assert all(sum(c["count"] for c in e["calls"]) >= max(e["nfe"]) for e in lines)
    assert report["confirmation"]["n"] == 4 and report["confirmation"]["name"] == report["choice"]
    final = report["final"]
    assert (
        final["n"] == 4 and final["name"] == report["choice"] and report["meta"]["splits"]["final"] == [12, 13, 14, 15]
    )
    low, high = final["speedup_interval"]
    assert low <= final["speedup"] <= high
    assert {(e["name"], tuple(e["problems"])) for e in lines if e["phase"] == "final"} == {
        (report["choice"], (12, 13, 14, 15)),
        (report["base"]["name"], (12, 13, 14, 15)),
    }
    assert (out / "frontier.png").stat().st_size > 0
    md = (out / "tune.md").read_text()
    assert f"{report['choice']} **(chosen)**" in md and "Selection effect (the choice's difference from the base)" in md


def test_confirmation_split_is_never_decoded_in_the_search(run):
    """The search reads every --data problem and none of the other files'; the confirmation the
    --confirm-data file, whose problems are numbered after --data's."""
    out, report = run
    confirm = set(report["meta"]["splits"]["confirmation"])
    lines = [json.loads(line) for line in (out / "tune.jsonl").read_text().splitlines()]
    searched = {i for e in lines if e["phase"] == "search" for i in e["problems"]}
    assert searched == set(report["meta"]["splits"]["search"]) == set(range(8)) and confirm == set(range(8, 12))
    assert {i for e in lines if e["phase"] == "confirm" for i in e["problems"]} == confirm
    assert report["meta"]["files"]["--confirm-data"]["first"] == 8


def test_a_resumed_run_decodes_nothing_and_reports_the_same(run, model_dir, dev, tmp_path, monkeypatch):
    out, report = run

    def no_decode(*a, **k):
        raise AssertionError("decoded again")

    monkeypatch.setattr(tune_log, "decode_batch", no_decode)
    monkeypatch.setattr("psd_jax.api.load_model", no_decode)
    again = tmp_path / "again"
    assert tune.main(args(model_dir, dev, again, "--log", str(out / "tune.jsonl"))) == 0
    second = json.loads((again / "tune.json").read_text())
    assert second["meta"]["problems_decoded"] == 0 and second["meta"]["log_entries_read_back"] > 0
    for key in ("choice", "candidates", "confirmation", "final", "frontier", "rungs", "base"):
        assert second[key] == report[key]


def test_a_finished_log_re_ranks_for_a_modeled_device_without_decoding(
    run, model_dir, dev, tmp_path, monkeypatch, capsys
):
    """``--rerank --device h200@32`` prices the logged decodes' calls by shape for the H200 (the
    tuned model's config, 32 rows per call) and ``--rerank --objective calls`` counts them: neither
    decodes, each problem costs its batch's share, and ``--write`` stores each choice under its
    device kind."""
    from psd_jax.core.calls import record_shape
    from psd_jax.costs import CHIPS, roofline_call_cost

    out, report = run
    # Which candidates reached the last rung depends on this machine's timing of the search, so the
    # H200's choice may not be the one the search confirmed: a resumed run (on a copy of the log)
    # decodes that confirmation alone, and the re-rank below then finds it.
    h200_log = tmp_path / "h200.jsonl"
    h200_log.write_text((out / "tune.jsonl").read_text())
    h200 = ["--log", str(h200_log), "--device", "h200@32"]
    assert tune.main(args(model_dir, dev, tmp_path / "resumed", *h200)) == 0

    def no_decode(*a, **k):
        raise AssertionError("decoded again")

    monkeypatch.setattr(tune_log, "decode_batch", no_decode)
    monkeypatch.setattr("psd_jax.api.load_model", no_decode)
    log = ["--log", str(out / "tune.jsonl"), "--rerank"]
    assert tune.main(args(model_dir, dev, tmp_path / "h200", *h200, "--rerank", "--write")) == 0
    modeled = json.loads((tmp_path / "h200" / "tune.json").read_text())
    assert modeled["meta"]["device"] == f"h200:{model_dir.name}@32" and modeled["meta"]["problems_decoded"] == 0
    mcfg = load_config(model_dir)
    lines = [json.loads(line) for line in (out / "tune.jsonl").read_text().splitlines()]
    base_lines = [e for e in lines if e["name"] == report["base"]["name"] and e["phase"] == "search"]
    # A batch's calls, each at 32 rows, serve 32 problems: each of its problems is charged 1/32 of them.
    priced = sum(
        len(e["problems"]) * c["count"] * roofline_call_cost(mcfg, CHIPS["h200"], record_shape(c), 32, 16, c["logits"])
        for e in base_lines
        for c in e["calls"]
    )
    assert modeled["base"]["cost_per_prompt"] == pytest.approx(priced / 32 / 8)
    capsys.readouterr()
    assert tune.main(args(model_dir, dev, tmp_path / "calls", *log, "--objective", "calls")) == 0
    by_calls = json.loads((tmp_path / "calls" / "tune.json").read_text())
    assert by_calls["base"]["cost_per_prompt"] == by_calls["base"]["nfe_per_prompt"]
    ranked = {n: c for n, c in by_calls["candidates"].items() if c["rung"] == 8 and c["difference"] >= 0}
    fewest = min(ranked, key=lambda n: ranked[n]["nfe_per_prompt"])
    if fewest == report["choice"]:  # its confirmation is in the log: chosen again
        assert by_calls["choice"] == fewest
    else:  # a rerank decodes nothing: the fewest-calls choice is left unconfirmed, and says so
        assert by_calls["choice"] is None and by_calls["candidates"][fewest]["status"].startswith("not confirmed")
        assert f"{fewest}: its confirmation is not in the log (run without --rerank)" in capsys.readouterr().err
    # Both choices kept, each for its kind; this CPU reads its own.
    cpu, gpu = read_recommended(model_dir, "cpu"), read_recommended(model_dir, "gpu")
    assert cpu.device == "cpu" and cpu.provenance["name"] == report["choice"]
    assert gpu.device == "gpu" and gpu.provenance["name"] == modeled["choice"]
    assert gpu.provenance["device"] == f"seconds modeled for h200:{model_dir.name}@32"
    assert "tuned for cpu (seconds measured on cpu)" in read_recommended(model_dir).origin()
    tpu = read_recommended(model_dir, "tpu")  # no choice of its own: the latest one written
    assert tpu.provenance["name"] == modeled["choice"] and "no choice for tpu in it" in tpu.origin()


def test_a_resumed_run_decodes_only_what_the_log_lacks(run, model_dir, dev, tmp_path, monkeypatch):
    """Without the chosen setting's confirmation line, a restart decodes exactly those problems; a
    half-written last line is skipped and the next entry starts on a line of its own."""
    out, report = run
    lines = (out / "tune.jsonl").read_text().splitlines()
    kept = [
        line
        for line in lines
        if not (json.loads(line)["phase"] == "confirm" and json.loads(line)["name"] != report["base"]["name"])
    ]
    log = tmp_path / "partial.jsonl"
    log.write_text("\n".join(kept) + '\n{"name": "interrupted", "pha')  # and a half-written line
    decoded, real = [], tune_log.decode_batch
    monkeypatch.setattr(
        tune_log,
        "decode_batch",
        lambda lm, s, ex, *a: decoded.append((len(ex), lm.max_programs)) or real(lm, s, ex, *a),
    )
    assert tune.main(args(model_dir, dev, tmp_path / "out", "--log", str(log))) == 0
    # ... with a bounded number of compiled programs kept (each holds memory mappings of its own)
    timed = ("cost_per_prompt", "speedup")  # seconds: the decode was timed again
    untimed = lambda c: {k: v for k, v in c.items() if k not in timed}  # noqa: E731
    again = json.loads((tmp_path / "out" / "tune.json").read_text())["confirmation"]
    assert decoded == [(4, KEPT_PROGRAMS)] and untimed(again) == untimed(report["confirmation"])
    assert json.loads(log.read_text().splitlines()[-1])["phase"] == "confirm"


def test_write_stores_the_choice_as_the_recommended_setting(run, model_dir):
    _, report = run
    rec = read_recommended(model_dir)
    chosen = DecodeConfig(**report["candidates"][report["choice"]]["settings"])
    assert rec.tuned and model_settings(model_dir, rec.settings) == chosen
    p = rec.provenance
    assert (p["name"], p["search_size"], p["confirm_size"], p["max_loss_points"]) == (report["choice"], 8, 4, 0.0)
    assert (
        p["base"]["name"] == "fixed-1/none/b16"
        and p["confirmation"]["difference"] == report["confirmation"]["difference"]
    )
    assert p["final"]["difference"] == report["final"]["difference"] and p["final"]["n"] == 4
    assert p["speedup"] == report["final"]["speedup"] and p["files"]["--final-data"]["n"] == 4
    assert p["search"]["standard_error"] == report["candidates"][report["choice"]]["standard_error"]


def test_written_setting_round_trips_through_bench_and_generate(run, model_dir, dev, tmp_path, capsys):
    """``bench --decoders recommended`` and ``generate --settings recommended`` on the directory
    ``--write`` wrote to decode the chosen setting: the same answers and model calls, problem by
    problem, as the tuner logged for it."""
    from psd_jax.cli import bench, generate

    out, report = run
    logged = {}
    for entry in map(json.loads, (out / "tune.jsonl").read_text().splitlines()):
        if entry["name"] == report["choice"]:
            logged.update({i: (c, n) for i, c, n in zip(entry["problems"], entry["correct"], entry["nfe"])})
    argv = ["--model", str(model_dir), "--data", str(dev), "--limit", "4", "--batch", "4", "--decoders", "recommended"]
    assert bench.main([*argv, "--out", str(tmp_path / "bench")]) == 0
    baseline, row = json.loads((tmp_path / "bench" / "bench.json").read_text())["results"]
    assert baseline["name"] == "fixed-1/none" and row["name"] == "recommended"
    assert [int(c) for c in row["correct_by_problem"]] == [logged[i][0] for i in range(4)]
    assert row["nfe_per_prompt"] == sum(logged[i][1] for i in range(4)) / 4
    question = json.loads(dev.read_text().splitlines()[0])["question"]
    capsys.readouterr()
    assert generate.main(["--model", str(model_dir), "--settings", "recommended", "--prompt", question, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["nfe"] == logged[0][1]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "/nonexistent.jsonl"], "no problem file /nonexistent.jsonl"),
        (["--data", "EMPTY"], "holds no problems"),
        (["--base", "fixed-3x"], "--base fixed-3x: unknown setting name 'fixed-3x'"),
        (["--base", '{"depth": 5}'], "depth=5 would be ignored"),
        (["--max-loss", "-1"], "--max-loss must be >= 0"),
        (["--rungs", "4,2"], "--rungs must be positive and strictly increasing"),
        (["--rungs", "4,20"], "rung 20 is larger than the search split (8 problems)"),
        (["--confirm", "0"], "the confirmation split is empty"),
        (["--confirm", "8"], "the search split is empty"),
        (["--rungs", "2,7", "--confirm", "2"], "rung 7 is larger than the search split (6 problems)"),
        (["--confirm-data", "/nonexistent.jsonl"], "--confirm-data: no problem file /nonexistent.jsonl"),
        (["--final-data", "EMPTY"], "--final-data: "),
        (["--final-data", "DEV"], "--final-data: 8 of its questions are also in --data"),
        (["--final-data", "CONFIRM"], "--final-data: 4 of its questions are also in --confirm-data"),
        (["--confirm-z", "-1"], "--confirm-z must be >= 0"),
    ],
)
def test_bad_input_is_one_error_line_before_the_model_loads(extra, message, problems, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("psd_jax.api.load_model", lambda *a, **k: pytest.fail("loaded the model"))
    (tmp_path / "empty.jsonl").write_text("\n")
    files = {"EMPTY": tmp_path / "empty.jsonl", "DEV": problems["dev"], "CONFIRM": problems["confirm"]}
    extra = [str(files.get(e, e)) for e in extra]
    split = [] if "--confirm" in extra else ["--confirm-data", str(problems["confirm"])]
    argv = ["--data", str(problems["dev"]), *split, "--out", str(tmp_path / "out"), *extra]
    assert tune.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not (tmp_path / "out").exists()
