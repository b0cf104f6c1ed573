"""Write synthetic GSM8K-style problems as jsonl ({"question", "answer"} per line).

    python -m scripts.default_model.make_dataset --out models/default/test.jsonl --n 500 --seed 12345

The shipped held-out set uses seed 12345 (``tasks.TEST_SEED``) with unique
questions; train with other seeds and pass the test questions as ``exclude``
(``--exclude models/default/test.jsonl`` here, or ``make_dataset(..., exclude=...)``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from psd_jax.scoring import load_jsonl
from scripts.default_model.tasks import MAX_VALUE, TEST_SEED, make_dataset, save_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=TEST_SEED)
    ap.add_argument(
        "--exclude",
        type=Path,
        action="append",
        default=[],
        help="jsonl whose questions must not appear in the output (repeatable)",
    )
    ap.add_argument(
        "--max-value", type=int, default=MAX_VALUE, help="upper bound on every intermediate result (lower = easier)"
    )
    ap.add_argument("--allow-duplicates", action="store_true", help="allow a question to appear more than once")
    args = ap.parse_args()

    exclude = {ex["question"] for path in args.exclude for ex in load_jsonl(path)}
    examples = make_dataset(
        args.n, args.seed, exclude=exclude, unique=not args.allow_duplicates, max_value=args.max_value
    )
    save_jsonl(examples, args.out)
    print(f"wrote {len(examples)} problems to {args.out}")


if __name__ == "__main__":
    main()
