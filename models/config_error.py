"""The error of a config.json this library cannot run: its own module, so that every family's
config parser (``config``, ``diffusion_gemma_config``) raises it without importing the others."""


class ConfigError(ValueError):
    """A config.json that this library cannot run, with the reason."""
