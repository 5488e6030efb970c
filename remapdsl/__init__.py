"""remapdsl: one declarative rule file -> exact, sharded loads and saves of model checkpoints."""

__version__ = "0.1.0"
