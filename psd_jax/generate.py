"""``python -m psd_jax.generate``: decode prompts with a diffusion LM and print answers and stats."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .api import InputError, decode_lengths, default_model_path, load_model
from .config import ACCEPTANCES, CACHES, CONFIDENCES, DECODERS, POLICIES, DecodeConfig, DecodeConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m psd_jax.generate", description=__doc__)
    p.add_argument("--model", help="HF or converted model directory (default: the shipped default model)")
    src = p.add_argument_group("prompts (default: a sample question of the shipped model's test set)")
    src.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    src.add_argument("--prompt-file", help="file with one prompt per line")
    src.add_argument("--prompt-ids", action="append", default=[], help='comma-separated token ids, e.g. "1,2,3" (repeatable)')
    p.add_argument("--chat", action="store_true", help="wrap each text prompt in the tokenizer's chat template")
    p.add_argument("--gen-length", type=int, default=None, help="generated positions (default: the model directory's decode_defaults.json, else 128)")
    p.add_argument("--block-length", type=int, default=None, help="block size (default: the model directory's decode_defaults.json, else 32)")
    p.add_argument("--steps", type=int, default=None, help="total steps (default: gen length, one token per step)")
    p.add_argument("--policy", default="fixed", help=f"one of {', '.join(POLICIES)}")
    p.add_argument("--confidence", default="prob", help=f"one of {', '.join(CONFIDENCES)}")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--factor", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cfg-scale", type=float, default=0.0)
    p.add_argument("--no-eos-stop", action="store_true", help="keep decoding blocks after an EOS")
    p.add_argument("--decoder", default="plain", help=f"one of {', '.join(DECODERS)}")
    p.add_argument(
        "--cache", default="none", help=f"block KV cache, one of {', '.join(CACHES)} (Fast-dLLM prefix / dual cache)"
    )
    psd = p.add_argument_group("PSD")
    psd.add_argument("--depth", type=int, default=3)
    psd.add_argument("--acceptance", default="tokens", help=f"one of {', '.join(ACCEPTANCES)}")
    psd.add_argument("--draft-rate", type=int, default=None)
    rps = p.add_argument_group("RPS")
    rps.add_argument("--kmax", type=int, default=10)
    rps.add_argument("--ratio", type=float, default=0.1)
    rps.add_argument("--pivot-tau", type=float, default=0.9)
    rps.add_argument("--lam", type=float, default=0.3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mesh", help='shard over devices, e.g. "data=2,model=4" (default: one device)')
    p.add_argument("--distributed", action="store_true", help="multi-host: call jax.distributed.initialize() first")
    p.add_argument("--prompt-bucket", type=int, default=32, help="pad prompt lengths up to a multiple of this")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    return p


def _default_question() -> str | None:
    """The first question of the shipped model's held-out set, if it ships one."""
    test = Path(default_model_path()) / "test.jsonl"
    if not test.is_file():
        return None
    return json.loads(test.read_text().splitlines()[0])["question"]


def _prompts(args) -> list:
    prompts: list = list(args.prompt)
    if args.prompt_file:
        lines = Path(args.prompt_file).read_text().splitlines()
        prompts += [line for line in lines if line.strip()]
    for text in args.prompt_ids:
        try:
            prompts.append([int(t) for t in text.replace(" ", "").split(",") if t])
        except ValueError:
            raise InputError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not prompts and args.model is None:
        question = _default_question()
        if question is not None:
            prompts.append(question)
    if not prompts:
        raise InputError("no prompt given: use --prompt, --prompt-file or --prompt-ids")
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model_dir = Path(args.model) if args.model is not None else default_model_path()
        settings = _settings(args, model_dir)
        if args.distributed:
            import jax

            jax.distributed.initialize()
        lm = load_model(model_dir, dtype=args.dtype, mesh=args.mesh)
        prompts = _prompts(args)
        chat = args.chat or (args.model is None and not args.prompt_ids and bool(getattr(lm.tokenizer, "chat_template", None)))
        results = lm.generate(prompts, settings, seed=args.seed, chat=chat, prompt_bucket=args.prompt_bucket)
    except (InputError, DecodeConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, r in zip(prompts, results):
        if args.json:
            print(json.dumps(r.to_json()))
            continue
        if isinstance(prompt, str):
            print(f"> {prompt}")
        print(r.text if r.text is not None else " ".join(map(str, r.output_ids[: r.tokens])))
        tps = r.tokens / r.seconds if r.seconds > 0 else float("inf")
        print(
            f"[tokens {r.tokens} | NFE {r.nfe} | TPF {r.tpf:.2f} | {tps:.1f} tokens/s | "
            f"decode {r.seconds:.2f}s | compile {r.compile_seconds:.2f}s]"
        )
    return 0


def _settings(args, model_dir: Path | None = None) -> DecodeConfig:
    gen_length, block_length = decode_lengths(model_dir, args.gen_length, args.block_length)
    return DecodeConfig(
        gen_length=gen_length,
        block_length=block_length,
        steps=args.steps,
        policy=args.policy,
        confidence=args.confidence,
        threshold=args.threshold,
        factor=args.factor,
        temperature=args.temperature,
        cfg_scale=args.cfg_scale,
        eos_early_stop=not args.no_eos_stop,
        decoder=args.decoder,
        depth=args.depth,
        acceptance=args.acceptance,
        draft_rate=args.draft_rate,
        k_max=args.kmax,
        ratio=args.ratio,
        pivot_tau=args.pivot_tau,
        lam=args.lam,
        cache=args.cache,
    )


if __name__ == "__main__":
    sys.exit(main())
