"""Hierarchy ablations: the same workspace with every synthetic node flattened to the root, or with its files
shuffled among the directories (seeded). Both are new workspaces; the original is untouched."""

from __future__ import annotations

import dataclasses
import random
from typing import Self

from librarian_jax.workspace.nodes import FILE
from librarian_jax.workspace.state import WorkspaceState


class Ablations(WorkspaceState):
    """`flattened()`, `shuffled(seed)`."""

    def flattened(self) -> Self:
        """Hierarchy ablation: every active synthetic node at the root as a plain file with the same title,
        sources and text (a directory becomes the file `merge_NNNN__<slug>.txt` holding its summary)."""
        ws = self.copy()
        nodes = ws._nodes.mutate()
        for nid, n in self._node_items():
            if n.active:
                nodes[nid] = dataclasses.replace(n, parent=None, kind=FILE)
        ws._nodes = nodes.finish()
        ws._changed()
        return ws

    def shuffled(self, seed: int) -> Self:
        """Hierarchy ablation: the same files and directories, but which directory holds each synthetic file
        is a random permutation (seeded) of the original placements; directories keep their places, so every
        directory holds as many files as before."""
        ws = self.copy()
        files = [n for _, n in self._node_items() if n.active and n.kind == FILE]
        slots = [n.parent for n in files]
        random.Random(seed).shuffle(slots)
        nodes = ws._nodes.mutate()
        for n, slot in zip(files, slots, strict=True):
            nodes[n.node_id] = dataclasses.replace(n, parent=slot)
        ws._nodes = nodes.finish()
        ws._changed()
        return ws
