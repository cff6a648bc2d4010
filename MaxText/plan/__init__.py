"""Cluster predictions for the planner (`python -m MaxText.aot`): the compiled step's collectives
(`collectives.py`), a bandwidth/latency model of the GPUs' fabric (`fabric.py`), the step time they add up
to (`predict.py`) and a search over mesh shapes, remat and batch (`search.py`).

Nothing here imports MaxText.aot: the planner imports this package, not the other way round."""
