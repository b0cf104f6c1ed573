"""Answers: how fast does a small model learn the arithmetic fact table, and what slows it?

Seconds per try (docs/default-model.md).

The 512 facts ``a op b = c`` with a, b, c in [1, 20] (the table every calculator line of the
default model's task draws from), each number one token, trained with the default model's
optimiser in one of three forms:

- ``clean``: only ``c`` is masked and scored (a plain lookup, the upper bound);
- ``diffusion``: the whole row ``a op b = c`` is the response of the masked diffusion objective
  (t ~ U(0, 1], 1/t weight), so ``a``, ``op`` and ``b`` are often masked when ``c`` is;
- ``prompt``: as ``diffusion``, but the expression is also in an always-visible prompt (as in
  the calculator drills' questions).

Every ``--every`` steps: accuracy of ``c`` on all 512 facts with ``a op b =`` visible.

    python -m scripts.experiments.fact_table_speed --mode diffusion --layers 2 --steps 1000
"""

from __future__ import annotations

import argparse
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import DiffusionLM, ModelConfig
from scripts.default_model.train import add_model_args, make_optimizer

PAD, BOS, MASK, EQUALS, SEPARATOR = 0, 1, 2, 7, 8
OPERATORS = {"+": 3, "-": 4, "*": 5, "/": 6}
NUMBER = 10  # token of the number n is NUMBER + n
VOCAB = 64


def fact_table(max_value: int = 20) -> list[tuple[int, str, int, int]]:
    """Every ``a op b = c`` with a, b, c in [1, max_value] and c whole."""
    facts = []
    for a in range(1, max_value + 1):
        for b in range(1, max_value + 1):
            for op, c in (("+", a + b), ("-", a - b), ("*", a * b), ("/", a / b)):
                if c == int(c) and 1 <= c <= max_value:
                    facts.append((a, op, b, int(c)))
    return facts


def encode(facts, mode: str) -> np.ndarray:
    rows = []
    for a, op, b, c in facts:
        line = [NUMBER + a, OPERATORS[op], NUMBER + b, EQUALS, NUMBER + c]
        prompt = [NUMBER + a, OPERATORS[op], NUMBER + b, SEPARATOR] if mode == "prompt" else []
        rows.append([BOS, *prompt, *line])
    return np.asarray(rows, np.int32)


def make_step(graphdef, optimizer, mode: str, eps: float = 1e-3):
    def loss_fn(params, ids, key):
        model = nnx.merge(graphdef, params)
        if mode == "clean":
            logits = model(ids.at[:, -1].set(MASK), jnp.ones_like(ids))[:, -1]
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, -1]).mean()
        t_key, m_key = jax.random.split(key)
        start = ids.shape[1] - 5  # the response is the line a op b = c
        u = (jnp.arange(ids.shape[0]) + jax.random.uniform(t_key)) / ids.shape[0]
        t = (eps + (1.0 - eps) * u)[:, None]
        response = ids[:, start:]
        masked = jax.random.uniform(m_key, response.shape) < t
        noisy = ids.at[:, start:].set(jnp.where(masked, MASK, response))
        ce = optax.softmax_cross_entropy_with_integer_labels(model(noisy, jnp.ones_like(ids))[:, start:], response)
        return jnp.sum(ce * masked / t) / response.size

    @jax.jit
    def step(params, opt_state, ids, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="diffusion", choices=["clean", "diffusion", "prompt"])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    add_model_args(parser)
    args = parser.parse_args()

    cfg = ModelConfig(
        family="llada",
        vocab_size=VOCAB,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        mlp_hidden=args.mlp,
        rope_theta=10000.0,
        norm_eps=1e-5,
        max_length=64,
        mask_id=MASK,
        eos_id=PAD,
        pad_id=PAD,
    )
    graphdef, params = nnx.split(DiffusionLM(cfg, rngs=nnx.Rngs(args.seed)))
    optimizer = make_optimizer(args.lr, args.steps, warmup=min(100, args.steps // 4))
    opt_state = optimizer.init(params)
    step = make_step(graphdef, optimizer, args.mode)

    facts = fact_table()
    table = jnp.asarray(encode(facts, args.mode))
    predict = jax.jit(
        lambda p: nnx.merge(graphdef, p)(table.at[:, -1].set(MASK), jnp.ones_like(table))[:, -1].argmax(-1)
    )
    print(f"{len(facts)} facts, mode {args.mode}, {cfg.param_count():,} parameters", flush=True)
    rng, start = random.Random(0), time.time()
    for i in range(1, args.steps + 1):
        ids = jnp.asarray(encode(rng.choices(facts, k=args.batch), args.mode))
        params, opt_state, loss = step(params, opt_state, ids, jax.random.key(i))
        if i % args.every == 0:
            accuracy = float((predict(params) == table[:, -1]).mean())
            print(
                f"step {i} loss {float(loss):.3f} result accuracy {accuracy:.1%} {time.time() - start:.0f}s", flush=True
            )


if __name__ == "__main__":
    main()
