"""The shipped default model (``models/default``), made from scratch (docs/default-model.md).

``tasks``: the synthetic arithmetic word problems it is trained and tested on;
``make_tokenizer``: its byte-level BPE tokenizer; ``make_dataset``: its held-out set (and other
problem sets); ``train``: the training recipe; ``probe``: where a trained model fails. Each runs
from the repository root as ``python -m scripts.default_model.<name>``.
"""
