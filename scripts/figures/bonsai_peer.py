"""jax-ml/bonsai's JAX LLaDA beside psd-jax: the same weights, prompts and decoding rule, the tokens
compared and the speed measured (docs/peers.md).

bonsai (https://github.com/jax-ml/bonsai, ``bonsai/models/llada``) is never a dependency of this
project: it runs in an environment of its own (jax < 0.9, its own flax), called as a subprocess on
this very file (``--bonsai-worker``, which imports only the standard library, NumPy, JAX, Flax and
bonsai). The two sides exchange the job and the results as JSON files: one process per environment,
called in turn (psd-jax first, then bonsai).

For each model, one Hugging Face directory that both load: ``llada-tiny`` from the goldens, and the
108M-parameter random LLaDA shape of docs/xla-vs-pytorch.md (``compare_backends.write_random_llada``:
8 layers, d_model 1024, vocab 4096, written once as safetensors + config.json in a temporary
directory). The same token-id prompts (random ids, no special ones, all of one length: bonsai is
given an all-ones attention mask). Decoded with LLaDA ``generate.py``'s rule: steps = gen_length,
``low_confidence``, temperature 0, LLaDA's block length 32. Rows of the table:

- ``psd-jax generate.py rule``: ``predict_mask=True`` (a [MASK] may be predicted and stays masked,
  as in generate.py and bonsai), ``eos_early_stop=False`` (their loops decode every block); its
  tokens must equal bonsai's;
- ``psd-jax default mask rule``: the same without ``predict_mask`` ([MASK]'s logit -inf); its
  tokens equal the others' unless a step predicts [MASK];
- ``psd-jax recommended``: the fields of ``models/default/recommended.json``'s CPU choice (since
  commit 03fcebb threshold 0.99, uncached, block 16), ``eos_early_stop=False``;
- ``--settings NAME ...``: further psd-jax rows by setting name, ``eos_early_stop=False`` (default
  ``threshold-0.99/dual+v4/b16``, the recommendation before 03fcebb);
- ``bonsai (shipped)``: ``modeling.generate`` as it is: a Python loop over an un-jitted forward
  (each op dispatched on its own), with its own jitted rank function;
- ``bonsai (jitted forward)``: the same loop with the model's forward wrapped in ``jax.jit`` (the
  loop's other ops stay eager).

Protocol, per row: one warm-up call (its wall time, compilation or tracing included, is reported
as ``first call``), then ``--repeats`` timed calls, each until its result is on the host
(``jax.block_until_ready``; psd-jax's ``generate`` returns host ids); median and min-max spread.
tokens/s counts every generated position (batch x gen_length) of a call, [MASK]s left included.

    python -m scripts.figures.bonsai_peer --bonsai-python /work/peers/bonsai-venv/bin/python --out /tmp/peers

How to make the bonsai environment: docs/peers.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

LLADA_BLOCK = 32  # LLaDA generate.py's block length (its main())
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT.parent / "shared" / "goldens" / "llada-tiny"  # the goldens' checkpoint (read-only)


def timing(seconds: list[float], first: float, tokens: int) -> dict:
    """Median and spread of timed calls that each generate ``tokens`` positions."""
    median = statistics.median(seconds)
    return {
        "first_call_s": first,
        "seconds": seconds,
        "median_s": median,
        "min_s": min(seconds),
        "max_s": max(seconds),
        "tokens_per_call": tokens,
        "tokens_per_s": tokens / median,
        "tokens_per_s_range": [tokens / max(seconds), tokens / min(seconds)],
    }


SETTLE_S = 1.0  # idle before each timed call: the other process's XLA thread pool stops spinning


def settled(call):
    """``call`` after ``SETTLE_S`` of idling. XLA:CPU's worker threads keep spinning for a moment
    after a computation; without the pause, a call timed right after the other process's call
    shares the two cores with those threads (a psd-jax forward measured 177 ms there, 112 ms alone)."""
    time.sleep(SETTLE_S)
    return call()


def seconds_of(call) -> tuple[object, float]:
    """(result, wall seconds) of one call, started after ``SETTLE_S`` of idling; ``call`` returns
    once its result is on the host."""
    time.sleep(SETTLE_S)
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


# --------------------------------------------------------------------------------- bonsai side
# Run by the bonsai environment's python on this file: imports nothing of psd-jax.


def bonsai_model(path: Path):
    """bonsai's LLaDA of a Hugging Face directory, its ``ModelConfig`` from ``config.json``, float32,
    one device under a ("fsdp", "tp") mesh of 1 x 1 (bonsai's ``run_model``)."""
    import jax
    import jax.numpy as jnp
    from bonsai.models.llada import modeling, params
    from jax.sharding import AxisType

    c = json.loads((path / "config.json").read_text())
    cfg = modeling.ModelConfig(
        dtype=jnp.float32,
        d_model=c["d_model"],
        n_heads=c["n_heads"],
        n_kv_heads=c.get("n_kv_heads") or c["n_heads"],
        n_layers=c["n_layers"],
        embedding_dropout=0.0,
        max_sequence_length=c["max_sequence_length"],
        rope_theta=c["rope_theta"],
        include_qkv_bias=c["include_qkv_bias"],
        include_bias=c["include_bias"],
        vocab_size=c["vocab_size"],
        embedding_size=c["embedding_size"],
        mlp_hidden_size=c["mlp_hidden_size"],
        shd_cfg=modeling.ShardingConfig.no_sharding(),
        return_hidden_states=False,
        rms_norm_eps=c["rms_norm_eps"],
    )
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    jax.set_mesh(mesh)
    return params.create_llada_from_pretrained(str(path), cfg), c["mask_token_id"]


class BonsaiCalls:
    """bonsai's two decodes of one model: ``generate`` with the forward as shipped, and with it in
    ``jax.jit`` (``generate`` looks ``modeling.forward`` up by name at every step)."""

    VARIANTS = ("shipped", "jit")

    def __init__(self, m: dict):
        import jax
        import jax.numpy as jnp
        from bonsai.models.llada import modeling
        from flax import nnx

        self.modeling, self.shipped = modeling, modeling.forward
        model, mask_id = bonsai_model(Path(m["dir"]))
        self.prompt = jnp.asarray(m["prompts"], jnp.int32)
        graphdef, state = nnx.split(model)

        @jax.jit
        def forward(state, x, mask, key):
            return nnx.merge(graphdef, state)(input_ids=x, attention_mask=mask, key=key)

        self.jitted = lambda model, x, mask, key: forward(state, x, mask, key)
        ones = jnp.ones(self.prompt.shape, bool)  # None fails in bonsai, and these prompts have no padding
        masks = jnp.full((self.prompt.shape[0], m["gen_length"]), mask_id, jnp.int32)
        self.model, self.canvas, self.key = model, jnp.concatenate([self.prompt, masks], axis=1), jax.random.key(0)
        self.canvas_mask = jnp.ones(self.canvas.shape, bool)
        self.decode = partial(
            modeling.generate,
            model,
            self.prompt,
            ones,
            steps=m["steps"],
            gen_length=m["gen_length"],
            block_length=m["block_length"],
            temperature=0.0,
            remasking="low_confidence",
            mask_id=mask_id,
            key=jax.random.key(0),
        )

    def forward(self, variant: str) -> None:
        """One forward of the canvas a decode starts from ([B, prompt + gen_length], masks after the
        prompt), as ``generate`` makes each step's: un-jitted (shipped) or jitted."""
        import jax

        forward = self.shipped if variant == "shipped" else self.jitted
        jax.block_until_ready(forward(self.model, self.canvas, self.canvas_mask, self.key)[0])

    def __call__(self, variant: str) -> np.ndarray:
        import jax

        self.modeling.forward = self.shipped if variant == "shipped" else self.jitted
        try:
            out = jax.block_until_ready(self.decode())
        finally:
            self.modeling.forward = self.shipped
        return np.asarray(out)[:, self.prompt.shape[1] :]


def bonsai_worker(job_path: str, out_path: str) -> int:
    """Take turns with the psd-jax process: read one JSON command per line on stdin (``load`` a
    model, ``call`` a variant once, ``finish``), answer each with one JSON line (a call's seconds)
    once done, and at ``finish`` write every call's tokens and seconds to ``out_path``."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # generate's progress bar
    answer, sys.stdout = sys.stdout, sys.stderr  # stdout carries the answers only
    import flax
    import jax

    job = json.loads(Path(job_path).read_text())
    calls, results = None, {}
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "finish":
            break
        m = job["models"][command["model"]]
        if command["cmd"] == "load":
            calls = None  # the previous model's arrays go first
            calls = BonsaiCalls(m)
            reply = {"loaded": m["label"]}
        elif command["cmd"] == "forward":
            _, seconds = seconds_of(partial(calls.forward, command["variant"]))
            entry = results.setdefault(f"{m['label']}/forward {command['variant']}", {"seconds": []})
            entry["seconds"].append(seconds)
            reply = {"seconds": seconds}
        else:
            tokens, seconds = seconds_of(partial(calls, command["variant"]))
            entry = results.setdefault(f"{m['label']}/{command['variant']}", {"tokens": None, "seconds": []})
            entry["tokens"], entry["seconds"] = tokens.tolist(), [*entry["seconds"], seconds]
            reply = {"seconds": seconds}
        answer.write(json.dumps(reply) + "\n")
        answer.flush()
    meta = {"jax": jax.__version__, "flax": flax.__version__, "devices": [str(d) for d in jax.devices()]}
    Path(out_path).write_text(json.dumps({"meta": meta, "calls": results}))
    return 0


# --------------------------------------------------------------------------------- psd-jax side


def random_108m(out: Path, seed: int) -> Path:
    """docs/xla-vs-pytorch.md's 108M-parameter random LLaDA (compare_backends' defaults)."""
    from scripts.figures.compare_backends import write_random_llada

    shape = argparse.Namespace(
        layers=8, d_model=1024, heads=16, kv_heads=None, mlp=None, vocab=4096, head_std=0.5, seed=seed
    )
    return write_random_llada(out, shape)


def prompts_for(path: Path, batch: int, length: int, seed: int) -> list[list[int]]:
    """Random ids without the model's mask, EOS and pad ids."""
    c = json.loads((path / "config.json").read_text())
    special = {c["mask_token_id"], c["eos_token_id"], c["pad_token_id"]}
    vocab = [t for t in range(c["vocab_size"]) if t not in special]
    return np.random.default_rng(seed).choice(vocab, size=(batch, length)).tolist()


def psd_settings(gen_length: int, extra: tuple[str, ...] = ()) -> dict:
    """The psd-jax rows: name -> DecodeConfig; ``extra``: setting names (``psd_jax.names``) of
    further rows, each its own name. Every row decodes every block (``eos_early_stop=False``)."""
    from psd_jax import DecodeConfig
    from psd_jax.model_dir import DEFAULT_MODEL_DIR
    from psd_jax.names import setting_fields
    from psd_jax.recommended import read_recommended

    upstream = DecodeConfig(
        gen_length=gen_length, block_length=LLADA_BLOCK, steps=gen_length, eos_early_stop=False, predict_mask=True
    )
    recommended = read_recommended(DEFAULT_MODEL_DIR, "cpu").settings
    return {
        "generate.py rule": upstream,
        "default mask rule": upstream.replace(predict_mask=False),
        "recommended": DecodeConfig(gen_length=gen_length, eos_early_stop=False, **recommended),
        **{
            name: DecodeConfig(gen_length=gen_length, eos_early_stop=False, **setting_fields(name, gen_length))
            for name in extra
        },
    }


class BonsaiProcess:
    """The bonsai environment's python running ``bonsai_worker`` on this file, one command at a time."""

    def __init__(self, python: str, job: dict, work: Path):
        self.job, self.out = work / "bonsai-job.json", work / "bonsai-results.json"
        self.job.write_text(json.dumps(job))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        command = [python, str(Path(__file__).resolve()), "--bonsai-worker", str(self.job), str(self.out)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bonsai worker stopped (exit code {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def finish(self) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": "finish"}) + "\n")
        self.proc.stdin.close()
        if self.proc.wait():
            raise RuntimeError(f"the bonsai worker failed (exit code {self.proc.returncode})")
        return json.loads(self.out.read_text())


def psd_forward(lm, canvas: np.ndarray) -> None:
    """One forward of ``canvas`` [B, N] (psd-jax's jitted ``logits``), until its logits are ready."""
    import jax

    jax.block_until_ready(lm.logits(canvas))


def measure(models: list[dict], bonsai: BonsaiProcess, repeats: int, extra: tuple[str, ...] = ()) -> list[dict]:
    """Per model: every row's warm-up call, then ``repeats`` rounds of one timed call per row, the
    psd-jax rows (this process) and then bonsai's (its process), so that a drift of the machine's
    load falls on all rows alike."""
    from psd_jax import load_model
    from psd_jax.names import full_name

    results = []
    for index, m in enumerate(models):
        lm = load_model(m["dir"])  # float32
        settings = psd_settings(m["gen_length"], extra)
        psd_calls = {name: partial(lm.generate, m["prompts"], s, prompt_bucket=None) for name, s in settings.items()}
        mask_id = json.loads((Path(m["dir"]) / "config.json").read_text())["mask_token_id"]
        canvas = np.concatenate([np.asarray(m["prompts"]), np.full((m["batch"], m["gen_length"]), mask_id)], axis=1)
        bonsai.ask(cmd="load", model=index)
        seconds: dict[str, list[float]] = {}
        outputs = {}
        for _ in range(repeats + 1):  # the first round: the warm-up calls
            for name, call in psd_calls.items():
                outputs[name], s = seconds_of(call)
                seconds.setdefault(name, []).append(s)
            for variant in BonsaiCalls.VARIANTS:
                seconds.setdefault(variant, []).append(
                    settled(partial(bonsai.ask, cmd="call", model=index, variant=variant))["seconds"]
                )
            _, s = seconds_of(partial(psd_forward, lm, canvas))
            seconds.setdefault("forward psd-jax", []).append(s)
            for variant in BonsaiCalls.VARIANTS:
                reply = settled(partial(bonsai.ask, cmd="forward", model=index, variant=variant))
                seconds.setdefault(f"forward {variant}", []).append(reply["seconds"])
        for name, out in outputs.items():
            tokens = np.array([r.output_ids for r in out])
            results.append(
                {
                    "model": m["label"],
                    "variant": name,
                    "settings": settings[name].changed(),
                    "name": full_name(settings[name]),
                    "nfe": [r.nfe for r in out],
                    "tokens": tokens.tolist(),
                    **timing(seconds[name][1:], seconds[name][0], tokens.size),
                }
            )
        for variant in BonsaiCalls.VARIANTS:
            size = m["batch"] * m["gen_length"]
            results.append(
                {"model": m["label"], "variant": variant, **timing(seconds[variant][1:], seconds[variant][0], size)}
            )
        for variant in ("psd-jax", *BonsaiCalls.VARIANTS):  # one forward of [B, P + G]; its "tokens": positions
            times = seconds[f"forward {variant}"]
            results.append(
                {"model": m["label"], "variant": f"forward {variant}", **timing(times[1:], times[0], canvas.size)}
            )
        del lm
    return results


def compare(psd: list[dict], bonsai: list[dict]) -> list[dict]:
    """Per model and psd-jax row: do its tokens equal bonsai's (shipped and jitted), and where not,
    how many positions differ."""
    rows = []
    for p in psd:
        for b in bonsai:
            if b["model"] != p["model"]:
                continue
            mine, theirs = np.asarray(p["tokens"]), np.asarray(b["tokens"])
            rows.append(
                {
                    "model": p["model"],
                    "psd_jax": p["variant"],
                    "bonsai": b["variant"],
                    "equal": bool((mine == theirs).all()),
                    "positions_differ": int((mine != theirs).sum()),
                }
            )
    return rows


LABELS = {
    "generate.py rule": "psd-jax, generate.py rule (`predict_mask`)",
    "default mask rule": "psd-jax, default [MASK] rule",
    "shipped": "bonsai as shipped (un-jitted forward)",
    "jit": "bonsai, forward in `jax.jit`",
}


def label(row: dict) -> str:
    """A decode row's name in the table."""
    if row["variant"] == "recommended":
        return f"psd-jax `recommended` (`{row['name']}`)"
    return LABELS.get(row["variant"], f"psd-jax `{row['variant']}`")


FORWARDS = {
    "forward psd-jax": "psd-jax (`LoadedModel.logits`, jitted)",
    "forward shipped": "bonsai, un-jitted (as `generate` calls it)",
    "forward jit": "bonsai, in `jax.jit`",
}


def markdown(report: dict) -> str:
    lines = []
    for m in report["models"]:
        rows = [r for r in report["results"] if r["model"] == m["label"]]
        bonsai_tps = {r["variant"]: r["tokens_per_s"] for r in rows if r["variant"] in ("shipped", "jit")}
        lines += [
            f"**{m['label']}** ({m['params'] / 1e6:.1f}M parameters, float32): batch {m['batch']}, prompt "
            f"{m['prompt_length']}, gen {m['gen_length']}, median of {report['meta']['repeats']} after one warm-up",
            "",
            "| implementation | calls | first call (s) | median (s) | min–max (s) | tokens/s | "
            "vs bonsai shipped | vs bonsai jit | tokens = bonsai's |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in (r for r in rows if "nfe" in r or r["variant"] in BonsaiCalls.VARIANTS):
            same = [
                c["equal"] for c in report["comparison"] if c["model"] == m["label"] and c["psd_jax"] == r["variant"]
            ]
            equal = "—" if not same else ("yes" if all(same) else "no")
            calls = str(max(r["nfe"])) if "nfe" in r else str(m["gen_length"])
            lines.append(
                f"| {label(r)} | {calls} | {r['first_call_s']:.2f} | {r['median_s']:.3f} | "
                f"{r['min_s']:.3f}–{r['max_s']:.3f} | {r['tokens_per_s']:.1f} | "
                f"{r['tokens_per_s'] / bonsai_tps['shipped']:.2f}x | {r['tokens_per_s'] / bonsai_tps['jit']:.2f}x | {equal} |"
            )
        forwards = [r for r in rows if r["variant"] in FORWARDS]
        if forwards:
            width = m["prompt_length"] + m["gen_length"]
            lines += [
                "",
                f"One forward of the decode's first canvas [{m['batch']}, {width}], what each step above calls "
                "(psd-jax's decodes compute logits only where a row can commit):",
                "",
                "| forward | first call (s) | median (ms) | min–max (ms) |",
                "| --- | --- | --- | --- |",
            ]
            lines += [
                f"| {FORWARDS[r['variant']]} | {r['first_call_s']:.2f} | {1e3 * r['median_s']:.1f} | "
                f"{1e3 * r['min_s']:.1f}–{1e3 * r['max_s']:.1f} |"
                for r in forwards
            ]
        lines.append("")
    return "\n".join(lines)


def report_of(meta: dict, models: list[dict], results: list[dict], record: dict) -> dict:
    """The run's record: bonsai's tokens (its worker's file: each variant's last call) joined to its
    rows, and the psd-jax decodes' tokens compared with them."""
    for r in results:
        if r["variant"] in BonsaiCalls.VARIANTS:
            r["tokens"] = record["calls"][f"{r['model']}/{r['variant']}"]["tokens"]
    decodes = [r for r in results if "nfe" in r]  # psd-jax's (the forwards have no tokens)
    bonsai = [r for r in results if r["variant"] in BonsaiCalls.VARIANTS]
    return {
        "meta": meta,
        "models": [{k: v for k, v in m.items() if k != "dir"} for m in models],
        "results": results,
        "comparison": compare(decodes, bonsai),
    }


def parameters(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "numpy") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--bonsai-python", default="/work/peers/bonsai-venv/bin/python", help="the bonsai environment's python"
    )
    p.add_argument("--out", required=True, help="directory for results.json and table.md")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-length", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="the 108M model's weights")
    p.add_argument(
        "--prompt-seed",
        type=int,
        default=10,
        help="the prompts' ids (10: on llada-tiny the [MASK] rule then changes both rows, as in "
        "tests/decoding/test_predict_mask.py)",
    )
    p.add_argument(
        "--settings",
        nargs="*",
        default=["threshold-0.99/dual+v4/b16"],
        help="further psd-jax rows, as setting names (default: the recommendation before commit 03fcebb)",
    )
    p.add_argument("--tiny", default=str(TINY), help="the llada-tiny directory (default: the goldens')")
    p.add_argument("--no-108m", action="store_true", help="llada-tiny only")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.gen_length % LLADA_BLOCK:
        raise SystemExit(f"--gen-length must be a multiple of LLaDA's block length {LLADA_BLOCK}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bonsai-peer-") as tmp:
        work = Path(tmp)
        dirs = [("llada-tiny", Path(args.tiny))]
        if not args.no_108m:
            dirs.append(("random LLaDA 108M", random_108m(work / "random-llada-108m", args.seed)))
        models = [
            {
                "label": label,
                "dir": str(path),
                "params": parameters(path),
                "batch": args.batch,
                "prompt_length": args.prompt_length,
                "prompts": prompts_for(path, args.batch, args.prompt_length, args.prompt_seed),
                "gen_length": args.gen_length,
                "block_length": LLADA_BLOCK,
                "steps": args.gen_length,
            }
            for label, path in dirs
        ]
        import jax

        bonsai = BonsaiProcess(args.bonsai_python, {"models": models}, work)
        try:
            results = measure(models, bonsai, args.repeats, tuple(args.settings))
        finally:
            record = bonsai.finish()
    git = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    meta = {
        "time": time.strftime("%Y-%m-%d %H:%M"),
        "commit": subprocess.run(git, capture_output=True, text=True).stdout.strip(),
        "argv": sys.argv[1:] if argv is None else argv,
        "repeats": args.repeats,
        "psd_jax_jax": jax.__version__,
        "bonsai": record["meta"],
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_before_after": [load_before, os.getloadavg()],
    }
    report = report_of(meta, models, results, record)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(report)
    (out / "table.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bonsai-worker"]:
        sys.exit(bonsai_worker(*sys.argv[2:4]))
    sys.exit(main())
