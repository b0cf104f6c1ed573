"""``scripts/figures/bonsai_peer.py`` without bonsai (its environment is never the project's): the
psd-jax rows it runs, its token comparison and its table, on a made-up report."""

from __future__ import annotations

from paths import GOLDENS

from psd_jax import DecodeConfig
from psd_jax.model_dir import DEFAULT_MODEL_DIR
from psd_jax.recommended import read_recommended
from scripts.figures import bonsai_peer


def test_the_psd_jax_rows_are_generate_py_its_default_mask_rule_the_recommended_fields_and_names():
    rows = bonsai_peer.psd_settings(64, ("threshold-0.99/dual+v4/b16",))
    upstream = DecodeConfig(gen_length=64, block_length=32, steps=64, eos_early_stop=False, predict_mask=True)
    assert rows["generate.py rule"] == upstream
    assert rows["default mask rule"] == upstream.replace(predict_mask=False)
    shipped = read_recommended(DEFAULT_MODEL_DIR, "cpu").settings
    assert rows["recommended"] == DecodeConfig(gen_length=64, eos_early_stop=False, **shipped)
    dual = rows["threshold-0.99/dual+v4/b16"]
    assert (dual.threshold, dual.cache, dual.vicinity, dual.block_length, dual.eos_early_stop) == (
        0.99,
        "dual",
        4,
        16,
        False,
    )


def test_prompts_avoid_the_special_ids_and_the_table_reports_token_equality():
    prompts = bonsai_peer.prompts_for(GOLDENS / "llada-tiny", 2, 24, 10)
    assert len(prompts) == 2 and all(len(p) == 24 and not {500, 501} & set(p) for p in prompts)

    def row(variant, tokens, seconds):
        return {"model": "m", "variant": variant, "tokens": tokens, **bonsai_peer.timing(seconds, 3.0, 4)}

    psd = [row("generate.py rule", [[1, 500, 2, 3]], [0.1, 0.2]), row("default mask rule", [[1, 7, 2, 3]], [0.1])]
    psd = [{**r, "nfe": [4]} for r in psd]
    bonsai = [row("shipped", None, [1.0, 2.0, 3.0]), row("jit", None, [0.5])]
    forwards = [row(f"forward {v}", None, [0.01]) for v in ("psd-jax", "shipped", "jit")]
    record = {"calls": {f"m/{v}": {"tokens": [[1, 500, 2, 3]], "seconds": []} for v in ("shipped", "jit")}}
    model = {"label": "m", "dir": "/m", "params": 1e6, "batch": 1, "prompt_length": 4, "gen_length": 4}
    report = bonsai_peer.report_of({"repeats": 2}, [model], psd + bonsai + forwards, record)
    assert [(c["psd_jax"], c["bonsai"], c["equal"], c["positions_differ"]) for c in report["comparison"]] == [
        ("generate.py rule", "shipped", True, 0),
        ("generate.py rule", "jit", True, 0),
        ("default mask rule", "shipped", False, 1),
        ("default mask rule", "jit", False, 1),
    ]
    lines = bonsai_peer.markdown(report).splitlines()
    generate_py, default, shipped = (
        next(x for x in lines if x.startswith(f"| {label}"))
        for label in ("psd-jax, generate.py", "psd-jax, default", "bonsai as shipped")
    )
    assert generate_py.endswith("| 26.7 | 13.33x | 3.33x | yes |")  # 4 tokens in 0.15 s; bonsai: 2 s and 0.5 s
    assert default.endswith("| no |") and shipped.endswith("| 2.0 | 1.00x | 0.25x | — |")
    assert "| bonsai, in `jax.jit` | 3.00 | 10.0 | 10.0–10.0 |" in lines  # one forward alone
