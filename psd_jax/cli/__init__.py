"""The command lines of the library (``python -m psd_jax.generate``, ``python -m psd_jax.bench``) and
the flags every front end shares (``flags``): settings from ``DecodeConfig``, the model's start-up."""
