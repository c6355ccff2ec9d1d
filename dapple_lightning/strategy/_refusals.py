"""What the strategy refuses before any process group exists, each with the fix in its message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dapple_lightning.plan import Plan
from dapple_lightning.strategy._materialize import on_meta
from dapple_lightning.surgery import Chain, find_chain, split_ties

__all__ = [
    "SUPPORTED_PRECISION",
    "auto_chunks_refusal",
    "check_before_start",
    "offload_refusal",
    "sharding_refusal",
    "shared_gpu_refusal",
]

SUPPORTED_PRECISION = frozenset({"32-true", "32", "64-true", "64", "bf16-mixed", "bf16-true", "16-true"})


def check_before_start(
    module: Any,
    precision: str,
    sequential_name: str | Sequence[str] | None,
    plan: Plan | str,
    world_size: int,
    *,
    backend: str = "gloo",
    device: Any = None,
    node_devices: Sequence[Any] = (),
    ranks_per_node: int | None = None,
    recovering: bool = False,
    logging: bool = False,
) -> Chain:
    """The containers to pipeline, once the module, an explicit plan and the devices pass.

    The containers are those named (one path, or a list in the order forward runs them), or the
    module's only one; with several and none named, the message lists them for ``sequential=``.
    """
    if not module.automatic_optimization:
        raise ValueError(
            "dapple supports automatic optimization only: the pipeline schedule runs each micro-batch's "
            "backward itself. Remove `self.automatic_optimization = False` or use strategy='ddp'"
        )
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"precision={precision!r} is not supported by dapple (supported: {sorted(SUPPORTED_PRECISION)}); "
            "16-mixed needs a gradient scaler inside the pipeline's backward, which dapple does not run yet: "
            "use precision='bf16-mixed'"
        )
    if not isinstance(plan, Plan) and on_meta(module):
        raise ValueError(
            "plan='auto' profiles the whole model on every rank, and this one was built on the meta device "
            "(to be materialised stage by stage): give DappleStrategy an explicit plan"
        )
    device_type = getattr(device, "type", "cpu")
    if (problem := shared_gpu_refusal(backend, node_devices, plan)) is not None:
        raise ValueError(problem)
    if (problem := _gloo_on_cuda_refusal(backend, device_type, plan, world_size)) is not None:
        raise ValueError(problem)
    if isinstance(plan, Plan) and any(stage.offload is not None for stage in plan.stages):
        if device_type != "cpu":
            raise ValueError(
                f"the plan offloads stages {[i for i, st in enumerate(plan.stages) if st.offload is not None]}, and "
                f"the device is {device_type}: offload keeps layers on local disk with the CPU as the device, and "
                "has no pinned-memory tier for GPUs yet; leave offload out of the plan (recompute, or more stages, "
                "lower a stage's memory) or train on accelerator='cpu'"
            )
        if (problem := _offload_trainer_refusal(module.trainer)) is not None:
            raise ValueError(problem)
    chain = find_chain(module, sequential_name)
    if (problem := _encoder_decoder_refusal(module, chain, plan, world_size)) is not None:
        raise ValueError(problem)
    if isinstance(plan, Plan):  # plan="auto" profiles the chain's layers and makes a plan that fits them
        plan.check(num_layers=len(chain), world_size=world_size)
        if (problem := _chunks_refusal(plan, logging)) is not None:
            raise ValueError(problem)
        if (problem := sharding_refusal(module, chain, plan, ranks_per_node, recovering)) is not None:
            raise ValueError(problem)
    return chain


def shared_gpu_refusal(backend: str, node_devices: Sequence[Any], plan: Plan | str = "auto") -> str | None:
    """Why NCCL cannot run on these devices of one node, or ``None``: NCCL refuses two ranks on one
    GPU ("Duplicate GPU detected") when their first collective creates the communicator, after setup
    has moved the model; the devices are known before any process group."""
    if backend != "nccl":
        return None
    ranks: dict[Any, list[int]] = {}
    for local_rank, device in enumerate(node_devices):
        if getattr(device, "type", None) == "cuda":
            ranks.setdefault(device, []).append(local_rank)
    shared = {device: on for device, on in ranks.items() if len(on) > 1}
    if not shared:
        return None
    device, on = next(iter(shared.items()))
    layers = plan.num_layers if isinstance(plan, Plan) else "num_layers"
    return (
        f"local ranks {on} would all run on {device}, and NCCL refuses two ranks on one GPU (its communicator "
        "fails with 'Duplicate GPU detected'): give every rank a GPU of its own (parallel_devices without "
        "repeats, or devices= at most torch.cuda.device_count()), or share the GPU under "
        "process_group_backend='gloo' with a one-stage plan "
        f"(Plan.data_parallel({layers}, {len(node_devices)})), which only all-reduces"
    )


def _chunks_refusal(plan: Plan, logging: bool) -> str | None:
    """What a plan with several stages per rank group cannot run with yet: the log that replays a
    lost rank's stage (a lost rank of a replicated group recovers from its replica as without chunks)."""
    if plan.chunks > 1 and logging:
        return (
            f"recovery='log' keeps a log to replay a lost rank's stage, and the plan gives each rank group "
            f"{plan.chunks} stages (chunks), which the replay does not handle yet: use recovery='auto' (under "
            "torchrun --max-restarts a lost rank recovers from a replica of its rank group; give every group "
            "2 or more replicas), or set chunks: 1"
        )
    return None


def sharding_refusal(module: Any, chain: Chain, plan: Plan, ranks_per_node: int | None, recovery: bool) -> str | None:
    """Why ``plan``'s sharded stages (``shard:``) cannot run here, or ``None``."""
    sharded = [s for s, stage in enumerate(plan.stages) if stage.shard is not None]
    if not sharded:
        return None
    if recovery:
        return (
            f"recovery is on and stages {sharded} shard their state: recovery gives a lost rank its stage's state "
            "from a replica, and a sharded stage's replicas each hold only their own shard of it. Turn recovery "
            "off (recovery=False; a restart then resumes from the last checkpoint) or drop `shard`"
        )
    if ranks_per_node:
        for s in sharded:
            nodes = sorted({rank // ranks_per_node for rank in plan.stage_ranks(s)})
            if len(nodes) > 1:
                return (
                    f"stage {s} shards its state over ranks {list(plan.stage_ranks(s))}, on nodes {nodes}: hybrid "
                    "sharding (shard within a node, replicate across nodes) is not built yet, and sharding across "
                    "nodes would gather every layer over the slower link. Give the stage ranks of one node "
                    "(`ranks:` in the plan) or drop `shard`"
                )
    stage_of = {index: s for s, stage in enumerate(plan.stages) for index in range(stage.start, stage.end)}
    layers = chain.named_layers()
    for param in split_ties(module, chain, plan):
        held = sorted(
            {stage_of[i] for i, (_, layer) in enumerate(layers) if any(p is param for p in layer.parameters())}
        )
        if any(s in sharded for s in held):
            return (
                f"stages {held} share a parameter (tied weights) and stage {sorted(set(held) & set(sharded))[0]} "
                "shards its state: a tied parameter's gradient is summed over every rank, whole, and a sharded "
                "stage holds only a shard of it. Put all the layers that share it in one stage that does not "
                "shard, or drop `shard`"
            )
    return None


def auto_chunks_refusal(logging: bool) -> str | None:
    """Why ``plan="auto"`` must not offer plans with several stages per rank group to this run, or ``None``."""
    if logging:
        return "recovery='log' replays a lost rank's stage from its log, which does not handle chunked plans yet"
    return None


def _gloo_on_cuda_refusal(backend: str, device_type: str, plan: Plan | str, world_size: int) -> str | None:
    """gloo reduces CUDA tensors (staging them through the host) but has no CUDA send or receive, which
    the messages between stages are: with gloo on GPUs only one-stage plans run."""
    if backend != "gloo" or device_type != "cuda":
        return None
    if isinstance(plan, Plan) and plan.num_stages > 1:
        given = f"a plan of {plan.num_stages} stages"
    elif not isinstance(plan, Plan) and world_size > 1:
        given = "plan='auto', which may choose several stages,"
    else:
        return None
    return (
        f"process_group_backend='gloo' on CUDA devices with {given} would send activations between stages, and "
        "gloo has no send or receive for CUDA tensors: use process_group_backend='nccl' (one GPU per rank), "
        f"or a one-stage plan (Plan.data_parallel(num_layers, {world_size})), which only all-reduces"
    )


def _encoder_decoder_refusal(module: Any, chain: Chain, plan: Plan | str, world_size: int) -> str | None:
    """Why an encoder-decoder model (Hugging Face's ``config.is_encoder_decoder``: T5, BART, ...) cannot be
    pipelined with ``plan``, or ``None`` (a one-stage plan runs: every rank holds every layer)."""
    if (plan.num_stages if isinstance(plan, Plan) else world_size) == 1:
        return None
    for name, sub in module.named_modules():
        inside = [path for path in chain.paths if not name or path == name or path.startswith(f"{name}.")]
        if inside and getattr(getattr(sub, "config", None), "is_encoder_decoder", False) is True:
            given = (
                "plan='auto', which may choose several stages," if isinstance(plan, str) else "a plan of several stages"
            )
            return (
                f"{type(sub).__name__} ({name or 'the module'}) is an encoder-decoder model, and {given} would pipeline "
                f"its layers {list(inside)}: its decoder's blocks take the encoder's output as a side input, which "
                "never crosses stages, so a stage holding decoder blocks would not have it. dapple does not pipeline "
                f"encoder-decoder models yet: give a one-stage plan (Plan.data_parallel({len(chain)}, {world_size})) "
                "or use strategy='ddp'"
            )
    return None


def _offload_trainer_refusal(trainer: Any) -> str | None:
    """Why an offloaded stage's gradients, which live on disk, cannot train under ``trainer``'s settings, or ``None``."""
    if trainer.accumulate_grad_batches != 1:
        return (
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} with an offloaded stage: its gradients "
            "live on disk and are not scaled per batch yet; use accumulate_grad_batches=1 or leave offload off"
        )
    if trainer.gradient_clip_val is not None:
        return (
            f"gradient_clip_val={trainer.gradient_clip_val} with an offloaded stage: clipping reads every gradient "
            "at once, and offload keeps them on disk; leave clipping off or offload off"
        )
    return None


def offload_refusal(trainer: Any, chain: Chain, device: Any) -> str | None:
    """Why no stage of this job could be offloaded (``plan="auto"`` then does not propose it), or ``None``."""
    if not chain.called_whole:
        return "the pipelined layers are a ModuleList or a chain of containers, and offload needs one nn.Sequential"
    if device.type != "cpu":
        return f"the device is {device}, and offload keeps layers on local disk with the CPU as the device"
    return _offload_trainer_refusal(trainer)
