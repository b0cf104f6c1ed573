"""Tools run from the repository root (``python -m scripts.<group>.<name>``), not part of the library.

``scripts.tools``: what a user runs beside the library (load generator, paired accuracy);
``scripts.figures``: the measurements behind docs' tables, each named in the doc it feeds;
``scripts.device`` with ``scripts/device_check.sh``: the prepared check for an accelerator machine;
``scripts.default_model``: the shipped default model's recipe (task, tokenizer, held-out set,
training and probe).
"""
