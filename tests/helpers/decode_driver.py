"""Test helpers shared by the PSD and RPS tests: the decode loop's pieces, jitted, step by step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from psd_jax import DecodeConfig
from psd_jax.core.decoders import propose
from psd_jax.core.engine import Loop, init_state, step
from psd_jax.core.runtime import Program, RowValues


def unpad(prompt, mask=None):
    """A golden left-padded prompt row -> its token ids without the padding."""
    prompt = np.asarray(prompt)
    return prompt[np.asarray(mask).astype(bool)].tolist() if mask is not None else prompt.tolist()


class Driver:
    """``init_state`` / ``step`` / ``Loop.call`` jitted over the model's params, for batches of
    ``batch`` prompts left-padded to ``prompt_length`` (one compile each, shared by all batches)."""

    def __init__(self, lm, settings: DecodeConfig, batch: int, prompt_length: int):
        self.lm, self.dcfg, self.batch, self.prompt_length = lm, settings, batch, prompt_length
        program, values = Program.of(settings), RowValues.of([settings] * batch)
        self.loop = Loop(lm.config, program, prompt_length, None)  # static helpers only (no model call)

        def loop_of(params):
            model = nnx.merge(lm.graphdef, params)
            return Loop(lm.config, program, prompt_length, model)

        self._init = jax.jit(lambda params, ids, mask, key: init_state(loop_of(params), ids, mask, key, values))
        self._step = jax.jit(lambda params, mask, state: step(loop_of(params), mask, state))
        self._call = jax.jit(lambda params, canvases, mask, key: loop_of(params).call(canvases, mask, key, values))

        def propose_and_verify(params, state, mask, key):
            loop = loop_of(params)
            proposal = propose(state.pred, state.canvas, loop.committable(state), state.step, program, values)
            return proposal, loop.call(proposal.candidates, mask, key, values)

        self._propose_and_verify = jax.jit(propose_and_verify)

    def inputs(self, prompt_rows):
        """Left-padded prompt ids [B, P] and the canvas attention mask [B, P + gen_length]."""
        ids = np.full((self.batch, self.prompt_length), self.lm.config.pad_id, np.int32)
        mask = np.zeros_like(ids)
        for r, p in enumerate(prompt_rows):
            ids[r, self.prompt_length - len(p) :] = p
            mask[r, self.prompt_length - len(p) :] = 1
        full = np.concatenate([mask, np.ones((self.batch, self.dcfg.gen_length), np.int32)], axis=1)
        return jnp.asarray(ids), jnp.asarray(full)

    def trajectory(self, prompt_rows, seed: int = 0, max_iterations: int = 500):
        """Every state from ``init_state`` to the end, as ``engine.run_python_loop`` runs them."""
        assert len(prompt_rows) == self.batch
        ids, mask = self.inputs(prompt_rows)
        state = self._init(self.lm.params, ids, mask, jax.random.key(seed))
        states = [state]
        while not bool(jnp.all(state.done)):
            assert len(states) < max_iterations
            state = self._step(self.lm.params, mask, state)
            states.append(state)
        return states, mask

    def call(self, canvases, mask, key=None):
        """``Loop.call``: one model call over canvases [B, K, N]."""
        return self._call(self.lm.params, canvases, mask, jax.random.key(0) if key is None else key)

    def propose_and_verify(self, state, mask, key=None):
        """The decoder's proposal from ``state`` and ``Loop.call`` over all its candidates at once."""
        return self._propose_and_verify(self.lm.params, state, mask, jax.random.key(0) if key is None else key)
