"""Answers: how fast does a model shape learn the calculator lines' arithmetic? (in minutes)

Trains a fresh model of the default architecture on calculator drills only (``make_drills`` of
``scripts.default_model.train``, same objective and optimiser) and, every ``--every`` steps, scores
the digits of every line's result with everything else of the answer visible, on 256 fixed drills.
The shipped model's accuracy is bounded by this (docs/default-model.md), so a change of shape,
initialisation or learning rate can be judged here in minutes instead of in an hour-long training
run.

    python -m scripts.experiments.drill_speed --steps 400 --every 100 [--layers 4 --d-model 128 --lr 3e-3]
    python -m scripts.experiments.drill_speed --score models/default    # the same score of a trained model
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import AutoTokenizer

from models import DiffusionLM
from psd_jax.api import load_model
from scripts.default_model.train import (
    DRILL_GEN_LENGTH,
    add_model_args,
    encode_batch,
    fits,
    make_drills,
    make_optimizer,
    make_train_step,
    model_config,
)


def result_digit_mask(tok, drills: list[dict], width: int) -> np.ndarray:
    """[B, width] True at the tokens of each line's result (answers start at width - DRILL_GEN_LENGTH)."""
    mask = np.zeros((len(drills), width), bool)
    for row, drill in enumerate(drills):
        spans, pos = [], 0
        for line in drill["answer"].split("\n"):
            spans.append((pos + line.index("= ") + 2, pos + len(line)))
            pos += len(line) + 1
        offsets = tok(drill["answer"], add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        for j, (s, e) in enumerate(offsets):
            mask[row, width - DRILL_GEN_LENGTH + j] = any(s >= a and e <= b for a, b in spans)
    return mask


def make_scorers(tok, cfg, graphdef) -> dict:
    """Per drill kind (listed, unlisted): (a jitted prediction of held-out drills with their
    result digits masked, their ids, the result digits' mask)."""
    # encode_batch would skip (and so misalign the result mask of) a drill that does not fit
    scorers = {}
    for listed in (True, False):
        held = [d for d in make_drills(260, seed=10**6, listed=listed) if fits(tok, d, DRILL_GEN_LENGTH)][:256]
        ids, attn = encode_batch(tok, held, cfg.eos_id, cfg.pad_id, DRILL_GEN_LENGTH)
        results = result_digit_mask(tok, held, ids.shape[1])
        noisy, attn = jnp.asarray(np.where(results, cfg.mask_id, ids)), jnp.asarray(attn)
        predict = jax.jit(lambda p, noisy=noisy, attn=attn: nnx.merge(graphdef, p)(noisy, attn).argmax(-1))
        scorers["listed" if listed else "unlisted"] = (predict, ids, results)

    return scorers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="models/default")
    parser.add_argument("--score", metavar="MODEL_DIR", help="only score this trained model's result digits")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--unlisted", action="store_true", help="train on drills whose question does not list the expressions"
    )
    add_model_args(parser)
    args = parser.parse_args()

    tok = AutoTokenizer.from_pretrained(args.score or args.tokenizer)
    if args.score:
        model = load_model(args.score).model
        cfg = model.config
    else:
        cfg = model_config(tok, args)
        model = DiffusionLM(cfg, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)

    scorers = make_scorers(tok, cfg, graphdef)

    def score(params) -> str:
        return ", ".join(
            f"{name} {(np.asarray(predict(params)) == ids)[results].mean():.1%}"
            for name, (predict, ids, results) in scorers.items()
        )

    digits = ", ".join(f"{name} {int(results.sum())}" for name, (_, _, results) in scorers.items())
    print(f"model: {cfg.param_count():,} parameters; result digits scored: {digits}", flush=True)
    if args.score:
        print(f"{args.score}: result digits {score(params)}")
        return
    optimizer = make_optimizer(args.lr, args.steps, warmup=min(100, args.steps // 4))
    opt_state = optimizer.init(params)
    train_step = make_train_step(graphdef, optimizer, cfg.mask_id, DRILL_GEN_LENGTH)
    key, start = jax.random.key(args.seed), time.time()
    for step in range(1, args.steps + 1):
        batch_ids, batch_attn = encode_batch(
            tok,
            make_drills(args.batch, seed=args.seed * 10**6 + step, listed=not args.unlisted),
            cfg.eos_id,
            cfg.pad_id,
            DRILL_GEN_LENGTH,
        )
        key, sub = jax.random.split(key)
        params, opt_state, loss, _ = train_step(params, opt_state, batch_ids, batch_attn, sub)
        if step % args.every == 0:
            print(
                f"step {step} loss {float(loss):.3f} result digits {score(params)} {time.time() - start:.0f}s",
                flush=True,
            )


if __name__ == "__main__":
    main()
