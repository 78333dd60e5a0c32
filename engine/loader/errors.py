"""Loader errors (own module so every loader can raise them without import cycles)."""


class ModelLoadError(ValueError):
    """A model could not be loaded; the message names the file and the problem."""
