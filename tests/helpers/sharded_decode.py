"""Run in a subprocess with 8 simulated CPU devices: decode on several meshes, print JSON.

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/helpers/sharded_decode.py CKPT [MOE_CKPT [WORD_MODEL OUT [SDAR_CKPT [DIFFUSION_GEMMA_CKPT]]]]

With MOE_CKPT (llada2-tiny: 8 experts, top-2) it also runs LLaDA2.0's forward and one block
diffusion decode per expert mesh; with WORD_MODEL (tests/helpers/word_model.py) and OUT, the command-line
front ends as one process, for the multi-process tests (tests/helpers/multihost_driver.py); with SDAR_CKPT
(sdar-tiny) one cached SDAR decode on a mesh against one device; with DIFFUSION_GEMMA_CKPT
(diffusion-gemma-tiny) a replayed upstream decode on an expert mesh, and the engine's own draws,
its canvas session and its server on a data x model mesh.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np

from psd_jax import DecodeConfig, load_model

PROMPTS = [[474, 488, 482, 450, 262, 258, 71, 195, 146, 187, 330, 492], [280, 242, 425, 15, 2, 138, 188]]
BASE = DecodeConfig(gen_length=32, block_length=16)
DECODERS = {
    "fixed": BASE,
    "threshold": BASE.replace(policy="threshold", threshold=0.7),
    "psd": BASE.replace(policy="threshold", threshold=0.7, decoder="psd", depth=3),
    "rps": BASE.replace(policy="threshold", threshold=0.7, decoder="rps", k_max=4, pivot_tau=0.5),
}
# With the block KV cache the cache arrays [L, B, N, KV, hd] are partitioned by GSPMD inside the
# loop too (each compile costs ~10 s of CI).
CACHED = {
    "fixed+prefix": BASE.replace(cache="prefix"),
    "psd+dual": DECODERS["psd"].replace(cache="dual"),
    "rps+dual": DECODERS["rps"].replace(cache="dual"),
}
# Each (mesh, setting) is one compile (several seconds of CI), so every setting runs on one of the
# two tensor-parallel meshes (the dual cache on both: model=8 splits the cache's head dimension,
# model=4 its KV heads), and pure data parallelism (2 rows do not split over 8) runs the cached PSD.
MESHES = {
    "data=1,model=8": ["fixed", "psd", "fixed+prefix", "rps+dual"],
    "data=2,model=4": ["threshold", "rps", "psd+dual"],
    "data=8,model=1": ["psd+dual"],
}


def same_params(lm, single) -> bool:
    """Whether a mesh load's parameters (each device's blocks read from the files) hold exactly the
    one-device load's values."""
    flat = lambda m: {path: np.asarray(p[...]) for path, p in m.params.flat_state()}  # noqa: E731
    mine, theirs = flat(lm), flat(single)
    return mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)


def kv_cache_sharding(lm) -> list:
    """The sharding of the block KV cache that a cached decode's first state holds, under the mesh."""
    import jax.numpy as jnp
    from flax import nnx

    from psd_jax.core.engine import _loop_for, init_state
    from psd_jax.core.layouts import canvas_attention_mask
    from psd_jax.core.runtime import Program, RowValues

    settings = CACHED["psd+dual"]
    ids, mask = jnp.ones((2, 16), jnp.int32), jnp.ones((2, 16), jnp.int32)

    def first_state(params):
        loop = _loop_for(nnx.merge(lm.graphdef, params), 16, lm.config, Program.of(settings))
        values = RowValues.of([settings] * 2)
        return init_state(loop, ids, canvas_attention_mask(mask, settings.gen_length), jax.random.key(0), values)

    with jax.set_mesh(lm.mesh):
        state = jax.jit(first_state)(lm.params)
    spec = [list(axis) if isinstance(axis, tuple) else axis for axis in state.cache[0].sharding.spec]
    return spec + [None] * (state.cache[0].ndim - len(spec))  # JAX drops trailing Nones


# LLaDA2.0 on expert meshes: forward logits (one compile each) and a decode against one device.
# 8 rows of 24 tokens (no activation dim equals the expert weights'): every expert mesh splits them
# over data x expert (models.moe.row_axes), the data-parallel attention path.
_ROWS = [[5, 77, 301, 12, 9, 480, 33, 2, 150, 64, 7, 260] * 2, [44, 3, 91, 500, 17, 230, 8, 1, 66, 402, 13, 99] * 2]
MOE_IDS = [_ROWS[r % 2][r:] + _ROWS[r % 2][:r] for r in range(8)]
MOE_RTOL = 2e-6  # test_llada2's float32-rounding rtol (CACHE_RTOL)
# One block-diffusion setting per expert mesh (each a compile on the mesh and one on one device):
# uncached, the exact block cache, and PSD on the cache. The three prompts of the golden setting
# g32b8s4t07 (10, 21 and 16 tokens: a padded batch; upstream decodes them in 9, 15 and 12 calls) and
# a fourth: 4 rows are replicated on expert=8 and split over data x expert on the other two meshes.
MOE_PROMPTS = [
    [148, 62, 268, 325, 17, 51, 134, 453, 262, 402],
    [329, 191, 348, 455, 258, 408, 338, 101, 45, 214, 429, 476, 230, 133, 267, 311, 501, 165, 474, 213, 411],
    [416, 124, 303, 287, 182, 266, 408, 493, 304, 242, 189, 303, 215, 368, 345, 479],
    _ROWS[1][:13],
]
MOE_BASE = DecodeConfig(
    gen_length=32, block_length=8, steps=4, policy="threshold_schedule", threshold=0.7, eos_early_stop=False
)
MOE_DECODE = {
    "expert=8": MOE_BASE,
    "data=2,expert=2,model=2": MOE_BASE.replace(cache="prefix"),
    "expert=4,model=2": MOE_BASE.replace(cache="prefix", decoder="psd", depth=2),
}
MOE_MESHES = list(MOE_DECODE)


def expert_weight_collectives(hlo: str, d_model: int, hidden: set[int]) -> list[str]:
    """Collectives in compiled HLO whose result is shaped like expert weights: rank >= 3 with trailing
    dims (d_model, F) or (F, d_model), F the expert hidden size or its ``model`` shard."""
    from psd_jax.parallel.sharding import collectives

    found = []
    for kind, shapes in collectives(hlo):
        for shape in shapes:
            if len(shape) >= 3 and (
                (shape[-2] == d_model and shape[-1] in hidden) or (shape[-1] == d_model and shape[-2] in hidden)
            ):
                found.append(f"{kind} {shape}")
    return found


def moe_meshes(ckpt: str) -> dict:
    import jax.numpy as jnp

    from models.moe import row_axes

    ids = jnp.asarray(MOE_IDS, jnp.int32)
    single = load_model(ckpt)
    two_rows = np.asarray(single.logits(ids[:2]))
    out = {}
    decoded = lambda lm, settings: [[r.output_ids, r.nfe] for r in lm.generate(MOE_PROMPTS, settings)]  # noqa: E731
    for mesh in MOE_MESHES:
        start = time.perf_counter()
        lm = load_model(ckpt, mesh=mesh)
        params = {path[-1]: param[...] for path, param in lm.params.flat_state()}
        split = sorted(name for name, a in params.items() if not a.sharding.is_fully_replicated)
        params_equal = same_params(lm, single)
        expert_shards = {
            name: list(params[name].sharding.shard_shape(params[name].shape)) for name in split if "expert" in name
        }
        sharded = lm.logits(ids)  # under the mesh, as generate compiles: routed experts run expert-parallel
        logits = np.asarray(sharded)
        # One device computing the rows each device holds: XLA:CPU's float32 sums depend on the row
        # count (batch 8 against 1 row at a time: 1.05e-5 at logits up to 18), so the reference is
        # the single device's logits at the mesh's rows per device.
        shards = math.prod(lm.mesh.shape[a] for a in np.atleast_1d(row_axes(dict(lm.mesh.shape), len(MOE_IDS))) if a)
        per_device = len(MOE_IDS) // shards
        reference = np.concatenate(
            [np.asarray(single.logits(ids[r : r + per_device])) for r in range(0, len(ids), per_device)]
        )
        out[mesh] = {
            "split_params": split,
            "params_equal": params_equal,
            "expert_shards": expert_shards,
            "rows_per_device": per_device,
            "logit_rows_per_device": sharded.sharding.shard_shape(sharded.shape)[0],
            "max_abs_diff": float(np.abs(logits - reference).max()),
            # beyond float32 rounding of the tensor-parallel sums: |diff| - rtol * |reference|
            "max_excess": float((np.abs(logits - reference) - MOE_RTOL * np.abs(reference)).max()),
            # 2 rows: replicated over expert on every expert mesh (row_axes), each device's experts
            # run on the whole batch and one all-reduce of exact zeros-or-values sums finishes
            "two_rows_max_abs_diff": float(np.abs(np.asarray(lm.logits(ids[:2])) - two_rows).max()),
            "decoded": decoded(lm, MOE_DECODE[mesh]),
            "decoded_reference": decoded(single, MOE_DECODE[mesh]),
        }
        print(f"llada2 {mesh} logits: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return out


def front_end_references(word_model: str, out: str) -> dict:
    """What one process on the 8 devices prints and writes for the multi-process front ends
    (tests/helpers/multihost_driver.py, run here without multi-process flags), and the server's answers:
    each served prompt decoded alone."""
    from pathlib import Path

    from psd_jax.model_dir import model_settings

    from multihost_driver import PROMPT_BUCKET, SERVE_MESH, SERVE_PROMPTS, TEXT_REFERENCE, run_front_ends

    # generate once (its printed text); the other settings' tokens are the mesh decodes' above.
    runs = run_front_ends(Path(word_model), [], settings_run=[TEXT_REFERENCE])
    lm = load_model(word_model, mesh=SERVE_MESH)
    settings = model_settings(word_model, {"policy": "threshold", "threshold": 0.7})
    served = [lm.generate([prompt], settings, prompt_bucket=int(PROMPT_BUCKET))[0] for prompt in SERVE_PROMPTS]
    answers = [{"text": g.text, "token_ids": g.output_ids[: g.tokens], "model_calls": g.nfe} for g in served]
    single = load_model(word_model)
    block_decode = [[g.output_ids, g.nfe] for p, s in SERVE_ROWS for g in single.generate([p], s, prompt_bucket=16)]
    return {"runs": runs, "served": answers, "block_decode_reference": block_decode}


# Serving on a mesh: a running batch that grows (regroup 2 -> 4), takes joined rows with their own
# runtime values, and shrinks (regroup 4 -> 2) as rows finish; then the HTTP server on the mesh,
# continuous and static, with concurrent requests of different lengths and thresholds.
SERVE_MESH = "data=2,model=4"
SERVE_BASE = DecodeConfig(gen_length=32, block_length=16, policy="threshold", threshold=0.7)
SERVE_ROWS = [
    (PROMPTS[0], SERVE_BASE),
    (PROMPTS[1], SERVE_BASE.replace(threshold=0.5)),
    (PROMPTS[1][2:] + [77, 301], SERVE_BASE.replace(threshold=0.9)),
    (PROMPTS[0][4:], SERVE_BASE.replace(gen_length=16)),
]
SERVE_SIZES = (1, 2, 4)


def block_decode_rows(lm) -> list[list]:
    """``SERVE_ROWS`` through one ``BlockDecode`` with joins and regroups (each row's generated ids
    and model calls), as the continuous batcher drives it."""
    (p0, s0), (p1, s1), (p2, s2), (p3, s3) = SERVE_ROWS
    run = lm.start_rows([p0, p1], [s0, s1], [0, 0], batch_size=2, prompt_bucket=16, gen_length=32)
    run.advance()
    run.regroup([0, 1, -1, -1])
    run.join([2, 3], [p2, p3], [s2, s3], [0, 0])
    rows, got = [0, 1, 2, 3], {}
    while len(got) < len(SERVE_ROWS):
        progress = run.advance()
        for at, row in enumerate(rows):
            if row is not None and progress.done[at] and row not in got:
                got[row] = [progress.generated[at, : progress.gen_length[at]].tolist(), int(progress.nfe[at])]
        live = [at for at, row in enumerate(rows) if row is not None and row not in got]
        if live and len(live) <= 2 and run.size == 4:  # the batch shrinks to the rows still decoding
            run.regroup(live + [-1] * (2 - len(live)))
            rows = [rows[at] for at in live] + [None] * (2 - len(live))
    return [got[row] for row in range(len(SERVE_ROWS))]


def served_rows(lm, batching: str) -> dict:
    """``SERVE_ROWS`` as concurrent HTTP requests (token ids) to a server of ``lm``: each answer's
    token ids and model calls, and the batcher's counts."""
    import socket
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import uvicorn

    from psd_jax.serve import build_app

    app = build_app(
        lm, SERVE_BASE, name="tiny", batch_sizes=SERVE_SIZES, prompt_bucket=16, batching=batching, max_wait_ms=100
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 120
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server on the mesh did not start in 120 s"
            time.sleep(0.05)

        def complete(row: int) -> list:
            prompt, settings = SERVE_ROWS[row]
            time.sleep(0.3 * row)  # arrivals spread over the first rows' blocks: joins and regroups
            body = {"model": "tiny", "prompt": prompt, "max_tokens": settings.gen_length}
            body["threshold"] = settings.threshold
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
            return [answer["choices"][0]["token_ids"], answer["usage"]["model_calls"]]

        with ThreadPoolExecutor(len(SERVE_ROWS)) as pool:
            answers = list(pool.map(complete, range(len(SERVE_ROWS))))
        health = httpx.get(f"{url}/health", timeout=60).json()
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
    return {"answers": answers, "failed_batches": health["failed_batches"], "batches": health["batches"]}


def serving_on_a_mesh(ckpt: str) -> dict:
    single = load_model(ckpt)
    lm = load_model(ckpt, mesh=SERVE_MESH)
    reference = []
    for prompt, settings in SERVE_ROWS:
        (g,) = single.generate([prompt], settings, prompt_bucket=16)
        reference.append([g.output_ids, g.nfe, g.tokens])
    out = {"reference": reference, "block_decode": block_decode_rows(lm)}
    for batching in ("continuous", "static"):
        start = time.perf_counter()
        out[batching] = served_rows(lm, batching)
        print(f"serving {batching} on {SERVE_MESH}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return out


def main(
    ckpt: str,
    moe_ckpt: str | None = None,
    word_model: str | None = None,
    out_dir: str | None = None,
    sdar_ckpt: str | None = None,
    diffusion_gemma_ckpt: str | None = None,
) -> None:
    assert jax.device_count() == 8, jax.devices()
    out = {"reference": {}, "meshes": {}}
    single = load_model(ckpt)
    for name, settings in {**DECODERS, **CACHED}.items():
        out["reference"][name] = [[r.output_ids, r.nfe] for r in single.generate(PROMPTS, settings, prompt_bucket=16)]
    for mesh, names in MESHES.items():
        lm = load_model(ckpt, mesh=mesh)
        # Parameter names (a path's last key: the same in the stacked and the unrolled layout).
        split = sorted(
            {path[-1] for path, param in lm.params.flat_state() if not param[...].sharding.is_fully_replicated}
        )
        out["meshes"][mesh] = {
            "split_params": split,
            "kv_cache_spec": kv_cache_sharding(lm),
            "params_equal": same_params(lm, single),
        }
        for name in names:
            settings = {**DECODERS, **CACHED}[name]
            start = time.perf_counter()
            out["meshes"][mesh][name] = [
                [r.output_ids, r.nfe] for r in lm.generate(PROMPTS, settings, prompt_bucket=16)
            ]
            print(f"{mesh} {name}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    out["int8"] = quantized_meshes(ckpt)
    out["serving"] = serving_on_a_mesh(ckpt)
    if moe_ckpt is not None:
        out["moe"] = moe_meshes(moe_ckpt)
        out["moe_int8"] = quantized_expert_mesh(moe_ckpt)
    if word_model is not None:
        out["front_ends"] = front_end_references(word_model, out_dir)
    if sdar_ckpt is not None:
        out["sdar"] = sdar_mesh(sdar_ckpt)
    if diffusion_gemma_ckpt is not None:
        out["diffusion_gemma"] = diffusion_gemma_meshes(diffusion_gemma_ckpt)
    print(json.dumps(out))


# DiffusionGemma: an upstream decode replayed on an expert mesh (experts over ``expert``, heads over
# ``model``, rows over nothing: 2 rows, data=1), and the engine's own draws on one device, which
# tests/parallel/test_multihost.py's two processes decode on a data x model mesh (``DG_OWN_MESH``).
DG_REPLAY_MESH, DG_OWN_MESH = "data=1,expert=4,model=2", "data=2,model=4"
DG_CASE = "generate_eb2_s8_nostop_batch_p0p2"  # 3 canvases of 8 steps, a row ending in canvas 2
DG_REPLAY = dict(gen_length=96, max_denoising_steps=8, entropy_bound=2.0, t_min=0.2, t_max=1.0,
                 stability_threshold=0, confidence_threshold=0.0, prompt_bucket=None)  # fmt: skip
DG_OWN = dict(gen_length=64, max_denoising_steps=6, seed=3)


def diffusion_gemma_meshes(ckpt: str) -> dict:
    """The replayed golden's rows on ``DG_REPLAY_MESH`` (ids, nfe, decoder passes) and which
    parameters it split; the own-draws rows on one device (``DG_OWN_MESH``'s decode is
    tests/parallel/test_multihost.py's, across two processes)."""
    from diffusion_gemma_goldens import golden_case

    from psd_jax.diffusion_gemma_api import read_draws

    start = time.perf_counter()
    c = golden_case(DG_CASE)
    prompts = [ids[mask.astype(bool)].tolist() for ids, mask in zip(c["prompt"], c["attention_mask"])]
    rows = lambda out: [[g.output_ids, g.nfe, g.stats["decoder_passes"]] for g in out]  # noqa: E731
    draws = read_draws(f"{Path(ckpt).parent / 'diffusion_gemma_cases.safetensors'}:diffusion-gemma-tiny.{DG_CASE}")
    lm = load_model(ckpt, mesh=DG_REPLAY_MESH)
    split = {path[-1]: str(p[...].sharding.spec) for path, p in lm.params.flat_state()
             if not p[...].sharding.is_fully_replicated}  # fmt: skip
    out = {DG_REPLAY_MESH: {"decoded": rows(lm.generate(prompts, draws=draws, **DG_REPLAY)), "split_params": split}}
    single = load_model(ckpt)
    out["own_reference"] = rows(single.generate(prompts, **DG_OWN))
    print(f"diffusion_gemma meshes: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    start = time.perf_counter()
    on_mesh = load_model(ckpt, mesh=DG_OWN_MESH)
    out["serving"] = {
        "session": canvas_session_rows(on_mesh),
        "served_reference": diffusion_gemma_served_reference(single),
    }
    print(f"diffusion_gemma serving on {DG_OWN_MESH}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return out


# DiffusionGemma served on ``DG_OWN_MESH``: rows of their own prompts, lengths, seeds and entropy
# bounds (``DG_SERVE`` the server's settings); the first ``DG_SERVED`` of them differ only in
# length and seed, the requests that tests/parallel/test_multihost.py's two processes answer too.
DG_SERVE = dict(gen_length=64, max_denoising_steps=6)
DG_SERVE_ROWS = [  # (prompt ids, settings over DG_SERVE, seed)
    ([2, 40, 41, 42, 43, 44, 45], {}, 0),
    ([2, 7, 9], {"gen_length": 32}, 5),
    ([2, 5, 9, 11, 13], {"entropy_bound": 2.0}, 2),
]
DG_SERVED = 2
DG_PROMPT_BUCKET = 16


def canvas_session_rows(lm) -> list[list]:
    """``DG_SERVE_ROWS`` through one ``CanvasSession`` as the continuous batcher drives it: the
    first row alone (one row: whole on every device), the batch grown to two rows (split over
    ``data``) for the next, the third joined into the first free row, and the batch shrunk to the
    row still decoding. Each row's ids (its own length) and denoiser calls."""
    settings = [lm.settings(None, {**DG_SERVE, **extra}) for _, extra, _ in DG_SERVE_ROWS]
    prompts, seeds = [p for p, _, _ in DG_SERVE_ROWS], [seed for _, _, seed in DG_SERVE_ROWS]
    run = lm.start_rows(prompts[:1], settings[:1], seeds[:1], batch_size=1, prompt_bucket=DG_PROMPT_BUCKET)
    run.advance()
    run.regroup([0, -1])
    slots, waiting, got = [0, None], [1, 2], {}
    while len(got) < len(DG_SERVE_ROWS):
        for at in [at for at, row in enumerate(slots) if row is None][: len(waiting)]:
            row = slots[at] = waiting.pop(0)
            run.join([at], [prompts[row]], [settings[row]], [seeds[row]])
        progress = run.advance()
        for at, row in enumerate(slots):
            if row is not None and progress.done[at]:
                got[row] = [progress.generated[at, : progress.gen_length[at]].tolist(), int(progress.nfe[at])]
                slots[at] = None
        live = [at for at, row in enumerate(slots) if row is not None]
        if run.size == 2 and len(live) == 1 and not waiting:
            run.regroup(live)
            slots = [slots[live[0]]]
    return [got[row] for row in range(len(DG_SERVE_ROWS))]


def served_answers(url: str, model: str, rows: list) -> list[list]:
    """``rows`` (prompt ids, settings, seed) as concurrent completions, the later ones sent a little
    after (they join a running batch): each answer's token ids and model calls."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def complete(i: int) -> list:
        prompt, extra, seed = rows[i]
        time.sleep(0.3 * i)
        body = {"model": model, "prompt": prompt, "max_tokens": extra.get("gen_length", DG_SERVE["gen_length"])}
        body.update({k: v for k, v in extra.items() if k != "gen_length"}, seed=seed)
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
        return [answer["choices"][0]["token_ids"], answer["usage"]["model_calls"]]

    with ThreadPoolExecutor(len(rows)) as pool:
        return list(pool.map(complete, range(len(rows))))


def diffusion_gemma_served_reference(lm) -> list[list]:
    """Each of ``DG_SERVE_ROWS`` decoded alone by ``generate``: its ids, calls and tokens before its end."""
    out = []
    for prompt, extra, seed in DG_SERVE_ROWS:
        (g,) = lm.generate(
            [prompt], lm.settings(None, {**DG_SERVE, **extra}), seed=seed, prompt_bucket=DG_PROMPT_BUCKET
        )
        out.append([g.output_ids, g.nfe, g.tokens])
    return out


# SDAR (block-causal, dense): rows over ``data``, heads and kv heads over ``model``; the exact block
# cache with the evaluation decoder's dynamic threshold, the golden prompts and a fourth row.
SDAR_MESH = "data=4,model=2"
SDAR_PROMPTS = [[91, 400, 12], [5, 77, 301, 12, 9, 480, 33, 2, 150, 64, 7, 260, 44], _ROWS[1][:24], _ROWS[0][:9]]
SDAR_DECODE = DecodeConfig(gen_length=32, block_length=4, steps=4, policy="threshold_schedule", threshold=0.5)


def sdar_mesh(ckpt: str) -> dict:
    """SDAR's cached decode on ``SDAR_MESH`` and on one device: tokens and model calls per row."""
    start = time.perf_counter()
    settings = SDAR_DECODE.replace(cache="prefix")
    decoded = lambda lm: [[r.output_ids, r.nfe] for r in lm.generate(SDAR_PROMPTS, settings)]  # noqa: E731
    lm = load_model(ckpt, mesh=SDAR_MESH)
    split = sorted({path[-1] for path, p in lm.params.flat_state() if not p[...].sharding.is_fully_replicated})
    out = {"decoded": decoded(lm), "reference": decoded(load_model(ckpt)), "split_params": split}
    print(f"sdar {SDAR_MESH}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return out


def quantized_meshes(ckpt: str) -> dict:
    """int8 on each mesh: its tokens, one device's, and whether the loader's quantize-on-the-host
    then shard gives exactly the arrays of quantizing the sharded float weights where they lie."""
    from models.quantize import PROJECTIONS

    settings = DecodeConfig(gen_length=32, block_length=16, policy="threshold")
    one = load_model(ckpt, quantize="int8", unroll_layers=False)
    out = {"reference": [r.output_ids for r in one.generate(PROMPTS, settings, prompt_bucket=16)]}
    for mesh in MESHES:
        lm = load_model(ckpt, quantize="int8", mesh=mesh, unroll_layers=False)
        floats = load_model(ckpt, mesh=mesh, unroll_layers=False)
        same = quantized_as_loaded(lm, floats)
        assert set(same) == set(PROJECTIONS)
        split = not lm.model.wq.get_value().qvalue.sharding.is_fully_replicated
        out[mesh] = {
            "tokens": [r.output_ids for r in lm.generate(PROMPTS, settings, prompt_bucket=16)],
            "arrays_equal": all(same.values()),
            "qvalue_split": split,
        }
    return out


# int8 LLaDA2.0 on the expert mesh that splits experts over ``expert`` and their hidden units over
# ``model`` (the down projection's per-channel scales then stay whole over ``model``).
MOE_INT8_MESH = "expert=4,model=2"


def quantized_as_loaded(lm, floats) -> dict[str, bool]:
    """Per quantized projection: whether ``lm``'s (quantized, then sharded) integers and scales
    equal ``floats``' weights quantized in place (sharded, then quantized)."""
    from models import param_shapes
    from models.quantize import is_projection, quantize_weight

    same = {}
    for name in [name for name in param_shapes(lm.config) if is_projection(name)]:
        loaded = getattr(lm.model, name).get_value()
        in_place = quantize_weight(getattr(floats.model, name).get_value(), "int8")
        same[name] = all(
            bool((np.asarray(getattr(loaded, a)) == np.asarray(getattr(in_place, a))).all())
            for a in ("qvalue", "scale")
        )
    return same


def quantized_expert_mesh(ckpt: str) -> dict:
    """int8 LLaDA2.0 on ``MOE_INT8_MESH``: whether every quantized parameter (fused QKV, dense and
    shared MLPs, routed experts) loaded by quantize-then-shard equals shard-then-quantize, how the
    expert weights' integers and scales are split, and the first MoE layer's routed experts run
    expert parallel on those int8 shards (``models.moe.expert_parallel``: quantized weights through
    ``jax.shard_map``) against the same layer on one device. The rest of the forward on a mesh is
    the partitioner's, as for int8 LLaDA (``quantized_meshes``); one layer keeps the compile small."""
    import jax.numpy as jnp

    from models.moe import route, routed_experts
    from models.transformer import swiglu

    start = time.perf_counter()
    lm = load_model(ckpt, quantize="int8", mesh=MOE_INT8_MESH, unroll_layers=False)
    floats = load_model(ckpt, mesh=MOE_INT8_MESH, unroll_layers=False)
    same = quantized_as_loaded(lm, floats)
    names = ("moe_expert_gate", "moe_expert_up", "moe_expert_down", "moe_router", "moe_expert_bias")
    weights = [getattr(lm.model, name).get_value() for name in names]
    cfg = lm.config

    def first_layer(x, gate, up, down, router, bias):
        chosen, scores = route(
            x,
            router[0],
            bias[0],
            top_k=cfg.n_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            scaling=cfg.routed_scaling_factor,
        )
        return routed_experts(x, chosen, scores, gate[0], up[0], down[0], swiglu, batch=len(MOE_IDS))

    rows = jax.random.normal(jax.random.key(0), (len(MOE_IDS) * 3, cfg.d_model), jnp.float32)
    with jax.set_mesh(lm.mesh):
        sharded = np.asarray(jax.jit(first_layer)(rows, *weights))
    device = jax.devices()[0]
    reference = np.asarray(jax.jit(first_layer)(*jax.device_put((rows, *weights), device)))
    out = {
        "arrays_equal": same,
        "expert_shards": {
            name: {
                part: list(getattr(w, part).sharding.shard_shape(getattr(w, part).shape))
                for part in ("qvalue", "scale")
            }
            for name, w in zip(names[:3], weights[:3])
        },
        # float32 rounding of the sums over the model shards: |diff| - rtol * |reference|
        "layer_max_excess": float((np.abs(sharded - reference) - MOE_RTOL * np.abs(reference)).max()),
        "layer_max_abs": float(np.abs(reference).max()),
    }
    print(f"llada2 int8 {MOE_INT8_MESH}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return out


if __name__ == "__main__":
    main(*sys.argv[1:7])
