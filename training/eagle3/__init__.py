"""EAGLE-3 drafter trainer: model, TTT, loss, data, training loop and export."""

__version__ = "0.1.0"
