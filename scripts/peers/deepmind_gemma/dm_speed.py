"""DiffusionGemma decoding with DeepMind's own JAX sampler (google-deepmind/gemma, ``gemma.diffusion``),
on psd-jax's weights and settings: the peer side of ``scripts/figures/diffusion_gemma_speed.py``.

Runs in the gemma venv (Python 3.12, gemma at 7691fd4, jax 0.10.2 CPU):

    JAX_PLATFORMS=cpu PEER_VENV/bin/python scripts/peers/deepmind_gemma/dm_speed.py \\
        --shape tiny|100m [--batch 1] [--runs 5] [--steps 16] [--gen-length 64]

Weights: build/peers/weights/<shape>/ from export_weights.py (psd-jax's converted parameters of
the tiny checkpoint, or of the random ~100M model transformers builds from ``config_100m`` after
``torch.manual_seed(0)``), mapped into DeepMind's param tree by dm_params.py (shape asserted per
key). The layer ``skip_scale`` is the checkpoint's denoiser scalar (DeepMind has one per layer;
the values do not change the work done).

What is timed: the public ``gemma.diffusion.Sampler.sample`` (prompt -> prefill -> the jitted
canvas loop -> output), with a token-id "tokenizer" (a prompt is its ids as text, the BOS added by
the sampler as for any first turn), ``pad_length=None`` (no prompt bucketing),
``cache_length = prompt + max_new_tokens`` (the denoiser attends over the whole fixed cache, so a
larger one costs more), ``max_out_length = max_new_tokens``, entropy-bound acceptance 0.1,
temperatures 0.8 -> 0.4 (the release's generation_config), ``NoEarlyStop`` (adaptive stopping
off), end tokens outside the vocabulary (no row ends early): every canvas runs exactly
``--steps`` denoiser calls, ``gen_length / canvas_length`` canvases, as on psd-jax's side.
Prompts: psd-jax's script's (seeded numpy: BOS then 31 ids in [3, 500)). One warm-up call
(compilation) is reported apart; then ``--runs`` timed calls, each ending in
``jax.block_until_ready`` on the output tokens. Also timed: the jitted canvas loop alone
(``DiffusionSampler.sample`` after one prefill), to separate the prefill and Python around it.
Output: one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
WEIGHTS = Path(__file__).resolve().parents[3] / "build" / "peers" / "weights"


def make_tokenizer(vocab_size: int):
    """A tokenizer whose text is space-separated token ids (BOS 2, PAD 0; every stop id >= vocab)."""
    import dialog
    from gemma.gm.text import _tokenizer

    class Special(_tokenizer.SpecialTokens):
        PAD = 0
        EOS = vocab_size  # never sampled: ids are drawn in [0, vocab)
        BOS = 2
        UNK = 3
        MASK = 4
        CUSTOM = 5
        START_OF_TURN = vocab_size + 1
        END_OF_TURN = vocab_size + 2
        START_OF_IMAGE = vocab_size + 3
        END_OF_IMAGE = vocab_size + 4
        BEGIN_OF_TOOL_RESPONSE = vocab_size + 5
        END_OF_TOOL_RESPONSE = vocab_size + 6

    @dataclasses.dataclass(frozen=True)
    class IdTokenizer:
        vocab_size: int
        VERSION = None
        FORBIDDEN_TOKENS = ()
        FORMAT = dialog.Format.GEMMA3
        special_tokens = Special

        def encode(self, text, *, add_bos=False, add_eos=False):
            ids = [int(t) for t in text.split()]
            return ([self.special_tokens.BOS] if add_bos else []) + ids + ([self.special_tokens.EOS] if add_eos else [])

        def decode(self, ids):
            return " ".join(str(int(i)) for i in np.asarray(ids).ravel())

    return IdTokenizer(vocab_size)


def prompts(batch: int) -> list[str]:
    """psd-jax's speed script's prompts (BOS + 31 ids), as text without the BOS the sampler adds."""
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.full((batch, 1), 2), rng.integers(3, 500, (batch, 31))], axis=1)
    return [" ".join(str(int(t)) for t in row[1:]) for row in ids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("tiny", "100m"), default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="max_denoising_steps")
    parser.add_argument("--gen-length", type=int, default=64, help="max_new_tokens (whole canvases)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--cache-length", type=int, default=None, help="default: prompt + gen-length")
    parser.add_argument("--weights", type=Path, default=None, help="default: build/peers/weights/<shape>")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from dm_params import load
    from gemma import diffusion
    from gemma.gm.text import _prefill
    from gemma.gm.utils import _types

    model, params, _, c = load(args.weights or WEIGHTS / args.shape, dtype=jnp.dtype(args.dtype))
    canvas = c["canvas_length"]
    if args.gen_length % canvas:
        parser.error(f"--gen-length must be whole canvases of {canvas}")
    texts = prompts(args.batch)
    prompt_len = 1 + len(texts[0].split())
    cache_length = args.cache_length or prompt_len + args.gen_length
    tokenizer = make_tokenizer(c["vocab_size"])
    sampler = diffusion.Sampler(
        model=model,
        params=params,
        tokenizer=tokenizer,
        cache_length=cache_length,
        max_out_length=args.gen_length,
        pad_length=None,
        canvas_length=canvas,
        max_denoising_steps=args.steps,
        sample_from_predictions=diffusion.SampleFromPredictions(entropy_bound=0.1),
        logit_shaper=diffusion.AnnealingTemperatureShaperConfig(max_temperature=0.8, min_temperature=0.4).make(),
        early_stop_fn=diffusion.NoEarlyStop(),
    )

    def run(seed: int) -> float:
        start = time.perf_counter()
        out = sampler.sample(texts, max_new_tokens=args.gen_length, rng=seed, return_state=True)
        jax.block_until_ready(out.state.predicted_tokens)
        elapsed = time.perf_counter() - start
        assert int(out.state.step) == args.gen_length, int(out.state.step)  # every canvas decoded
        assert out.state.predicted_tokens.shape == (args.batch, args.gen_length)
        return elapsed

    compile_s = run(0)
    seconds = [run(r + 1) for r in range(args.runs)]

    # The jitted canvas loop alone (DiffusionSampler.sample), after one prefill outside the clock.
    loop = sampler._initialize_sampler_loop(sampler.sampling)
    ids = jnp.asarray([tokenizer.encode(t, add_bos=True) for t in texts], jnp.int32)
    inp = _types.Input(text=ids, images=None, config=model.config.input_config)
    init = _prefill.prefill(
        model=model, params=params, input=inp, last_state=None, cache_length=cache_length,
        max_out_length=args.gen_length, pad_length=None, rng=jax.random.key(0), sharding=None,
    )  # fmt: skip
    n_new = jnp.asarray(args.gen_length)
    jax.block_until_ready(loop.sample(params=params, init_state=init, max_new_tokens=n_new).predicted_tokens)
    loop_seconds = []
    for r in range(args.runs):
        state = dataclasses.replace(init, rng=jax.random.key(r + 1))
        start = time.perf_counter()
        jax.block_until_ready(loop.sample(params=params, init_state=state, max_new_tokens=n_new).predicted_tokens)
        loop_seconds.append(time.perf_counter() - start)

    positions = args.batch * args.gen_length
    med, loop_med = statistics.median(seconds), statistics.median(loop_seconds)
    with np.load((args.weights or WEIGHTS / args.shape) / "params.npz") as z:
        n_params = int(sum(z[k].size for k in z.files if not k.endswith("_scalar")))
    print(json.dumps({
        "side": "deepmind_gemma_7691fd4",
        "shape": args.shape,
        "text_parameters": n_params,
        "batch": args.batch,
        "settings": {"prompt_length": prompt_len, "max_new_tokens": args.gen_length, "canvas_length": canvas,
                     "max_denoising_steps": args.steps, "adaptive_stopping": False, "entropy_bound": 0.1,
                     "t_max": 0.8, "t_min": 0.4, "cache_length": cache_length, "dtype": args.dtype},
        "first_call_seconds": round(compile_s, 3),
        "seconds_median": round(med, 4),
        "positions_per_s": round(positions / med, 1),
        "loop_only_seconds_median": round(loop_med, 4),
        "loop_only_positions_per_s": round(positions / loop_med, 1),
        "runs_seconds": [round(s, 4) for s in seconds],
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
