"""Spotline: DeepSpeed pipeline training on preemptible machines.

The package is laid out as the design card asks:

- ``spotline`` (``integration/``): the adapters that run a plan inside DeepSpeed and torch.
- ``spotline.plan``: pure planning code (no torch, no DeepSpeed import).
- ``spotline.launch`` (``launch/``): entry points, the local launcher, trace replay.
- ``spotline.patches`` (``patches/``): small, version-checked DeepSpeed patches.
"""

__version__ = "0.1.0"
