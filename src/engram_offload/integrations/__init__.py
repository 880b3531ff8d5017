"""Serving-engine plugins: an Engram table on any engram-offload tier inside vLLM or SGLang.

- ``settings``: the operator's settings (one JSON dict, the same keys for both engines), the
  store they open, and the start-up checks that refuse a wrong table or a tier the engine's
  CUDA-graph mode cannot drive.
- ``lookup``: the engine-neutral lookup of one Engram layer's rank-local rows, with two
  backends: a table the device reads in place (``memory``, ``pinned``, ``shared``) and a
  host-read tier (``direct``, ``mmap``, ``remote``, a row server) staged through pinned memory.
- ``vllm``: the ``vllm.general_plugins`` entry point (patches ``Engram._create_embedding``).
- ``sglang``: the ``sglang.srt.plugins`` entry point (replaces ``EngramEmbedding``).

Nothing here imports an engine at module level: each engine module imports its engine only
when the engine calls it. ``docs/serving.md`` is the operator's guide.
"""
