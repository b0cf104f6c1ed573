"""The measurements behind docs' figures and tables; each module's docstring names the doc it
feeds, and the doc gives the command that made its numbers."""
