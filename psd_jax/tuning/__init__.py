"""The tuner behind ``python -m psd_jax.tune``: space (candidates), search (successive halving on
paired differences), log (resumable decodes), report (outputs), cli (flags and checks)."""
