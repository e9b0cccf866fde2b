"""Run a proposer's CUDA-graph path on the CPU: a ``GraphCache`` made ``enabled`` whose "replay"
runs the captured function on the key's static buffers (the padded batch bucket and whatever
staging the graph would read), so CPU tests cover the graph path's logic."""

from __future__ import annotations


def replay_on_cpu(monkeypatch, graphs) -> list:
    """Patch ``graphs`` (a ``speculant.drafting.GraphCache``); returns the list of keys replayed."""
    keys: list = []

    def replay(key, fn):
        keys.append(key)
        return fn(*graphs.inputs[key])

    monkeypatch.setattr(graphs, "enabled", True)
    monkeypatch.setattr(graphs, "replay", replay)
    return keys
