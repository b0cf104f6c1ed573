"""Train the shipped default model: a small LLaDA-architecture dLLM for multi-step arithmetic.

Masked diffusion objective in LLaDA's SFT form: the prompt (chat-templated question) is kept,
every response token (answer + EOS padding to ``gen_length``) is masked with probability
``t ~ U(eps, 1]``, and the cross-entropy on masked tokens is weighted by one over the row's masked
ratio: its realised ratio (``--loss-weight row-mean``, the shipped recipe: each row's masked
tokens averaged) or LLaDA's expected one, ``1/t`` (``--loss-weight inverse-t``, measured worse:
docs/default-model.md). ``--masking block``: one block per row instead, as the model is decoded;
measured worse. Every third batch is calculator drills (``make_drills``, their own shorter response length) instead of word
problems (``--unlisted-drills``, ``--drill-labels``, ``--chain-drills``: other drill forms,
measured worse or no better). The result is written in the real LLaDA Hugging Face layout
(``config.json`` + ``model.safetensors`` with LLaDA-8B's tensor names) next to the tokenizer, so
it loads through the same converter path as a real checkpoint.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python -m scripts.default_model.train --out models/default --data-parallel

``--data-parallel`` splits every batch over the host's CPU devices (start it with
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` for the two cores): XLA:CPU runs most of a
training step's non-matmul work on one thread, so two devices with half a batch each keep both
cores busier (same loss; gradients averaged over the whole batch).

The defaults are the shipped model's recipe (8,000 steps; with ``--data-parallel`` on two forced
CPU devices, as above, under 60 minutes on 2 CPU cores; without it the same steps, slower, and
the time budget may stop it early).
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from transformers import AutoTokenizer

from convert.export import export_hf
from models import DiffusionLM, ModelConfig
from models.transformer import default_unroll_layers
from psd_jax import DecodeConfig
from psd_jax.api import LoadedModel
from psd_jax.model_dir import DECODE_DEFAULTS_FILE
from psd_jax.parallel.sharding import make_mesh
from psd_jax.scoring import is_correct, load_jsonl
from psd_jax.tokenizer import encode_prompt
from scripts.default_model.tasks import MAX_VALUE, STEP_LINE, calculate, generate_problem, make_dataset

PROMPT_LENGTH = 96  # longest chat-templated prompt trained on (longer ones are skipped)
PROMPT_BUCKET = 16  # training batches are padded to a multiple of this (less wasted compute)
GEN_LENGTH = 48  # answers are at most 41 tokens + EOS
DRILL_GEN_LENGTH = 32  # four drill lines + EOS fit (about 1 drill in 5,000 does not and is skipped)
LABELLED_DRILL_GEN_LENGTH = 40  # four labelled lines + EOS: at most 36 tokens in 3,000 drills
CHAIN_DRILL_GEN_LENGTH = 40  # four chained lines + EOS: at most 33 tokens in 3,000 drills
BLOCK_LENGTH = 16  # the decoding block size the shipped model is evaluated and benchmarked with


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model-shape and seed options (the shipped model's values as defaults)."""
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--mlp", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)


def make_optimizer(lr: float, steps: int, warmup: int) -> optax.GradientTransformation:
    """AdamW with gradient clipping, linear warmup and cosine decay to 5% of ``lr``."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps + 1, end_value=lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98, weight_decay=0.01))


def model_config(tok, args) -> ModelConfig:
    return ModelConfig(
        family="llada",
        vocab_size=len(tok),
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        mlp_hidden=args.mlp,
        rope_theta=10000.0,
        norm_eps=1e-5,
        max_length=512,
        mask_id=tok.mask_token_id,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
    )


def fits(tok, example: dict, gen_length: int) -> bool:
    """Whether the example's prompt and its answer + EOS fit a training row (others are skipped)."""
    prompt = encode_prompt(tok, example["question"], chat=True, source="train")
    return (
        len(prompt) <= PROMPT_LENGTH and len(tok(example["answer"], add_special_tokens=False)["input_ids"]) < gen_length
    )


def encode_batch(
    tok, examples, eos_id: int, pad_id: int, gen_length: int = GEN_LENGTH
) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt + answer + EOS padding to ``gen_length``, as the decoder will see it.

    The prompt part is padded to the batch's longest prompt rounded up to PROMPT_BUCKET, so the
    answer always starts at ``ids.shape[1] - gen_length``.
    """
    prompts, answers = [], []
    for ex in filter(lambda ex: fits(tok, ex, gen_length), examples):
        prompt = encode_prompt(tok, ex["question"], chat=True, source="train")
        answer = tok(ex["answer"], add_special_tokens=False)["input_ids"] + [eos_id]
        prompts.append(prompt)
        answers.append(answer + [eos_id] * (gen_length - len(answer)))
    length = -(-max(len(p) for p in prompts) // PROMPT_BUCKET) * PROMPT_BUCKET
    ids = np.full((len(prompts), length + gen_length), pad_id, np.int32)
    mask = np.zeros_like(ids)
    for row, (prompt, answer) in enumerate(zip(prompts, answers)):
        ids[row, length - len(prompt) :] = prompt + answer
        mask[row, length - len(prompt) :] = 1
    return ids, mask


def _spoken_list(items: list[str]) -> str:
    """``a, b and c``: how a drill question lists its lines."""
    return ", ".join(items[:-1]) + " and " + items[-1]


def make_drills(n: int, seed: int, lines: int = 4, labelled: bool = False, listed: bool = True) -> list[dict]:
    """Calculator drills: ``lines`` unrelated lines of generated problems, the question listing
    their expressions, the answer working them out. Short rows that teach the lines' arithmetic
    (the part a word problem's loss teaches slowest) at a fraction of a word problem's cost. Each
    line comes from a different problem, so the question never spells out a chain's results.
    ``labelled``: the answer lines keep their problem's label word (``hens 5 * 4 = 20``), so they
    look exactly like a word problem's lines. ``listed=False``: the question does not list the
    expressions (only the answer's lines hold them), so a result can only be worked out from its
    own line's operands, as in a word problem."""
    rng = random.Random(seed)
    drills = []
    for _ in range(n):
        chosen = [
            rng.choice([m for m in map(STEP_LINE.match, generate_problem(rng)["answer"].splitlines()) if m])
            for _ in range(lines)
        ]
        expressions = [f"{m[1]} {m[2]} {m[3]}" for m in chosen]
        drills.append(
            {
                "question": f"Work out {_spoken_list(expressions)}."
                if listed
                else f"Work out {lines} calculator lines.",
                "answer": "\n".join(m[0] if labelled else f"{e} = {m[4]}" for e, m in zip(expressions, chosen)),
            }
        )
    return drills


def make_chain_drills(n: int, seed: int, lines: int = 4) -> list[dict]:
    """Chained calculator drills: the question gives a start value and each line's operation and
    second operand ("Start with 7, then + 5, - 3, * 2 and / 6."); the answer works the chain out
    line by line, each line's first operand the previous line's result ("7 + 5 = 12", "12 - 3 =
    9", ...). As in a word problem, a later line's first operand is only in the answer, so its
    result cannot be read off the question (the listed drills' shortcut), and every value lies in
    [1, MAX_VALUE]. Mixed half and half with listed drills they made the model worse (docs/default-model.md)."""
    rng = random.Random(seed)
    drills = []
    for _ in range(n):
        value = rng.randint(1, MAX_VALUE)
        start, steps, answer = value, [], []
        for _ in range(lines):
            choices = [
                (op, b, r)
                for op in "+-*/"
                for b in range(1, MAX_VALUE + 1)
                if (r := calculate(value, op, b)) is not None and 1 <= r <= MAX_VALUE and not (op in "*/" and b == 1)
            ]
            op, b, result = rng.choice(choices)
            steps.append(f"{op} {b}")
            answer.append(f"{value} {op} {b} = {result}")
            value = result
        drills.append({"question": f"Start with {start}, then {_spoken_list(steps)}.", "answer": "\n".join(answer)})
    return drills


def prefetch(make_batch, depth: int = 4):
    """Yield ``make_batch()`` results built by a background thread: generating problems is Python
    work that would otherwise stall the training step (the jitted step releases the GIL)."""
    q: queue.Queue = queue.Queue(maxsize=depth)

    def work() -> None:
        while True:
            q.put(make_batch())

    threading.Thread(target=work, daemon=True).start()
    while True:
        yield q.get()


def mask_probabilities(t: jax.Array, gen_length: int, block_length: int | None, block: jax.Array) -> jax.Array:
    """[B, gen_length] probability that each response token is masked in a training row.

    ``block_length=None``: LLaDA's SFT form, every response token masked with probability ``t``.
    Otherwise the semi-autoregressive form the model is decoded with: the row's ``block`` is masked
    with probability ``t``, the blocks before it are clean, the blocks after it fully masked (as
    the decoder sees them while it works on that block).
    """
    if block_length is None:
        return jnp.broadcast_to(t, (t.shape[0], gen_length))
    position_block = (jnp.arange(gen_length) // block_length)[None]
    return jnp.where(position_block < block, 0.0, jnp.where(position_block == block, t, 1.0))


def masked_loss(ce: jax.Array, masked: jax.Array, t: jax.Array, scored_length: int, row_mean: bool) -> jax.Array:
    """The batch loss from per-token cross-entropies ``ce`` [B, G] and the scored masked tokens.

    LLaDA's SFT form (``row_mean=False``): every masked token weighted ``1/t``, summed and divided
    by the scored positions per row (``scored_length``) and the rows. ``row_mean``: each row's
    masked tokens averaged (a row with none counts 0), then the rows: ``1/(t * scored_length)`` is
    the expected count's reciprocal, so both estimate the same objective; this one without the
    variance of a barely masked row whose one token carries a weight near ``1/eps``.
    """
    if row_mean:
        return jnp.mean(jnp.sum(ce * masked, axis=1) / jnp.maximum(masked.sum(axis=1), 1))
    return jnp.sum(ce * masked / t) / (ce.shape[0] * scored_length)


def make_train_step(
    graphdef,
    optimizer,
    mask_id: int,
    gen_length: int = GEN_LENGTH,
    block_length: int | None = None,
    eps: float = 1e-3,
    row_mean: bool = False,
):
    """One jitted AdamW step on a batch whose last ``gen_length`` tokens are the response.

    ``block_length=None`` (the shipped recipe): the SFT loss over the whole response. With
    ``block_length`` the loss is the masked tokens of one random block per row, weighted by ``1/t``
    (``mask_probabilities``), so that a line's result is mostly predicted with its operands in
    view, as when decoding. Measured worse (docs/default-model.md: 18.4% against 37.0% held-out accuracy).
    ``row_mean`` (the shipped recipe; ``main`` sets it from ``--loss-weight``): each row's masked
    tokens averaged instead of weighted by ``1/t`` (``masked_loss``).
    """
    n_blocks = 1 if block_length is None else gen_length // block_length
    if block_length is not None and gen_length % block_length:
        raise ValueError(f"block_length {block_length} does not divide gen_length {gen_length}")

    def loss_fn(params, ids, attn, key):
        t_key, b_key, m_key = jax.random.split(key, 3)
        batch = ids.shape[0]
        # Stratified t (one uniform offset, B evenly spaced levels): each row's t is still
        # U(eps, 1], but the batch covers the range evenly, which lowers the variance of the
        # 1/t-weighted loss (MDLM's low-discrepancy sampler).
        u = (jnp.arange(batch) + jax.random.uniform(t_key)) / batch
        t = (eps + (1.0 - eps) * u)[:, None]
        block = jax.random.randint(b_key, (batch, 1), 0, n_blocks)
        start = ids.shape[1] - gen_length
        response = ids[:, start:]
        p = mask_probabilities(t, gen_length, block_length, block)
        masked = jax.random.uniform(m_key, response.shape) < p
        noisy = ids.at[:, start:].set(jnp.where(masked, mask_id, response))
        logits = nnx.merge(graphdef, params)(noisy, attn, logits_from=start)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, response)
        if block_length is not None:  # only the row's own block is scored
            masked_in_block = masked & (jnp.arange(gen_length)[None] // block_length == block)
        else:
            masked_in_block = masked
        loss = masked_loss(ce, masked_in_block, t, gen_length // n_blocks, row_mean)
        acc = jnp.sum((logits.argmax(-1) == response) * masked_in_block) / jnp.maximum(masked_in_block.sum(), 1)
        return loss, acc

    @jax.jit
    def train_step(params, opt_state, ids, attn, key):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, ids, attn, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    return train_step


def data_parallel(enabled: bool, params, opt_state, batch_sizes: tuple[int, ...]):
    """(put_batch, params, opt_state): with ``enabled``, params and optimiser state replicated on
    a one-axis ``data`` mesh of all devices and every batch split along its rows over it (the
    jitted step then all-reduces the gradients); otherwise batches go in as they are. A batch
    whose row count does not divide by the devices (``encode_batch`` skips the rare example that
    does not fit, e.g. 63 of 64 drills) loses its last rows down to a multiple of them."""
    if not enabled:
        return (lambda batch: batch), params, opt_state
    devices = jax.devices()
    if len(devices) < 2:
        raise SystemExit(
            "--data-parallel needs several devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=2 on CPU"
        )
    if any(size % len(devices) for size in batch_sizes):
        raise SystemExit(f"--data-parallel: batch sizes {batch_sizes} must divide by the {len(devices)} devices")
    mesh = make_mesh(f"data={len(devices)},model=1")  # the library's (data, model) mesh, all on data
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    print(f"data parallel over {len(devices)} devices", flush=True)

    def put_batch(batch: tuple[np.ndarray, ...]) -> tuple[jax.Array, ...]:
        keep = len(batch[0]) // len(devices) * len(devices)
        return jax.device_put(tuple(array[:keep] for array in batch), rows)

    return put_batch, jax.device_put(params, replicated), jax.device_put(opt_state, replicated)


def on_one_device(tree):
    """A copy of ``tree`` on the first device (the decoder evaluates and exports unsharded)."""
    return jax.device_put(tree, jax.devices()[0])


def evaluate(model: DiffusionLM, tok, examples, settings: DecodeConfig, path: Path) -> float:
    lm = LoadedModel(model, tok, path)
    correct = 0
    for i in range(0, len(examples), 64):
        chunk = examples[i : i + 64]
        out = lm.generate([ex["question"] for ex in chunk], settings, chat=True, prompt_bucket=32)
        correct += sum(is_correct(r.text, ex) for r, ex in zip(out, chunk))
    return correct / len(examples)


def save(model: DiffusionLM, out: Path) -> None:
    """LLaDA HF layout plus the decode lengths the model was trained for."""
    export_hf(model, out)
    (out / DECODE_DEFAULTS_FILE).write_text(json.dumps({"gen_length": GEN_LENGTH, "block_length": BLOCK_LENGTH}) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="models/default")
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--minutes", type=float, default=58.0, help="safety stop: training time budget")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    add_model_args(parser)
    parser.add_argument("--drill-every", type=int, default=3, help="every n-th batch is calculator drills (0: none)")
    parser.add_argument("--drill-batch", type=int, default=64)
    parser.add_argument(
        "--drill-labels",
        action="store_true",
        help="drill answer lines keep their problem's label word, like a word problem's lines",
    )
    parser.add_argument(
        "--unlisted-drills",
        action="store_true",
        help="drill questions do not list the expressions (results only from their own line)",
    )
    parser.add_argument(
        "--chain-drills",
        action="store_true",
        help="half of every drill batch is chained drills (make_chain_drills), the other half listed",
    )
    parser.add_argument(
        "--masking",
        choices=["iid", "block"],
        default="iid",
        help="iid: LLaDA's SFT form (the shipped recipe); block: one block per row masked at "
        "ratio t, earlier blocks clean, later ones masked (the order the model is decoded in)",
    )
    parser.add_argument(
        "--loss-weight",
        choices=["row-mean", "inverse-t"],
        default="row-mean",
        help="row-mean (the shipped recipe): each row's masked tokens averaged, i.e. weighted by "
        "one over the row's realised masked ratio; inverse-t: weighted 1/t (LLaDA's expected ratio)",
    )
    parser.add_argument(
        "--data-parallel", action="store_true", help="shard each batch over all JAX devices (see the module docstring)"
    )
    parser.add_argument("--eval-every", type=int, default=2000)
    parser.add_argument("--eval-n", type=int, default=64)
    return parser


def batch_sources(args, tok, cfg, held_out: set[str], rng: random.Random, drill_length: int):
    """(word-problem batches, drill batches): each an iterator of encoded batches, made ahead in
    its own thread."""
    problems = prefetch(
        lambda: encode_batch(
            tok, make_dataset(args.batch, rng.randrange(2**31), exclude=held_out), cfg.eos_id, cfg.pad_id
        )
    )
    drill_rng = random.Random(args.seed + 1)  # its own stream: the two prefetch threads interleave

    def drill_batch() -> list[dict]:
        chained = args.drill_batch // 2 if args.chain_drills else 0
        seed = drill_rng.randrange(2**31)
        return make_drills(
            args.drill_batch - chained, seed, labelled=args.drill_labels, listed=not args.unlisted_drills
        ) + make_chain_drills(chained, seed)

    drills = prefetch(lambda: encode_batch(tok, drill_batch(), cfg.eos_id, cfg.pad_id, drill_length))
    return problems, drills


def main() -> None:
    args = build_parser().parse_args()

    out = Path(args.out)
    tok = AutoTokenizer.from_pretrained(str(out))
    test = load_jsonl(out / "test.jsonl")
    held_out = {ex["question"] for ex in test}
    cfg = model_config(tok, args)
    # Same initial weights in either layout; unrolled (the CPU's) steps are 10-20% faster there.
    model = DiffusionLM(cfg, rngs=nnx.Rngs(args.seed), unroll_layers=default_unroll_layers())
    graphdef, params = nnx.split(model)
    print(f"model: {cfg.param_count():,} parameters, vocab {cfg.vocab_size}", flush=True)

    total_steps = args.steps
    optimizer = make_optimizer(args.lr, total_steps, warmup=min(200, total_steps // 10 + 1))
    opt_state = optimizer.init(params)
    put_batch, params, opt_state = data_parallel(args.data_parallel, params, opt_state, (args.batch, args.drill_batch))
    block_length = BLOCK_LENGTH if args.masking == "block" else None
    row_mean = args.loss_weight == "row-mean"
    problem_step = make_train_step(graphdef, optimizer, cfg.mask_id, GEN_LENGTH, block_length, row_mean=row_mean)
    drill_length = LABELLED_DRILL_GEN_LENGTH if args.drill_labels else DRILL_GEN_LENGTH
    drill_length = CHAIN_DRILL_GEN_LENGTH if args.chain_drills and not args.drill_labels else drill_length
    drill_step = make_train_step(graphdef, optimizer, cfg.mask_id, drill_length, block_length, row_mean=row_mean)
    settings = DecodeConfig(gen_length=GEN_LENGTH, block_length=BLOCK_LENGTH, steps=GEN_LENGTH)

    rng = random.Random(args.seed)
    key = jax.random.key(args.seed)
    start = time.time()
    log = []
    step = 0
    problems, drills = batch_sources(args, tok, cfg, held_out, rng, drill_length)
    while step < total_steps and time.time() - start < args.minutes * 60:
        use_drill = args.drill_every and step % args.drill_every == args.drill_every - 1
        ids, attn = put_batch(next(drills if use_drill else problems))
        key, sub = jax.random.split(key)
        params, opt_state, loss, acc = (drill_step if use_drill else problem_step)(params, opt_state, ids, attn, sub)
        step += 1
        if step % 50 == 0:
            print(
                f"step {step} loss {float(loss):.4f} masked-acc {float(acc):.3f} {time.time() - start:.0f}s", flush=True
            )
        if step % args.eval_every == 0:
            model = nnx.merge(graphdef, on_one_device(params))
            save(model, out)  # a usable checkpoint at every evaluation
            accuracy = evaluate(model, tok, test[: args.eval_n], settings, out)
            log.append({"step": step, "seconds": round(time.time() - start), "accuracy": accuracy})
            print(f"  eval step {step}: accuracy {accuracy:.3f} on {args.eval_n} held-out", flush=True)
    save(nnx.merge(graphdef, on_one_device(params)), out)
    (out / "training.json").write_text(
        json.dumps({"args": vars(args), "steps": step, "seconds": round(time.time() - start), "evals": log}, indent=2)
        + "\n"
    )
    print(f"wrote {out} after {step} steps, {time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
