"""Tools run from the repository root (``python -m scripts.<name>``), not part of the library.

``scripts/`` itself holds user tools (backend comparison, memory and compile-time tables, paired
accuracy, cache benchmark, converter peak memory); ``scripts.default_model`` makes the shipped
default model (its task, tokenizer, held-out set, training recipe and probe);
``scripts.experiments`` keeps finished measurements whose results are written up in docs/.
"""
