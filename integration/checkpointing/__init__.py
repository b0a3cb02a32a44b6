"""Checkpoints: the fallback for fatal losses only.

- :mod:`.manifest`: a checkpoint's manifest and step directories (pure: the coordinator
  reads them without torch).
- :mod:`.checkpoint`: periodic, atomic, checksummed writes and reads of a rank's state.
"""
