"""The DAPPLE plan: which layers form each stage, how many devices each stage gets.

A plan is pure data. It knows nothing of process groups or devices, so the planner, the
search and the tests can build and compare plans freely. The runtime asks it only two
questions: which stage does a rank belong to, and which ranks hold a stage.

The stable, documented serialised form (what the search stores and the YAML files hold)::

    micro_batches: 4
    schedule: dapple          # or gpipe
    stages:
      - {layers: [0, 6], replicas: 2}     # layers 0..5 on ranks 0, 1
      - {layers: [6, 10], replicas: 1, recompute: true}   # layers 6..9 on rank 2

``layers`` is a half-open range ``[start, end)`` of indices into the module's
``nn.Sequential``. A stage may also name its ranks explicitly (``ranks: [0, 2]``), which is how
a placement other than "consecutive ranks" is written; by default stage ``s`` takes the next
``replicas`` ranks after stage ``s - 1``. ``recompute: true``, ``offload: 2`` (a window of 2 layers)
and ``shard: grads`` or ``full`` trade time for memory, each as its :class:`Stage` field says.

``chunks: 2`` (with ``layout: looped`` or ``v``) gives every rank group several stages: ``stages``
then lists ``groups x chunks`` stages in pipeline order, the stages of one group naming the same
replicas, and ``schedule`` is ``interleaved`` (looped) or ``zb-v`` / ``v-half`` (V); see
:meth:`Plan.group_of_stage` and :meth:`Plan.chunked`.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ALL_SCHEDULES",
    "CHUNKED_SCHEDULES",
    "LAYOUTS",
    "SCHEDULES",
    "SHARDING",
    "ZERO_BUBBLE",
    "Plan",
    "Stage",
    "layout_of",
    "number",
    "whole",
]

SCHEDULES = ("dapple", "gpipe")
"""The schedules the planner's cost model knows and the search tries."""
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zb-tail")
"""The zero-bubble schedules: backwards split into ``B`` and a deferred ``W`` (under ``zb-tail`` only
the last ones of each stage); the search tries them on request."""
ALL_SCHEDULES = (*SCHEDULES, *ZERO_BUBBLE)
"""The schedules a plan of one chunk per rank group may name: the runtime runs them all."""
LAYOUTS = {"looped": ("interleaved",), "v": ("zb-v", "v-half")}
"""How a chunked plan spreads its stages over the rank groups, and the schedules each layout runs:
``looped`` gives group ``g`` stages ``g, g + G, g + 2G, ...``; ``v`` gives it ``g`` and ``2G - 1 - g``."""
CHUNKED_SCHEDULES = tuple(name for names in LAYOUTS.values() for name in names)
"""The schedules of plans with several chunks (stages) per rank group."""


def layout_of(schedule: str) -> str:
    """The layout a chunked ``schedule`` runs (a key of :data:`LAYOUTS`)."""
    return next(layout for layout, names in LAYOUTS.items() if schedule in names)


def _group_of(stage: int, groups: int, layout: str) -> int:
    """The rank group of ``stage``: ``stage mod G`` looped; ``stage`` or ``2G - 1 - stage`` in the V layout."""
    return min(stage, 2 * groups - 1 - stage) if layout == "v" else stage % groups


SHARDING = ("grads", "full")
"""What a stage's replicas may split among themselves (``shard:``): ``"grads"``, the gradients and the
optimizer state (parameters gathered once per step and kept through it); ``"full"``, the parameters too
(gathered per layer for each forward and each backward, freed after)."""


def whole(value: Any, what: str, low: int | None = 1) -> int:
    """``value`` when it is an integer of at least ``low`` (any, for ``None``); else the error that
    names ``what``. bool is an int subclass, but ``replicas: true`` is a typo, not a count."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    if low is not None and value < low:
        raise ValueError(f"{what} must be >= {low}, got {value}")
    return value


def number(value: Any, what: str) -> float:
    """``value`` as a float when it is a finite number >= 0; else the error that names ``what``
    (``forward_s: true`` is a mistake, not 1 second)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous range of layers replicated on ``replicas`` devices."""

    start: int
    """First layer of the stage (index into the Sequential)."""
    end: int
    """One past the last layer of the stage."""
    replicas: int = 1
    """Number of devices that each hold a copy of the stage and split its micro-batches."""
    ranks: tuple[int, ...] | None = None
    """Explicit global ranks of the replicas, or ``None`` for consecutive ranks."""
    recompute: bool = False
    """Recompute the stage's activations in the backward rather than keep them: each layer runs
    under non-reentrant ``torch.utils.checkpoint``, so a micro-batch keeps only its layers' inputs
    until its backward, which runs the stage's forward again first."""
    offload: int | str | None = None
    """Keep the stage's parameters, gradients and optimizer state in files on local disk, with a
    working window of this many layers in memory that moves forward, then backward, through the
    stage per micro-batch; ``"auto"``: the smallest window whose transfers hide behind compute, from
    what the first training step measures (``None``: everything stays in memory)."""
    shard: str | None = None
    """What the stage's replicas split among themselves over their group: ``None`` (each holds everything),
    ``"grads"`` (gradients and optimizer state) or ``"full"`` (parameters too); see :data:`SHARDING`."""

    def __post_init__(self) -> None:
        whole(self.start, "stage start layer", low=None)
        self._check_shard()
        if not isinstance(self.recompute, bool):
            raise TypeError(f"stage `recompute` must be true or false, got {self.recompute!r}")
        if self.offload is not None and self.offload != "auto":
            if isinstance(self.offload, bool) or not isinstance(self.offload, int) or self.offload < 1:
                raise ValueError(
                    f"stage `offload` is the working window in layers, an integer >= 1 (e.g. offload: 2) or 'auto', "
                    f"got {self.offload!r}"
                )
            if self.recompute:
                raise ValueError(
                    f"stage [{self.start}, {self.end}) sets both recompute and offload; choose one of them"
                )
        whole(self.end, "stage end layer", low=None)
        whole(self.replicas, "stage replicas", low=None)
        if self.start < 0:
            raise ValueError(f"stage layers must start at 0 or later, got start={self.start}")
        if self.end <= self.start:
            raise ValueError(
                f"stage layer range [{self.start}, {self.end}) is empty; a stage needs at least one layer "
                "(write layers as [start, end) with end > start)"
            )
        if self.replicas < 1:
            raise ValueError(f"stage replicas must be >= 1, got {self.replicas}")
        if self.ranks is not None:
            ranks = tuple(whole(r, "stage rank", low=None) for r in self.ranks)
            object.__setattr__(self, "ranks", ranks)
            if len(ranks) != self.replicas:
                raise ValueError(
                    f"stage [{self.start}, {self.end}) lists {len(ranks)} ranks {list(ranks)} but has "
                    f"replicas={self.replicas}; give one rank per replica or drop `ranks`"
                )
            if len(set(ranks)) != len(ranks) or min(ranks) < 0:
                raise ValueError(f"stage ranks must be distinct non-negative integers, got {list(ranks)}")

    def _check_shard(self) -> None:
        if self.shard is None:
            return
        where = f"stage [{self.start}, {self.end})"
        if self.shard not in SHARDING:
            raise ValueError(f"{where}: `shard` must be one of {list(SHARDING)} or left out, got {self.shard!r}")
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 2:
            raise ValueError(
                f"{where} sets shard: {self.shard} on {self.replicas!r} replica(s): one replica has no one to split its "
                "state with; give the stage 2 or more replicas or drop `shard`"
            )
        if self.recompute or self.offload is not None:
            lever = "recompute" if self.recompute else "offload"
            raise ValueError(f"{where} sets both shard and {lever}; choose one of them")

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": [self.start, self.end], "replicas": self.replicas}
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
        if self.recompute:
            out["recompute"] = True
        if self.offload is not None:
            out["offload"] = self.offload
        if self.shard is not None:
            out["shard"] = self.shard
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Stage:
        if isinstance(data, Stage):
            return data
        if not isinstance(data, Mapping):
            raise TypeError(
                f"a stage must be a mapping like {{layers: [0, 4], replicas: 1}}, got {type(data).__name__}"
            )
        unknown = set(data) - {"layers", "replicas", "ranks", "recompute", "offload", "shard"}
        if unknown:
            raise ValueError(
                f"unknown stage keys {sorted(map(str, unknown))}; allowed: layers, replicas, ranks, recompute, offload, "
                "shard"
            )
        if "layers" not in data:
            raise ValueError("a stage needs `layers: [start, end)`, e.g. {layers: [0, 4], replicas: 1}")
        layers = data["layers"]
        if isinstance(layers, str | bytes) or not isinstance(layers, Sequence) or len(layers) != 2:
            raise ValueError(f"stage `layers` must be a pair [start, end), got {layers!r}")
        ranks = data.get("ranks")
        if ranks is not None and (isinstance(ranks, str | bytes) or not isinstance(ranks, Sequence)):
            raise TypeError(f"stage `ranks` must be a list of integers, got {ranks!r}")
        return cls(
            start=layers[0],
            end=layers[1],
            replicas=data.get("replicas", 1),
            ranks=None if ranks is None else tuple(ranks),
            recompute=data.get("recompute", False),
            offload=data.get("offload"),
            shard=data.get("shard"),
        )


@dataclass(frozen=True)
class Plan:
    """A DAPPLE plan: stages of layers, per-stage replication, micro-batch count, schedule.

    Stages cover the layers ``[0, num_layers)`` in order without gaps or overlaps. The plan
    runs on exactly ``world_size == sum(stage.replicas)`` ranks.
    """

    stages: tuple[Stage, ...]
    """The stages, in pipeline order."""
    micro_batches: int = 1
    """Micro-batches per global batch (``M``); each optimizer step consumes one global batch."""
    schedule: str = "dapple"
    """``"dapple"`` (early backward, 1F1B) or ``"gpipe"`` (all forwards, then all backwards)."""
    chunks: int = 1
    """Stages per rank group (virtual stages): ``stages`` then lists ``G x chunks`` stages in
    pipeline order, and ``layout`` says which group holds which (see :meth:`group_of_stage`)."""
    layout: str = "looped"
    """``"looped"`` (group ``g`` holds stages ``g, g + G, ...``, for ``interleaved``) or ``"v"``
    (group ``g`` holds ``g`` and ``2G - 1 - g``, for ``zb-v`` and ``v-half``)."""
    _rank_to_stage: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stages = self.stages
        if isinstance(stages, Mapping | str | bytes) or not isinstance(stages, Sequence):
            raise TypeError(f"plan stages must be a list of stages, got {type(stages).__name__}")
        stages = tuple(Stage.from_dict(s) for s in stages)
        object.__setattr__(self, "stages", stages)
        if not stages:
            raise ValueError("a plan needs at least one stage")
        whole(self.micro_batches, "micro_batches")
        if self.schedule not in (*ALL_SCHEDULES, *CHUNKED_SCHEDULES):
            raise ValueError(
                f"unknown schedule {self.schedule!r}; choose one of {list(ALL_SCHEDULES)}, or with chunks "
                f"{list(CHUNKED_SCHEDULES)}"
            )
        self._check_chunks(stages)
        if self.schedule in ZERO_BUBBLE and any(s.recompute for s in stages):
            # Its B and W each back-propagate through the stage's checkpoints, and each runs them again.
            raise ValueError(
                "a stage with recompute: true runs its forward twice more per micro-batch under schedule "
                f"{self.schedule!r} (its input and weight backwards each recompute); use schedule 'dapple' "
                "with recomputation"
            )
        if self.schedule in ZERO_BUBBLE and any(s.offload is not None for s in stages):
            # Its W adds the weights' gradients outside the window that B moved.
            raise ValueError(
                f"a stage with offload moves its window with each backward, and schedule {self.schedule!r} computes "
                "the weights' gradients later, apart from it; use schedule 'dapple' or 'gpipe' with offload"
            )
        if self.schedule in ZERO_BUBBLE and any(s.shard is not None for s in stages):
            # A sharded layer reduce-scatters its gradient when its backward ends; W computes it later.
            raise ValueError(
                f"a stage with shard sums its weights' gradients as each layer's backward ends, and schedule "
                f"{self.schedule!r} computes them later, apart from it; use schedule 'dapple' or 'gpipe' with shard"
            )
        if stages[0].start != 0:
            raise ValueError(f"the first stage must start at layer 0, got [{stages[0].start}, {stages[0].end})")
        for prev, nxt in itertools.pairwise(stages):
            if nxt.start > prev.end:
                raise ValueError(
                    f"layers [{prev.end}, {nxt.start}) belong to no stage: stage [{prev.start}, {prev.end}) "
                    f"is followed by [{nxt.start}, {nxt.end}); make each stage start where the last ended"
                )
            if nxt.start < prev.end:
                raise ValueError(
                    f"stages [{prev.start}, {prev.end}) and [{nxt.start}, {nxt.end}) overlap; "
                    "make each stage start where the last ended"
                )
        explicit = [s.ranks is not None for s in stages]
        if any(explicit) and not all(explicit):
            raise ValueError("either every stage lists its `ranks` or none does")
        owner: list[int] = [-1] * self.world_size
        next_rank = 0
        for index, stage in enumerate(stages[: self.num_groups]):  # a group's first stage gives its ranks
            ranks = stage.ranks or tuple(range(next_rank, next_rank + stage.replicas))
            next_rank += stage.replicas
            for rank in ranks:
                if rank >= self.world_size:
                    raise ValueError(
                        f"stage {index} lists rank {rank}, but the plan has only {self.world_size} ranks "
                        f"(sum of replicas); ranks must be 0..{self.world_size - 1}"
                    )
                if owner[rank] != -1:
                    raise ValueError(f"rank {rank} is given to both stage {owner[rank]} and stage {index}")
                owner[rank] = index
        object.__setattr__(self, "_rank_to_stage", tuple(owner))

    # ----------------------------------------------------------------------------- queries

    @property
    def num_stages(self) -> int:
        """Stages in the pipeline; with chunks, ``num_groups x chunks`` (virtual stages)."""
        return len(self.stages)

    @property
    def num_groups(self) -> int:
        """Rank groups (``G``): the stages' count without chunks, ``num_stages / chunks`` with them."""
        return len(self.stages) // self.chunks

    def group_of_stage(self, stage: int) -> int:
        """The rank group that holds ``stage``: itself without chunks; ``stage mod G`` looped;
        ``stage`` or ``2G - 1 - stage`` in the V layout."""
        groups = self.num_groups
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside the plan's {self.num_stages} stages")
        return _group_of(stage, groups, self.layout)

    def group_of(self, rank: int) -> int:
        """The rank group of ``rank`` (its stage's index without chunks)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the plan's {self.world_size} ranks")
        return self._rank_to_stage[rank]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in pipeline order (one without chunks)."""
        group = self.group_of(rank)
        return tuple(s for s in range(self.num_stages) if self.group_of_stage(s) == group)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].end

    @property
    def world_size(self) -> int:
        return sum(s.replicas for s in self.stages[: self.num_groups])

    @property
    def notation(self) -> str:
        """The paper's notation for the replication, e.g. ``"15:1"`` (per rank group with chunks)."""
        return ":".join(str(s.replicas) for s in self.stages[: self.num_groups])

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Global ranks that hold ``stage``, in replica order."""
        group = self.group_of_stage(stage)
        return tuple(r for r, g in enumerate(self._rank_to_stage) if g == group)

    def stage_of(self, rank: int) -> int:
        """The one stage ``rank`` holds; a chunked plan gives it several (see :meth:`stages_of`)."""
        if self.chunks > 1:
            raise ValueError(
                f"rank {rank} holds {self.chunks} stages {list(self.stages_of(rank))} of a chunked plan; "
                "ask plan.stages_of(rank) (or plan.group_of(rank) for its rank group)"
            )
        return self.group_of(rank)

    def replica_of(self, rank: int) -> int:
        return self.stage_ranks(self.stages_of(rank)[0]).index(rank)

    def _check_chunks(self, stages: tuple[Stage, ...]) -> None:
        """Refuse a chunk count, layout or schedule that do not fit together, naming the fix."""
        chunks, layout, name = self.chunks, self.layout, self.schedule
        whole(chunks, "chunks", low=None)
        if chunks < 1:
            raise ValueError(f"chunks is the number of stages per rank group, >= 1; got {chunks}")
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; choose 'looped' (interleaved) or 'v' (zb-v, v-half)")
        if chunks == 1:
            if name in CHUNKED_SCHEDULES:
                raise ValueError(
                    f"schedule {name!r} runs several stages per rank group; set chunks: 2 (and layout: "
                    f"{layout_of(name)}) or choose one of {list(ALL_SCHEDULES)}"
                )
            return
        if name not in LAYOUTS[layout]:
            raise ValueError(
                f"a plan with chunks: {chunks} and layout: {layout} runs schedule {' or '.join(LAYOUTS[layout])}, "
                f"not {name!r}; set schedule accordingly (or layout: "
                f"{'v' if layout == 'looped' else 'looped'} for the other family)"
            )
        if layout == "v" and chunks != 2:
            raise ValueError(
                f"the V layout gives each rank group 2 stages (g and 2G - 1 - g); set chunks: 2, not {chunks}"
            )
        if len(stages) % chunks:
            raise ValueError(
                f"a plan with chunks: {chunks} lists chunks x (rank groups) stages in pipeline order; got "
                f"{len(stages)} stages, which {chunks} does not divide: add or merge stages"
            )
        if any(s.recompute or s.offload is not None or s.shard is not None for s in stages):
            raise ValueError(
                "recompute, offload and shard are not supported with chunks yet; remove them from the stages or set "
                "chunks: 1"
            )
        groups = len(stages) // chunks
        if name == "interleaved" and self.micro_batches % groups:
            raise ValueError(
                f"schedule 'interleaved' runs micro-batches in rounds of one per rank group: micro_batches must be a "
                f"multiple of the {groups} rank groups, got {self.micro_batches}"
            )
        if layout == "v" and self.micro_batches < 2 * groups:
            raise ValueError(
                f"schedule {name!r} needs at least 2 x (rank groups) = {2 * groups} micro-batches to fill its V, "
                f"got micro_batches={self.micro_batches}"
            )
        for index, stage in enumerate(stages):
            first = stages[self.group_of_stage(index)]  # the group's first stage
            if (stage.replicas, stage.ranks) != (first.replicas, first.ranks):
                raise ValueError(
                    f"stages {self.group_of_stage(index)} and {index} share rank group {self.group_of_stage(index)} "
                    f"(layout {layout}) but give it replicas {first.replicas} and {stage.replicas}"
                    f"{'' if stage.ranks == first.ranks else ' or different ranks'}: give every stage of a group the "
                    "same replicas and ranks"
                )

    def check(self, *, num_layers: int | None = None, world_size: int | None = None) -> None:
        """Raise ``ValueError`` unless the plan fits a model of ``num_layers`` and ``world_size`` ranks."""
        if num_layers is not None and self.num_layers != num_layers:
            raise ValueError(
                f"the plan covers layers [0, {self.num_layers}) but the model's Sequential has {num_layers} "
                f"layers; make the last stage end at {num_layers}"
            )
        if world_size is not None and self.world_size != world_size:
            raise ValueError(
                f"the plan needs {self.world_size} ranks (replicas {self.notation}) but the Trainer runs "
                f"{world_size}; set devices x num_nodes to {self.world_size} or change the replicas"
            )

    # ------------------------------------------------------------------------ conversions

    def to_dict(self) -> dict[str, Any]:
        chunked = {"chunks": self.chunks, "layout": self.layout} if self.chunks > 1 else {}
        return {
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            **chunked,
            "stages": [s.to_dict() for s in self.stages],
        }

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        if not isinstance(data, Mapping):
            raise TypeError(f"a plan must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {"stages", "micro_batches", "schedule", "chunks", "layout"}
        if unknown:
            raise ValueError(
                f"unknown plan keys {sorted(map(str, unknown))}; allowed: stages, micro_batches, schedule, chunks, layout"
            )
        if "stages" not in data:
            raise ValueError("a plan needs `stages`, e.g. stages: [{layers: [0, 4], replicas: 2}]")
        schedule = data.get("schedule", "dapple")
        if not isinstance(schedule, str):
            raise TypeError(f"schedule must be a string, got {schedule!r}")
        layout = data.get("layout", "looped")
        if not isinstance(layout, str):
            raise TypeError(f"layout must be a string ('looped' or 'v'), got {layout!r}")
        return cls(
            stages=data["stages"],
            micro_batches=data.get("micro_batches", 1),
            schedule=schedule.lower(),
            chunks=data.get("chunks", 1),
            layout=layout.lower(),
        )

    @classmethod
    def from_yaml(cls, text: str) -> Plan:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"the plan is not valid YAML: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def coerce(cls, plan: Any) -> Plan:
        """Build a plan from a ``Plan``, a mapping, an OmegaConf node, YAML text or a YAML file path."""
        if isinstance(plan, Plan):
            return plan
        if _is_omegaconf(plan):
            from omegaconf import OmegaConf

            plan = OmegaConf.to_container(plan, resolve=True)
        if isinstance(plan, os.PathLike) or (isinstance(plan, str) and _looks_like_path(plan)):
            path = Path(plan)
            if not path.is_file():
                raise ValueError(f"plan file {str(path)!r} does not exist")
            return cls.from_yaml(path.read_text())
        if isinstance(plan, str):
            return cls.from_yaml(plan)
        return cls.from_dict(plan)

    def __str__(self) -> str:
        return self.table()

    def describe(self) -> str:
        """One short line: replicas, cut points, micro-batches, schedule (``"2:2 cuts=5 M=4 dapple"``)."""
        cuts = ",".join(str(s.start) for s in self.stages[1:]) or "-"
        recompute = ",".join(str(k) for k, s in enumerate(self.stages) if s.recompute)
        tail = f" recompute={recompute}" if recompute else ""
        offload = ",".join(f"{k}:{s.offload}" for k, s in enumerate(self.stages) if s.offload is not None)
        tail += f" offload={offload}" if offload else ""
        tail += f" chunks={self.chunks} {self.layout}" if self.chunks > 1 else ""
        shard = ",".join(f"{k}:{s.shard}" for k, s in enumerate(self.stages) if s.shard is not None)
        tail += f" shard={shard}" if shard else ""
        return f"{self.notation} cuts={cuts} M={self.micro_batches} {self.schedule}{tail}"

    def table(self) -> str:
        """The plan as an aligned text table (``recompute``, ``offload`` and ``shard`` columns when a stage uses them)."""
        extra = [name for name in ("recompute", "offload", "shard") if any(getattr(s, name) for s in self.stages)]
        extra = (["group", "chunk"] if self.chunks > 1 else []) + extra
        rows = [("stage", "layers", "replicas", "ranks", *extra)]
        for index, stage in enumerate(self.stages):
            ranks = ",".join(map(str, self.stage_ranks(index)))
            group = self.group_of_stage(index)
            chunk = [s for s in range(self.num_stages) if self.group_of_stage(s) == group].index(index)
            cells = {
                "recompute": "yes" if stage.recompute else "",
                "offload": "" if stage.offload is None else f"window {stage.offload}",
                "shard": stage.shard or "",
                "group": str(group),
                "chunk": str(chunk),
            }
            rows.append(
                (str(index), f"[{stage.start}, {stage.end})", str(stage.replicas), ranks, *map(cells.get, extra))
            )
        columns = len(rows[0])
        widths = [max(len(r[c]) for r in rows) for c in range(columns)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        per_group = (
            f" in {self.num_groups} rank group(s) x {self.chunks} chunks ({self.layout})" if self.chunks > 1 else ""
        )
        lines.append(
            f"{self.num_stages} stage(s){per_group} [{self.notation}] on {self.world_size} rank(s), "
            f"micro_batches={self.micro_batches}, schedule={self.schedule}"
        )
        return "\n".join(lines)

    # ------------------------------------------------------------------------ factories

    @classmethod
    def data_parallel(cls, num_layers: int, world_size: int, micro_batches: int = 1) -> Plan:
        """One stage holding every layer, replicated on every rank."""
        return cls(stages=(Stage(0, num_layers, world_size),), micro_batches=micro_batches)

    @classmethod
    def straight(
        cls,
        num_layers: int,
        num_stages: int,
        micro_batches: int | None = None,
        *,
        schedule: str = "dapple",
    ) -> Plan:
        """A straight pipeline (one device per stage), cut into stages of as equal layer counts as can be.

        ``micro_batches`` defaults to ``2 * num_stages``.
        """
        if num_stages > num_layers:
            raise ValueError(f"cannot cut {num_layers} layers into {num_stages} stages (fewer layers than stages)")
        bounds = balanced_cuts([1.0] * num_layers, num_stages)
        stages = tuple(Stage(a, b, 1) for a, b in itertools.pairwise(bounds))
        return cls(stages=stages, micro_batches=micro_batches or 2 * num_stages, schedule=schedule)

    @classmethod
    def chunked(
        cls,
        num_layers: int,
        replicas: str | Sequence[int],
        *,
        chunks: int = 2,
        layout: str = "looped",
        micro_batches: int | None = None,
        schedule: str | None = None,
    ) -> Plan:
        """A plan of ``chunks`` stages per rank group, replicated as ``replicas`` (``"2:1"`` or
        ``[2, 1]``, one count per group), cut into stages of as equal layer counts as can be.

        ``Plan.chunked(8, "2:1", layout="v")`` cuts 8 layers into 4 stages, gives stages 0 and 3 to
        ranks 0 and 1 and stages 1 and 2 to rank 2, and runs ``zb-v``. The schedule defaults to the
        layout's first (``interleaved`` looped, ``zb-v`` V); ``micro_batches`` to ``2 x groups``.
        """
        counts = [int(r) for r in replicas.split(":")] if isinstance(replicas, str) else list(replicas)
        groups = len(counts)
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; choose 'looped' (interleaved) or 'v' (zb-v, v-half)")
        if groups * chunks > num_layers:
            raise ValueError(f"cannot cut {num_layers} layers into {groups} groups x {chunks} chunks (fewer layers)")
        bounds = balanced_cuts([1.0] * num_layers, groups * chunks)
        return cls.from_cuts(
            bounds, counts, micro_batches or 2 * groups, schedule or LAYOUTS[layout][0], chunks=chunks, layout=layout
        )

    @classmethod
    def from_cuts(
        cls,
        cuts: Sequence[int],
        replicas: Sequence[int],
        micro_batches: int,
        schedule: str,
        *,
        chunks: int = 1,
        layout: str | None = None,
        ranks: Sequence[tuple[int, ...] | None] | None = None,
    ) -> Plan:
        """The plan whose stages hold layers ``[cuts[s], cuts[s + 1])``, ``chunks`` stages per rank group
        ``g`` placed by ``layout`` (by default the schedule's, :func:`layout_of`), each on ``replicas[g]``
        devices (at ``ranks[g]`` when given)."""
        groups = len(replicas)
        if layout is None:
            layout = layout_of(schedule) if schedule in CHUNKED_SCHEDULES else "looped"
        owner = (_group_of(s, groups, layout) for s in range(groups * chunks))
        stages = tuple(
            Stage(a, b, replicas[g], None if ranks is None else ranks[g])
            for g, (a, b) in zip(owner, itertools.pairwise(cuts), strict=True)
        )
        return cls(stages, micro_batches, schedule, chunks, layout)


def balanced_cuts(weights: Sequence[float], parts: int) -> list[int]:
    """Cut points ``[0, c_1, ..., len(weights)]`` minimising the heaviest part (contiguous parts).

    Exact: binary search over the bottleneck value with a greedy feasibility test is not exact
    for floats, so this is the O(parts * n^2) dynamic program; n is a layer count, small.
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty parts")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[k][i]: smallest bottleneck cutting the first i layers into k parts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _is_omegaconf(obj: Any) -> bool:
    from omegaconf import DictConfig

    return isinstance(obj, DictConfig)


def _looks_like_path(text: str) -> bool:
    return "\n" not in text and text.strip().endswith((".yaml", ".yml"))
