"""Expert offload: experts live in pinned host memory and each MoE layer keeps a GPU pool of a few
expert slots.

- ``trace``: read recorded routing traces (moegen-trace v1) into a compact frozen dataclass.
- ``policies``: per-layer slot caches, eviction policies, prefetch predictors and the
  ``OffloadPolicyEngine`` the runtime (and the simulator) drive per token and layer. Pure Python,
  deterministic, no torch.
- ``simulate``: replay a trace through the engine; hit rate, bytes moved and a link stall model.
- ``simulate_cli``: ``moegen simulate SPEC --trace FILE --slots N``.
"""
