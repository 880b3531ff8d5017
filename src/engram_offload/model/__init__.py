"""A small trained Engram language model: the model (``lm``), its released-format checkpoint
(``checkpoint_io``), seeded CPU training (``train``), held-out evaluation from any tier
(``evaluate``, ``serving``), the gate scan (``scan``), the cache replay (``cache_sim``) and the
experimental, off-by-default read-skip predictor (``skip``)."""

from .checkpoint_io import load_model, save_model, shipped_model_dir
from .lm import EngramLM, ProbedEngramLayer

__all__ = ["EngramLM", "ProbedEngramLayer", "load_model", "save_model", "shipped_model_dir"]
