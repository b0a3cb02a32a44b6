"""The pipeline engine and Bamboo's redundancy inside DeepSpeed.

- :mod:`.engine`: Spotline's subclass of DeepSpeed's ``PipelineEngine`` and its config.
- :mod:`.redundancy`: redundant computation of the successor's stage, and the takeover.
- :mod:`.replica`: the replica a stage holds of its successor, its stash and digests.
- :mod:`.replica_transport`: how reduced gradients travel to the replica holder.
- :mod:`.replay_inputs`: what a replay of the successor needs from other stages.
- :mod:`.memory`: model-state memory counted from the tensors.
- :mod:`.clipping`, :mod:`.lr_schedule`: placement-independent clipping, the learning rate
  as a pure function of the step.
- :mod:`.group_setup`: a generation's process groups.
- :mod:`.instruction_profile`: where a pipeline step's time goes, per instruction.
"""
