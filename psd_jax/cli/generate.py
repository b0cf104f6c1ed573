"""``python -m psd_jax.generate``: decode prompts with a diffusion LM and print answers and stats.

With no prompt, the first 8 questions of the model directory's held-out set (``test.jsonl``,
shipped with the default model) are answered twice, by the model directory's recommended setting
(its ``recommended.json`` if it has one, else ``config.RECOMMENDED``; with any decoding flags given
applied on top of it) and by one token per step, next to the reference answer; the output says
which recommendation it ran. ``--settings recommended`` decodes prompts with that setting too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..api import Generation, LoadedModel
from ..core.config import ENTROPY_BOUND_FAMILY, DecodeConfig
from ..core.errors import InputError
from ..parallel import multihost
from ..prompts import check_seed
from ..recommended import NAME, read_recommended
from ..scoring import load_jsonl
from .flags import (
    EXIT_BAD_INPUT,
    ArgumentParser,
    add_cluster_flags,
    add_decode_flags,
    add_settings_flag,
    add_weight_flags,
    decode_fields,
    positive_int,
)
from .show import MASK_GLYPH, show
from .startup import FrontEndStart

HELD_OUT_FILE = "test.jsonl"
PROMPT_BUCKET = 32
DEMO_PROBLEMS = 8  # held-out questions the first run answers (one batch per decoder)
EXPLAIN_STATS = (
    "tokens/s of a warm decode (compilation apart); speedup = tokens/s over one token per step without a cache "
    "(LLaDA's generate.py).\nNFE = model calls; TPF = tokens per forward (generated tokens / NFE): higher TPF, fewer calls."
)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m psd_jax.generate", description=__doc__)
    p.add_argument("--model", help="HF or converted model directory (default: the shipped default model)")
    src = p.add_argument_group(
        f"prompts (default: the first {DEMO_PROBLEMS} questions of the model directory's {HELD_OUT_FILE}, answered "
        "by the model directory's recommended setting, with the decoding flags given on top of it, and by one "
        "token per step)"
    )
    src.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    src.add_argument("--prompt-file", help="file with one prompt per line")
    src.add_argument(
        "--prompt-ids", action="append", default=[], help='comma-separated token ids, e.g. "1,2,3" (repeatable)'
    )
    p.add_argument(
        "--chat",
        action="store_true",
        default=None,
        help="wrap text prompts in the tokenizer's chat template (default: when the tokenizer has one)",
    )
    p.add_argument("--no-chat", action="store_false", dest="chat", help="never use the chat template")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling and random confidences, in [0, 2**32)")
    add_settings_flag(p)
    add_decode_flags(p)
    add_weight_flags(p)
    p.add_argument(
        "--prompt-bucket",
        type=positive_int,
        help=f"pad prompt lengths up to a multiple of this (default: {PROMPT_BUCKET}; with --replay-draws, "
        "the longest prompt's length, as upstream pads)",
    )
    p.add_argument(
        "--replay-draws",
        metavar="FILE:PREFIX",
        help="DiffusionGemma: decode with an upstream run's recorded random draws instead of the engine's own, "
        "to reproduce it bit for bit: the safetensors FILE's PREFIX.init_canvas [canvases, batch, canvas], "
        "PREFIX.sample and PREFIX.renoise [steps, batch, canvas] (docs/diffusion-gemma.md)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument(
        "--show",
        action="store_true",
        help=f"replay each decode step by step after it ran ({MASK_GLYPH} for masks, each call's writes highlighted; "
        "plain lines when the output is not a terminal; it sets --trace); with no prompt, the first question's",
    )
    add_cluster_flags(p)
    return p


def held_out_examples(model_dir: Path, n: int = DEMO_PROBLEMS) -> list[dict]:
    """The first ``n`` ``{"question", "answer"}`` of the directory's held-out set (none if it ships
    none); every line is checked (``scoring.load_jsonl``)."""
    test = model_dir / HELD_OUT_FILE
    return load_jsonl(test)[:n] if test.is_file() else []


def prompts_from(args) -> list:
    prompts: list = list(args.prompt)
    if args.prompt_file:
        try:
            lines = Path(args.prompt_file).read_text().splitlines()
        except OSError as exc:
            raise InputError(f"--prompt-file {args.prompt_file}: {exc.strerror}") from None
        given = [line for line in lines if line.strip()]
        if not given:  # a user who names a file asks for its prompts, never for the demo
            raise InputError(f"--prompt-file {args.prompt_file} holds no prompt: every line is empty")
        prompts += given
    for text in args.prompt_ids:
        try:
            prompts.append([int(t) for t in text.replace(" ", "").split(",") if t])
        except ValueError:
            raise InputError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    return prompts


def stats_line(r: Generation) -> str:
    tps = r.tokens / r.seconds if r.seconds > 0 else float("inf")
    return (
        f"[tokens {r.tokens} | NFE {r.nfe} | TPF {r.tpf:.2f} | {tps:.1f} tokens/s | "
        f"decode {r.seconds:.2f}s | compile {r.compile_seconds:.2f}s]"
    )


def describe(settings: DecodeConfig) -> str:
    """A short name of a decoder setting: ``psd, threshold 0.9, depth 3, dual cache``."""
    parts = [settings.decoder] if settings.decoder != "plain" else []
    if settings.policy == "fixed":
        per_step = settings.gen_length / settings.total_steps
        parts.append("one token per step" if per_step == 1 else f"fixed {per_step:g} tokens per step")
    else:
        parts.append(f"{settings.policy} {settings.threshold}" if settings.policy == "threshold" else settings.policy)
    if settings.decoder == "psd":
        parts.append(f"depth {settings.depth}")
        if settings.draft_next_block:
            parts.append("into the next block")
        if settings.accept_confidence > 0:
            parts.append(f"confidence gate {settings.accept_confidence:g}")
    if settings.cache != "none":
        window = f" (window +{settings.vicinity})" if settings.vicinity else ""
        refresh = f" (refresh every {settings.refresh_every})" if settings.refresh_every else ""
        parts.append(f"{settings.cache} cache{window}{refresh}")
    return ", ".join(parts)


def run_demo(
    lm: LoadedModel,
    examples: list[dict],
    settings: DecodeConfig,
    seed: int,
    chat: bool | None,
    as_json: bool,
    prompt_bucket: int | None = 32,
    origin: str | None = None,
) -> list:
    """Answer held-out questions with ``settings`` and with one token per step without a cache
    (LLaDA's ``generate.py``), in one batch each, timed warm (``generate(warm=True)``); show the
    first question in full, both decoders' accuracy, speed and calls side by side, and where the
    setting came from (``origin``: ``Recommendation.origin()``). Returns each setting's results (with
    the ``trace`` setting, the one-token-per-step baseline records its trace too)."""
    from ..scoring import extract_answer, gold_answer

    baseline = DecodeConfig(gen_length=settings.gen_length, block_length=settings.block_length, trace=settings.trace)
    questions = [ex["question"] for ex in examples]
    runs = [
        (s, lm.generate(questions, s, seed=seed, chat=chat, prompt_bucket=prompt_bucket, warm=True))
        for s in dict.fromkeys([settings, baseline])
    ]
    references = [gold_answer(ex) for ex in examples]
    if as_json:
        print_json_lines(runs, examples, references, settings, origin)
        return runs
    # In full: the first question the decoder answers right (the table below counts every one).
    rights = [extract_answer(r.text or "") == ref for r, ref in zip(runs[0][1], references)]
    shown = rights.index(True) if any(rights) else 0
    print(f"Question {shown + 1} of {len(examples)}:  {examples[shown]['question']}")
    print("Answer:    " + (runs[0][1][shown].text or "").strip().replace("\n", "\n           "))
    print(f"Reference: {references[shown]}  ->  {'right' if rights[shown] else 'wrong'}")
    print()
    width = max(len(describe(s)) for s, _ in runs)
    print(
        f"{'decoder':<{width}}  answer {shown + 1}  right on {len(examples):<2}  tokens/s  speedup  "
        "NFE/question   TPF  compile s"
    )
    speed = {s: _tokens_per_second(results) for s, results in runs}
    for s, results in runs:
        answers = [extract_answer(r.text or "") for r in results]
        correct = sum(a == ref for a, ref in zip(answers, references))
        tokens, nfe, r = sum(x.tokens for x in results), sum(x.nfe for x in results), results[0]
        print(
            f"{describe(s):<{width}}  {str(answers[shown]):>8}  {correct:>8}/{len(examples):<2}  {speed[s]:>8.1f}  "
            f"{speed[s] / speed[baseline]:>6.2f}x  {nfe / len(results):>12.1f}  {tokens / max(nfe, 1):>4.2f}  "
            f"{r.compile_seconds:>9.2f}"
        )
    print(f"(the first {len(examples)} questions of {lm.path / HELD_OUT_FILE}, one batch per decoder)")
    if origin is not None:
        print(f"recommended setting: {origin}")
    print(EXPLAIN_STATS)
    return runs


def print_json_lines(runs, examples: list[dict], references: list, settings: DecodeConfig, origin: str | None) -> None:
    """One JSON line per question and decoder (``run_demo --json``)."""
    from ..scoring import extract_answer

    for s, results in runs:
        for ex, ref, r in zip(examples, references, results):
            print(
                json.dumps(
                    {
                        "question": ex["question"],
                        "reference": ref,
                        "decoder": describe(s),
                        "answer": extract_answer(r.text or ""),
                        "settings": s.changed(),
                        **({"recommended": origin} if origin is not None and s == settings else {}),
                        **r.to_json(),
                    }
                )
            )


def _tokens_per_second(results: list[Generation]) -> float:
    seconds = results[0].seconds  # the batch's
    return sum(r.tokens for r in results) / seconds if seconds > 0 else float("inf")


def print_results(prompts: list, results: list[Generation], as_json: bool) -> None:
    for prompt, r in zip(prompts, results):
        if as_json:
            row = r.to_json()
            if "decoder_passes" in r.stats:  # DiffusionGemma: upstream's count, beside nfe
                row["decoder_passes"] = r.stats["decoder_passes"]
            print(json.dumps(row))
            continue
        if isinstance(prompt, str):
            print(f"> {prompt}")
        print(r.text if r.text is not None else " ".join(map(str, r.output_ids[: r.tokens])))
        print(stats_line(r))


def _replay_options(args, family: str) -> dict:
    """``generate``'s prompt padding and, with ``--replay-draws``, the recorded draws (read and
    checked before the model loads); refused where there is nothing to replay."""
    bucket = PROMPT_BUCKET if args.prompt_bucket is None and args.replay_draws is None else args.prompt_bucket
    if args.replay_draws is None:
        return {"prompt_bucket": bucket}
    if family != ENTROPY_BOUND_FAMILY:
        raise InputError(f"--replay-draws replays DiffusionGemma's sampler; this model is {family}")
    from ..diffusion_gemma_api import read_draws

    return {"prompt_bucket": bucket, "draws": read_draws(args.replay_draws)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        start = FrontEndStart.begin(args)
        check_seed(args.seed)
        model_dir = start.model_dir
        fields = decode_fields(args)
        if args.show:
            if fields.get("trace") is False:
                raise InputError("--show replays the decode's trace: it cannot run with --no-trace")
            fields["trace"] = True
        prompts = prompts_from(args)
        examples = [] if prompts else held_out_examples(model_dir)
        if not prompts and not examples:
            raise InputError(
                f"no prompt given and {model_dir} has no {HELD_OUT_FILE}: use --prompt, --prompt-file or --prompt-ids"
            )
        # The demo runs the recommended setting, with the flags given on top of it.
        name = NAME if examples else args.settings
        start.precheck(fields, name)
        if examples and start.entropy_bound:
            raise InputError(
                "no prompt given: the first-run demo compares decoders of the mask-token families; for "
                "DiffusionGemma use --prompt, --prompt-file or --prompt-ids"
            )
        if args.show and args.json:
            raise InputError("--show draws the decode for a person; with --json use --trace (each line then holds it)")
        replay = _replay_options(args, start.config.family)
        start.join()
        settings = start.settings(fields, name)
        origin = None
        if examples:
            origin = read_recommended(model_dir).origin() + (", with the decoding flags given on top" if fields else "")
        lm = start.load()
        with multihost.quiet_unless_main():  # every process decodes; process 0 prints
            if examples:
                bucket = replay["prompt_bucket"]
                runs = run_demo(lm, examples, settings, args.seed, args.chat, args.json, bucket, origin)
                if args.show:
                    print(f"\nQuestion 1, {describe(runs[0][0])}, as it decoded:")
                    show(runs[0][1][:1], lm.piece_decoder(), lm.config.stop_ids)
                return 0
            results = lm.generate(prompts, settings, seed=args.seed, chat=args.chat, **replay)
            if args.show:
                show(results, lm.piece_decoder(), lm.config.stop_ids)
            print_results(prompts, results, args.json)
    except (FileNotFoundError, ValueError) as exc:  # InputError, DecodeConfigError, MeshError, ClusterError, ...
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0
