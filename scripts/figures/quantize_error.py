"""Quantized logits against the upstream float32 goldens, and what the kept weights weigh.

Why: to choose and state what stays in the model dtype (``models.quantize``) from measurements.
For each tiny golden checkpoint and int8 / int4, the goldens' forward inputs (2 x 300 tokens; 2 x
48 bidirectional for LLaDA2.0) through the quantized model: the largest |logit error| relative to
the largest |logit|, the second largest (one position whose routed experts change moves far more
than the rest), the median and top-1 agreement; with ``--head`` the output head is quantized too
(as a projection of the same kind: one scale per output channel, int4 per 32 rows). ``--sizes``
splits a real config's parameters into the quantized weights and the kept ones.

    python -m scripts.figures.quantize_error [--head] [--sizes LLaDA2.0-mini]

Its figures are in docs/quantization.md.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
GOLDENS = SHARED / "goldens"
# checkpoint: (cases file, forward prefix)
CHECKPOINTS = {
    "llada-tiny": ("cases.safetensors", "llada-tiny.forward"),
    "llada-tiny-gqa": ("cases.safetensors", "llada-tiny-gqa.forward"),
    "dream-tiny": ("cases.safetensors", "dream-tiny.forward"),
    "llada2-tiny": ("llada2_cases.safetensors", "llada2-tiny.forward_full"),
}


def errors(name: str, quantize: str, head: bool) -> dict:
    import jax
    import numpy as np
    import qwix
    from flax import nnx
    from safetensors.numpy import load_file

    from models.quantize import quantize_weight
    from psd_jax import load_model

    cases, prefix = CHECKPOINTS[name]
    golden = load_file(str(GOLDENS / cases))
    ids, want = golden[f"{prefix}.input_ids"], golden[f"{prefix}.logits"]
    lm = load_model(GOLDENS / name, quantize=quantize, unroll_layers=False)
    if head:
        weight = lm.model.lm_head.get_value()
        lm.model.lm_head.set_value(qwix.dequantize(quantize_weight(weight, quantize)))
        graphdef, params = nnx.split(lm.model)
        got = np.asarray(jax.jit(lambda p, i: nnx.merge(graphdef, p)(i))(params, ids))
    else:
        got = np.asarray(lm.logits(ids))
    err = np.sort((np.abs(got - want).max(axis=-1) / np.abs(want).max()).ravel())
    return {
        "checkpoint": name,
        "quantize": quantize,
        "head": head,
        "max": float(err[-1]),
        "second": float(err[-2]),
        "median": float(np.median(err)),
        "top1": float((got.argmax(-1) == want.argmax(-1)).mean()),
    }


def sizes(model: str) -> dict:
    from models import LLaDA2Config, param_shapes
    from models.quantize import is_projection
    from scripts.figures.memory_table import MODELS, model_config

    cfg = model_config(MODELS[model])
    shapes = param_shapes(cfg)
    kinds: dict[str, int] = {}
    for name, shape in shapes.items():
        if is_projection(name):
            kind = "quantized"
        elif name in ("embed", "lm_head"):
            kind = name
        elif isinstance(cfg, LLaDA2Config) and name.endswith(("router", "expert_bias")):
            kind = "router and expert bias"
        else:
            kind = "norms and biases"
        kinds[kind] = kinds.get(kind, 0) + math.prod(shape)
    scales = sum(math.prod(shape) // shape[-2] for name, shape in shapes.items() if is_projection(name))
    return {"model": model, "parameters": sum(kinds.values()), "by_kind": kinds, "int8_scales": scales}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", action="store_true", help="quantize the output head too")
    parser.add_argument(
        "--sizes", default="", help="a real model of scripts.figures.memory_table.MODELS (e.g. LLaDA2.0-mini)"
    )
    args = parser.parse_args()
    print("| checkpoint | weights | head | max error / max logit | second largest | median | top-1 |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for name in CHECKPOINTS:
        for quantize in ("int8", "int4"):
            r = errors(name, quantize, args.head)
            print(
                f"| {name} | {quantize} | {'quantized' if args.head else 'kept'} | {r['max']:.3f} | "
                f"{r['second']:.3f} | {r['median']:.4f} | {100 * r['top1']:.1f}% |"
            )
    if args.sizes:
        print(json.dumps(sizes(args.sizes), indent=1))


if __name__ == "__main__":
    main()
