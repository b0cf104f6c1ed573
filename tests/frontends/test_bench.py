"""``python -m psd_jax.bench`` on a few held-out problems: what it writes and what it counts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from psd_jax import DecodeConfig
from psd_jax.api import InputError, load_model
from psd_jax.cli import bench
from psd_jax.model_dir import checked_settings, model_settings
from psd_jax.scoring import is_correct, load_jsonl


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--limit", "6", "--batch", "3", "--decoders", "threshold-0.9/none,psd-fixed-4-d3", "--latency", "2"]
    return bench.main([*argv, "--out", str(out)]), out


def test_bench_writes_json_markdown_and_plot(run):
    """The baseline (one token per step, no cache) runs first whatever was asked; a name without a
    cache takes --cache (dual), one with a cache after the slash keeps its own."""
    code, out = run
    assert code == 0
    assert (out / "pareto.png").stat().st_size > 0
    report = json.loads((out / "bench.json").read_text())
    assert report["meta"]["n"] == 6 and report["meta"]["cache"] == "dual" and report["meta"]["latency_problems"] == 2
    names = [r["name"] for r in report["results"]]
    assert names == ["fixed-1/none", "threshold-0.9/none", "psd-fixed-4-d3/dual"]
    assert [r["settings"]["cache"] for r in report["results"]] == ["none", "none", "dual"]
    table = (out / "bench.md").read_text().splitlines()
    assert table[0].startswith(
        "| decoder | tokens/s | speedup (tok/s, 95% interval) | accuracy | vs baseline (points) |"
    )
    assert len(table) == 5 and [line.split(" | ")[0] for line in table[2:]] == [f"| {n}" for n in names]
    assert table[2].split(" | ")[2] == "1.00x" and table[2].split(" | ")[4] == "–"  # the baseline against itself


def test_bench_counts_match_a_direct_generate_call(run):
    """Accuracy, NFE, tokens and TPF are the same numbers the API returns for those prompts."""
    _, out = run
    rows = {r["name"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    lm = load_model()
    examples = load_jsonl(lm.path / "test.jsonl")[:6]
    settings = bench.decoder_matrix(model_settings(lm.path, {"cache": "dual"}))["psd-fixed-4-d3/dual"]
    batches = [lm.generate([e["question"] for e in examples[i : i + 3]], settings, chat=True) for i in (0, 3)]
    results = [r for batch in batches for r in batch]
    row = rows["psd-fixed-4-d3/dual"]
    assert row["n"] == 6
    assert row["accuracy"] == sum(is_correct(r.text, e) for r, e in zip(results, examples)) / 6
    assert row["correct_by_problem"] == "".join(str(int(is_correct(r.text, e))) for r, e in zip(results, examples))
    assert row["nfe_per_prompt"] == sum(r.nfe for r in results) / 6
    assert row["tokens"] == sum(r.tokens for r in results)
    assert row["tpf"] == pytest.approx(row["tokens"] / sum(r.nfe for r in results))
    assert sum(row["accepted_depth"]) > 0 and len(row["accepted_depth"]) == 4
    base = rows["fixed-1/none"]
    assert base["speedup_tpf"] == base["speedup_tokens_per_second"] == 1.0 and base["accuracy_difference"] == 0
    assert row["speedup_tpf"] == pytest.approx(row["tpf"] / base["tpf"])
    assert row["speedup_tokens_per_second"] == pytest.approx(row["tokens_per_second"] / base["tokens_per_second"])
    # The speed interval resamples the two interleaved batches: its ends are ratios of whole batches.
    assert len(row["batch_seconds"]) == len(row["batch_tokens"]) == 2 and sum(row["batch_tokens"]) == row["tokens"]
    assert sum(row["batch_seconds"]) == pytest.approx(row["seconds"])
    per_batch = [
        (t / s) / (bt / bs)
        for t, s, bt, bs in zip(row["batch_tokens"], row["batch_seconds"], base["batch_tokens"], base["batch_seconds"])
    ]
    low, high = row["speedup_tokens_per_second_interval"]
    assert low == pytest.approx(min(per_batch)) and high == pytest.approx(max(per_batch))
    pair = bench.paired_difference(base["correct_by_problem"], row["correct_by_problem"])
    assert (row["accuracy_difference"], row["accuracy_standard_error"]) == (pair["difference"], pair["standard_error"])

    # The calls by shape are the two batches' together; the latency is of the first 2 problems alone.
    def counts(calls):
        return sorted((c["kind"], c["candidates"], c["positions"], c["batch"], c["count"]) for c in calls)

    summed = {}
    for batch in batches:
        for c in batch[0].calls:
            key = (c["kind"], c["candidates"], c["positions"], c["batch"])
            summed[key] = summed.get(key, 0) + c["count"]
    assert counts(row["calls"]) == sorted((*k, n) for k, n in summed.items())
    assert row["latency_n"] == 2 and 0 < row["latency_p50"] <= row["latency_p95"]
    assert row["speedup_latency"] == pytest.approx(base["latency_p50"] / row["latency_p50"])


def test_bench_rejects_an_unknown_decoder_setting(capsys, tmp_path):
    assert bench.main(["--decoders", "fixed-3x", "--out", str(tmp_path)]) == 2
    assert "fixed-3x: unknown setting name 'fixed-3x'" in capsys.readouterr().err
    assert bench.main(["--decoders", "fixed-1/fast", "--out", str(tmp_path)]) == 2
    assert "fixed-1/fast: unknown cache 'fast': none, prefix or dual, then +vN" in capsys.readouterr().err
    assert bench.main(["--decoders", "threshold-0.9/prefix+v4", "--out", str(tmp_path)]) == 2
    assert "vicinity=4 would be ignored: it is used only with cache 'dual'" in capsys.readouterr().err
    assert bench.main(["--decoders", "recommended/none", "--out", str(tmp_path)]) == 2
    assert "recommended/none: recommended brings its own cache" in capsys.readouterr().err


def test_bench_default_run_is_the_matrix_without_the_opt_in_settings(capsys):
    assert bench.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    names = bench.matrix_names()
    assert len(listed) == len(names) + 1 == 35 and listed[-1] == "recommended (only with --all or --decoders)"
    opt_in = [line.split()[0] for line in listed if line.endswith("(only with --all or --decoders)")]
    assert opt_in == sorted(bench.OPT_IN, key=[*names, "recommended"].index) and len(opt_in) == 13
    matrix = bench.decoder_matrix(DecodeConfig(gen_length=48, block_length=16))
    assert matrix["schedule-0.95/none"].steps_per_block == 16  # LLaDA2.0's default: block_length steps per block


def test_bench_builds_only_the_settings_asked_for(capsys):
    """At block length 1, fixed-1 is a valid setting though fixed-2's 24 steps cannot cover 48
    blocks: only a setting that is asked for is built, and a bad one fails early, naming why."""
    matrix = bench.decoder_matrix(DecodeConfig(gen_length=48, block_length=1, cache="dual"), ["fixed-1"])
    assert list(matrix) == ["fixed-1/dual"] and (matrix["fixed-1/dual"].steps, matrix["fixed-1/dual"].block_length) == (
        48,
        1,
    )
    assert bench.main(["--block-length", "1", "--decoders", "fixed-2"]) == 2
    assert "steps 24 is not divisible by the number of blocks 48" in capsys.readouterr().err


def test_settings_take_each_batch_in_turn(monkeypatch):
    """Every setting decodes a batch before any setting decodes the next, and likewise each latency
    problem: a slow phase of the machine falls on every setting, not on whichever ran then."""
    order = []

    def add_batch(lm, row, settings, chunk, chat, bucket):
        order.append((row.name, [ex["question"] for ex in chunk]))
        row.correct_by_problem += [1] * len(chunk)
        row.tokens, row.nfe, row.seconds = row.tokens + len(chunk), row.nfe + 1, row.seconds + 1.0

    def add_latency(lm, row, settings, example, chat, bucket):
        order.append((row.name, example["question"]))
        row.latency.append(1.0)

    monkeypatch.setattr(bench, "add_batch", add_batch)
    monkeypatch.setattr(bench, "add_latency", add_latency)
    matrix = bench.decoder_matrix(DecodeConfig(gen_length=48, block_length=16), ["fixed-1/none", "fixed-2/dual"])
    examples = [{"question": q} for q in "abc"]
    args = type("Args", (), {"batch": 2, "chat": None, "prompt_bucket": 32, "latency": 2})()
    summaries = bench.run_matrix(None, matrix, examples, args)
    assert order == [
        ("fixed-1/none", ["a", "b"]),
        ("fixed-2/dual", ["a", "b"]),
        ("fixed-1/none", ["c"]),
        ("fixed-2/dual", ["c"]),
        ("fixed-1/none", "a"),
        ("fixed-2/dual", "a"),
        ("fixed-1/none", "b"),
        ("fixed-2/dual", "b"),
    ]
    assert [s["n"] for s in summaries] == [3, 3] and [s["latency_n"] for s in summaries] == [2, 2]


def test_paired_difference_counts_the_discordant_problems():
    """B − A over the same problems, with the paired standard error sd(b_i − a_i) / sqrt(n)."""
    p = bench.paired_difference("1100110", "1010111")
    assert (p["n"], p["only_a"], p["only_b"]) == (7, 1, 2)
    assert p["difference"] == pytest.approx(1 / 7)
    d = np.array([0, -1, 1, 0, 0, 0, 1], float)
    assert p["standard_error"] == pytest.approx(d.std(ddof=1) / np.sqrt(7))
    with pytest.raises(InputError, match="different problem counts"):
        bench.paired_difference("101", "10")


def test_table_without_the_baseline_leaves_speedups_blank():
    """Rows without the baseline have nothing to measure speedups against: "–", not "nanx"."""
    row = bench.Row("fixed-4/dual", {}, nfe=10, tokens=20, seconds=2.0, correct_by_problem=[1, 0]).summary()
    line = bench.markdown_table(bench.with_speedups([row])).splitlines()[2]
    assert line == "| fixed-4/dual | 10.0 | – | 50.0% | – | 2.00 | – | 5.0 | – | – | 0.0 |"


def test_bench_recommended_runs_the_directorys_setting_with_its_own_cache(
    monkeypatch, tmp_path, tuned_model_dir, tuned_lm
):
    """``--decoders recommended`` decodes the directory's recommended.json on the bench's length:
    its block length over decode_defaults.json, its cache (none) over the bench's default dual."""
    from conftest import TUNED

    monkeypatch.setattr("psd_jax.api.load_model", lambda *a, **k: tuned_lm)
    args = ["--model", str(tuned_model_dir), "--limit", "8", "--batch", "8", "--out", str(tmp_path)]
    assert bench.main([*args, "--decoders", "recommended"]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["cache"] == "dual"  # the matrix's base
    baseline, row = report["results"]
    assert baseline["name"] == "fixed-1/none"
    assert report["meta"]["recommended"] == f"tuned, from {tuned_model_dir / 'recommended.json'}"
    tuned = DecodeConfig(gen_length=48, **TUNED)
    assert row["name"] == "recommended" and row["settings"] == dict(vars(tuned))
    examples = load_jsonl(tuned_model_dir / "test.jsonl")[:8]
    results = tuned_lm.generate([e["question"] for e in examples], tuned, chat=True)
    assert row["nfe_per_prompt"] == sum(r.nfe for r in results) / 8 and row["tokens"] == sum(r.tokens for r in results)
    assert row["correct_by_problem"] == "".join(str(int(is_correct(r.text, e))) for r, e in zip(results, examples))
    # Flags given on the command line still override it (bench's settings, made as every front end's).
    fields = {"block_length": 16, "cache": "dual", "gen_length": 48}
    settings, _ = checked_settings(tuned_model_dir, fields, "recommended")
    assert settings == tuned.replace(block_length=16, cache="dual")
