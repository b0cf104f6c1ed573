"""The decode itself: settings (``config``) and the compile key apart from per-row values
(``runtime``), the rules every decoder shares (``rules``) and those each policy (``policies``) and
decoder (``decoders``) owns, the prediction from logits (``predict``), the canvas layouts and their
caches (``layouts``), the compiled loop (``engine``), a model's parameters on their devices and the
programs compiled for it (``placed_model``), the block-by-block session a server drives
(``block_decode``), and what a decode reports (``records``, ``calls``)."""
