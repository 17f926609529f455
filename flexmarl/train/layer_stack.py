"""A train state's per-layer arrays stacked along a leading layer axis, for checkpoints.

A checkpoint's cost is per array: Orbax opens, writes and commits each one. The blocks
of a decoder are a dict of identical layers ({0: layer, 1: layer, ...}), so a 30-layer
LoRA agent's state (7 adapters of 2 matrices per layer, with Adam's two moments) is
1,260 small arrays, and saving or restoring one took ~2 s. Stacked, it is 42.

`stack` and `unstack` are inverses over the same structure: a node is a layer dict when
its keys are 0..L-1 (L >= 2) and its layers have one structure and the same leaf
shapes and dtypes. A stacked node is `{STACKED: layer of [L, ...] arrays}`, so a
checkpoint read without a target still says what it holds (`split`). Stacking runs in
host memory (a checkpoint is copied there anyway), so it needs arrays this process can
read whole (`readable`); `unstack` puts each restored layer where the caller says (its
leaf's sharding).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

STACKED = 'stacked_layers'  # the one key of a stacked layer dict


def _shape(x) -> tuple:
  return (tuple(np.shape(x)), np.dtype(x.dtype))


def readable(tree: Any) -> bool:
  """Whether this process holds every array of `tree` whole (not so across hosts)."""
  return all(not isinstance(x, jax.Array) or x.is_fully_addressable
             for x in jax.tree.leaves(tree))


def is_layers(node: Any) -> bool:
  """Whether `node` is a dict of L >= 2 identical layers keyed 0..L-1."""
  if not isinstance(node, dict) or len(node) < 2 or set(node) != set(range(len(node))):
    return False
  first, first_def = jax.tree.flatten(node[0])
  if not first:
    return False
  for i in range(1, len(node)):
    leaves, treedef = jax.tree.flatten(node[i])
    if treedef != first_def or [_shape(x) for x in leaves] != [_shape(x) for x in first]:
      return False
  return True


def stack(tree: Any) -> Any:
  """`tree` with each layer dict replaced by one layer of host arrays [L, ...]."""
  nodes, treedef = jax.tree.flatten(tree, is_leaf=is_layers)
  return treedef.unflatten([
      {STACKED: jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                             *(n[i] for i in range(len(n))))} if is_layers(n) else n
      for n in nodes])


def stacked_target(like: Any, target) -> Any:
  """What Orbax restores a stacked checkpoint of `like`'s structure into: `target(leaf)`
  for the other leaves, host arrays [L, ...] for each layer dict's."""
  nodes, treedef = jax.tree.flatten(like, is_leaf=is_layers)
  return treedef.unflatten([
      {STACKED: jax.tree.map(lambda x: np.empty((len(n),) + tuple(np.shape(x)), x.dtype), n[0])}
      if is_layers(n) else jax.tree.map(target, n) for n in nodes])


def unstack(restored: Any, like: Any, place) -> Any:
  """`restored` (stacked) back in `like`'s structure; each layer's leaf is
  `place(value, like's leaf)`."""
  nodes, treedef = jax.tree.flatten(like, is_leaf=is_layers)
  parts = treedef.flatten_up_to(restored)
  out = []
  for node, part in zip(nodes, parts):
    if is_layers(node):
      out.append({i: jax.tree.map(lambda s, l, i=i: place(s[i], l), part[STACKED], node[i])
                  for i in range(len(node))})
    else:
      out.append(part)
  return treedef.unflatten(out)


def split(tree: Any) -> Any:
  """A stacked tree read without a target, its layers split again ({0: ..., 1: ...})."""
  if isinstance(tree, (list, tuple)):
    return type(tree)(split(x) for x in tree)
  if not isinstance(tree, dict):
    return tree
  if set(tree) == {STACKED}:
    layers = len(jax.tree.leaves(tree[STACKED])[0])
    return {i: jax.tree.map(lambda x, i=i: x[i], tree[STACKED]) for i in range(layers)}
  return {k: split(v) for k, v in tree.items()}
