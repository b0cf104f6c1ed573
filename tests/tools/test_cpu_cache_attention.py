"""``scripts/figures/cpu_cache_attention.py`` on a toy model: both cache-attention forms timed for every
window shape the decoders make, and in float32 their logits agree (they differ only in summation order)."""

from __future__ import annotations

from scripts.figures import cpu_cache_attention


def test_both_forms_are_timed_for_every_shape_and_agree_in_float32(capsys):
    tiny = ["--layers", "1", "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "128"]
    assert cpu_cache_attention.main(["--dtype", "float32", "--calls", "1", *tiny]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0][2:] for row in rows] == list(cpu_cache_attention.SHAPES)
    for row in rows:
        joined_ms, apart_ms, ratio, difference = row.strip(" |").split(" | ")[2:]
        assert float(joined_ms) > 0 and float(apart_ms) > 0 and ratio.endswith("x")
        assert float(difference) < 1e-4, row
