"""Build the small byte-level BPE tokenizer of the shipped default model.

    python -m scripts.default_model.make_tokenizer --out models/default [--n 20000 --seed 0] [--number-groups]

Trains on ``scripts.default_model.tasks.make_dataset(n, seed)`` rendered as chat turns and
writes tokenizer.json, tokenizer_config.json and special_tokens_map.json, which
``transformers.AutoTokenizer.from_pretrained(out)`` loads.

Design:
  * digits are always single tokens, never merged with anything (the
    pre-tokenizer isolates every digit), so arithmetic is learnable
    (``--number-groups``: digit groups of up to three, as LLaMA-3's
    pre-tokenizer splits numbers, which BPE merges into one token for every
    number of the corpus; a model trained with it was no better, docs/default-model.md);
  * a space before a number is attached to the preceding word or operator
    (``"12 + 7 = 19"`` -> ``1 2 " + " 7 " = " 1 9``), otherwise to the following
    word, as in GPT-2;
  * byte-level, so ``decode(encode(text)) == text`` for any text;
  * special tokens use the names of LLaDA-8B-Instruct; the vocabulary is padded
    with unused ``<|reserved_i|>`` tokens to a multiple of 64.

Provenance: the shipped ``models/default/tokenizer.json`` is what this script (then
``scripts/make_tokenizer.py``) wrote at commit ba41fce, byte for byte (``git worktree add /tmp/t
ba41fce && cd /tmp/t && python scripts/make_tokenizer.py --out DIR``). The corpus generator changed
since (numbers up to 20, drills), so today's script writes the same vocabulary size with a
different merge order; the shipped model was trained on the shipped file, so keep it. The script
is deterministic: two runs write identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from scripts.default_model.tasks import make_dataset

EOS = "<|endoftext|>"  # also the pad token
BOS = "<|startoftext|>"
MASK = "<|mask|>"
EOT = "<|eot_id|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
SPECIAL_TOKENS = [EOS, BOS, MASK, EOT, START_HEADER, END_HEADER]

VOCAB_SIZE = 1024  # total, including special and reserved tokens
PAD_MULTIPLE = 64

# Each digit alone; words and punctuation runs with an optional leading space,
# and with the trailing space when a digit follows; remaining whitespace runs.
SPLIT_PATTERN = r"[0-9]| ?[A-Za-z]+(?: (?=[0-9]))?| ?[^\sA-Za-z0-9]+(?: (?=[0-9]))?|\s+"
NUMBER_GROUPS_PATTERN = "[0-9]{1,3}" + SPLIT_PATTERN.removeprefix("[0-9]")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


# Base symbols: the byte-level forms of printable ASCII, tab and newline (other
# bytes are not in the vocabulary; the corpus is ASCII).
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
ALPHABET = sorted(_BYTE_LEVEL.pre_tokenize_str(c)[0][0] for c in map(chr, [9, 10, *range(32, 127)]))


def corpus(n: int, seed: int) -> list[str]:
    """Training text: questions and answers as they appear in chat turns."""
    texts = []
    for ex in make_dataset(n, seed):
        texts.append("user\n\n" + ex["question"])
        texts.append("assistant\n\n" + ex["answer"])
    return texts


def build(
    n: int = 20000, seed: int = 0, vocab_size: int = VOCAB_SIZE, number_groups: bool = False
) -> PreTrainedTokenizerFast:
    """Train the BPE tokenizer and wrap it as a PreTrainedTokenizerFast."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(NUMBER_GROUPS_PATTERN if number_groups else SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=ALPHABET,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(n, seed), trainer=trainer)
    size = tok.get_vocab_size()
    padded = -(-size // PAD_MULTIPLE) * PAD_MULTIPLE
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(padded - size)])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        additional_special_tokens=[EOT, START_HEADER, END_HEADER],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def save(hf_tok: PreTrainedTokenizerFast, out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and
    special_tokens_map.json, in a form old and new transformers both load."""
    out.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    # Spell the config the way transformers 4.x also understands.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = [EOT, START_HEADER, END_HEADER]
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "mask_token": MASK,
        "additional_special_tokens": [EOT, START_HEADER, END_HEADER],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--n", type=int, default=20000, help="problems in the training corpus")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument(
        "--number-groups",
        action="store_true",
        help="numbers split into digit groups of up to three (one token per number of the corpus)",
    )
    args = ap.parse_args()

    hf_tok = build(args.n, args.seed, args.vocab_size, args.number_groups)
    save(hf_tok, args.out)

    # Check: exact round trip on the training corpus, digits (or every number 0-20) are single tokens.
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(args.out))
    for text in corpus(min(args.n, 2000), args.seed):
        ids = loaded.encode(text, add_special_tokens=False)
        assert loaded.decode(ids) == text, text
    for n in range(21 if args.number_groups else 10):
        assert len(loaded.encode(str(n), add_special_tokens=False)) == 1, n
    print(
        f"wrote {args.out}: vocab size {len(loaded)} "
        f"(mask={loaded.mask_token_id}, eos=pad={loaded.eos_token_id}, bos={loaded.bos_token_id})"
    )


if __name__ == "__main__":
    main()
