"""Streaming DiLoCo across groups of nodes, the engine inside each group: the outer
synchronization (diloco.py), its fragments (fragments.py) and its edges, the final
synchronization, healing and joining (edges.py)."""
