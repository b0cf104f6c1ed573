"""llada-tiny with a word-level tokenizer, for the text front ends on several processes.

The golden checkpoint ships no tokenizer. ``with_tokenizer`` makes a directory beside it: the
checkpoint's files linked, a tokenizer whose word ``w<i>`` is id ``i`` (so the text ``"w474 w488"``
is the prompt ``[474, 488]``, and a decode's text spells its ids), the config's special ids as
special tokens (mask 500, EOS = pad 501), the generation length the sharded tests decode
(``decode_defaults.json``), a few question/answer problems, a one-task harness directory, and the
whole directory converted to Orbax beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from paths import GOLDENS

TINY = GOLDENS / "llada-tiny"
VOCAB = 512
SPECIAL = {500: "<|mdm_mask|>", 501: "<|endoftext|>"}
PROMPTS = [[474, 488, 482, 450, 262, 258, 71, 195, 146, 187, 330, 492], [280, 242, 425, 15, 2, 138, 188]]
TASK = "word_task"


def text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def converted(directory: Path) -> Path:
    """Where ``with_tokenizer`` puts the directory's converted (Orbax, float32) checkpoint."""
    return directory.with_name(directory.name + "-orbax")


def with_tokenizer(directory: Path) -> Path:
    """Write llada-tiny + tokenizer + problems + a harness task into ``directory``, and its
    float32 Orbax conversion beside it (``converted``); return ``directory``."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (directory / name).symlink_to(TINY / name)
    vocab = {f"w{i}": i for i in range(VOCAB) if i not in SPECIAL}
    vocab.update({token: i for i, token in SPECIAL.items()})
    tokenizer = Tokenizer(models.WordLevel(vocab, "w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL.values()])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": SPECIAL[501],
                "pad_token": SPECIAL[501],
                "mask_token": SPECIAL[500],
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (directory / "decode_defaults.json").write_text(json.dumps({"gen_length": 32, "block_length": 16}))
    problems = [{"question": text(p), "answer": f"#### {i}"} for i, p in enumerate(PROMPTS)]
    (directory / "problems.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    tasks = directory / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(
        "\n".join(
            [
                f"task: {TASK}",
                "dataset_path: json",
                "dataset_kwargs:",
                f"  data_files: {{test: {directory / 'problems.jsonl'}}}",
                "test_split: test",
                "output_type: generate_until",
                'doc_to_text: "{{question}}"',
                'doc_to_target: "{{answer}}"',
                "generation_kwargs:",
                "  until: []",
                "  max_gen_toks: 32",
                "metric_list:",
                "  - metric: exact_match",
                "",
            ]
        )
    )
    from convert.__main__ import main as convert

    assert convert(["--hf-dir", str(directory), "--out", str(converted(directory)), "--dtype", "float32"]) == 0
    return directory
