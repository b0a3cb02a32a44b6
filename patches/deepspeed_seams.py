"""The DeepSpeed internals Spotline overrides, each pinned to the source it was verified on.

Spotline patches nothing in DeepSpeed's files: it subclasses ``PipelineEngine`` and
``PipelineModule`` and overrides a handful of methods. Those methods are internal, so a
DeepSpeed release may change them silently; ``tests/test_patches.py`` fails when the source
of any of them differs from the version listed here, pointing at the override to re-check.

Verified on DeepSpeed 0.19.8.
"""

from __future__ import annotations

VERIFIED_VERSIONS = ("0.19.8",)

# symbol -> (first 16 hex digits of the SHA-256 of its source, what Spotline relies on)
SEAMS: dict[str, tuple[str, str]] = {
    "deepspeed.runtime.pipe.engine.PipelineEngine._exec_schedule": (
        "f162568c9f2bf30f",
        "dispatches each instruction by its type through self._INSTRUCTION_MAP (an instance "
        "attribute shadows the class's: each Spotline engine sets its own, "
        "SpotlinePipelineEngine.instruction_handlers), binds the handler to the engine "
        "(MethodType) and calls it with the instruction's kwargs "
        "(spotline.plan.pipe_instructions: Instruction.kwargs)",
    ),
    "deepspeed.runtime.pipe.engine.PipelineEngine._exec_optimizer_step": (
        "6eb5218d55f519c2",
        "calls _take_model_step; RedundantPipelineEngine wraps it with the commit barrier",
    ),
    "deepspeed.runtime.pipe.engine.PipelineEngine._exec_reduce_tied_grads": (
        "00d7e6e1e18d8b62",
        "replaced: tied copies are summed once per step in every placement",
    ),
    "deepspeed.runtime.pipe.engine.PipelineEngine._exec_backward_pass": (
        "ae2eeff56b84d1e4",
        "last stage: DeepSpeedEngine.backward (loss / micro-batches); others: "
        "outputs.backward(grad); frees outputs (StashOutput runs before it)",
    ),
    "deepspeed.runtime.pipe.engine.PipelineEngine._exec_forward_pass": (
        "cf4dfb0f5996528b",
        "stores the output in pipe_buffers['outputs'][buffer_id] (read by StashOutput)",
    ),
    "deepspeed.runtime.pipe.engine.PipelineEngine.eval_batch": (
        "439640583d6943cf",
        "SpotlinePipelineEngine.evaluate: module.eval(), a world barrier, the InferenceSchedule "
        "under no_grad with module.loss_fn per micro-batch; reduce_output=None returns "
        "fwd_outputs on the last stage, bcast_loss=False broadcasts nothing",
    ),
    "deepspeed.runtime.engine.DeepSpeedEngine._take_model_step": (
        "c4c6e01aa1fc4e7d",
        "calls clip_fp32_gradients() for fp32 without ZeRO, then optimizer.step(); with "
        "torch_autocast_z0_gradscaler set (fp16): its unscale_ (with clipping), step and "
        "update instead, the protocol spotline.pipeline.loss_scaling.LossScaler follows",
    ),
    "deepspeed.runtime.engine.DeepSpeedEngine.__init__": (
        "f5140f7abc775d22",
        "creates torch_autocast_z0_gradscaler (a torch GradScaler) for fp16 under "
        "torch_autocast without ZeRO: SpotlinePipelineEngine replaces it with LossScaler",
    ),
    "deepspeed.runtime.engine.DeepSpeedEngine.backward": (
        "89aab0f80f1a80b3",
        "divides the loss by the accumulation steps, then scales it with "
        "torch_autocast_z0_gradscaler.scale when set (fp16's LossScaler)",
    ),
    "deepspeed.runtime.engine.DeepSpeedEngine.clip_fp32_gradients": (
        "c3ad53cbce68a72f",
        "replaced: DeepSpeed's counts only stage 0's gradients in the norm under pipelines",
    ),
    "deepspeed.comm.torch.TorchBackend.new_group": (
        "aa81b6a4e2241d46",
        "calls torch.distributed.new_group(ranks), looked up at call time: "
        "spotline.pipeline.group_setup wraps it while a generation sets up",
    ),
    "deepspeed.runtime.pipe.p2p.send": (
        "a28ede4b78797592",
        "a blocking send is dist.send (deepspeed.comm -> torch.distributed.send, looked up at "
        "call time): spotline.pipeline.group_setup.bind_p2p_waits gives its wait the collectives' timeout",
    ),
    "deepspeed.runtime.pipe.p2p.recv": (
        "788c30fcaed5afd8",
        "a blocking receive is dist.recv from a known rank (deepspeed.comm -> "
        "torch.distributed.recv, looked up at call time): spotline.pipeline.group_setup.bind_p2p_waits",
    ),
    "deepspeed.runtime.pipe.module.PipelineModule._partition_layers": (
        "7289164616d3e075",
        "replaced by PlacedPipelineModule: sets parts and _set_bounds from given boundaries",
    ),
}
