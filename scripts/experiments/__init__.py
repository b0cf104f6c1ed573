"""Finished experiments, written up in docs/ (see README.md here); run as ``python -m scripts.experiments.<name>``."""
