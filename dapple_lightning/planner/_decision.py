"""What ``plan="auto"`` decided and why: the decision and its report (pure; the measuring is
``dapple_lightning.autoplan``'s)."""

from __future__ import annotations

from dataclasses import dataclass

from dapple_lightning.plan import Plan
from dapple_lightning.planner._budget import format_bytes, stage_memory_lines
from dapple_lightning.planner._cluster import GB, Cluster
from dapple_lightning.planner._profile import ModelProfile
from dapple_lightning.planner._select import TRIAL_MARGIN, Trial

__all__ = ["AutoPlan"]


@dataclass(frozen=True)
class AutoPlan:
    """What ``plan="auto"`` decided and why."""

    plan: Plan
    predicted_step_s: float
    data_parallel_step_s: float | None
    profile: ModelProfile
    """The layers' measured costs, refined by the trials when there were any (see ``planner.refine``)."""
    cluster: Cluster
    profiling_s: float
    """Seconds spent profiling, measuring the process group, planning and on trials."""
    trials: tuple[Trial, ...] = ()
    """The close candidates measured, in the order predicted; ``plan`` is the one the choice rule
    (``planner.choose_measured``) took from them."""
    stage_memory_bytes: tuple[float, ...] = ()
    """The chosen plan's predicted peak per rank of each stage (the budget is ``cluster.memory_bytes``)."""
    one_f_one_b_step_s: float | None = None
    """For a zero-bubble plan: the same stages' predicted step under DAPPLE's 1F1B schedule."""
    lever: str | None = None
    """When no plan fitted the budget as it was: which stages recompute or are offloaded, and why."""
    reason: str | None = None
    """Why the choice rule took ``plan`` from the trials (``PlanChoice.reason``); ``None`` without trials."""
    offers: tuple[tuple[Plan, str], ...] = ()
    """The plans with several stages per rank group that were shortlisted, each with why (``planner.shortlist``)."""
    chunks_refused: str | None = None
    """Why no plan with several stages per rank group was offered for this run, when none could be."""

    def report(self) -> str:
        lines = [
            f"dapple plan='auto': profiled {self.profile.num_layers} layers and the process group"
            + (f", measured {len(self.trials)} close plans," if self.trials else "")
            + f" in {self.profiling_s:.1f} s",
            f"cluster: {self.cluster.nodes} node(s) x {self.cluster.devices_per_node} device(s); point-to-point "
            f"{self.cluster.intra_p2p_bw / GB:.2f} GB/s within a node, {self.cluster.inter_p2p_bw / GB:.2f} across; "
            f"all-reduce {self.cluster.intra_allreduce_bw / GB:.2f} / {self.cluster.inter_allreduce_bw / GB:.2f} GB/s "
            "per link",
            self.plan.table(),
        ]
        if self.trials:
            lines.append(f"predicted within {TRIAL_MARGIN:.0%} of each other, so measured in turns (ms/step):")
            width = max(len(t.plan.describe()) for t in self.trials)
            for t in self.trials:
                mark = "  <- chosen" if t.plan == self.plan else ""
                spread = "" if t.spread is None else f" ± {t.spread:.0%}"
                lines.append(
                    f"  {t.plan.describe():{width}}  predicted {t.predicted_step_s * 1e3:7.1f}  "
                    f"measured {t.measured_step_s * 1e3:7.1f}{spread} ({t.turns} turn{'s' if t.turns > 1 else ''}){mark}"
                )
            if self.reason is not None:
                lines.append(f"chosen: {self.reason} (the fastest median unless a simpler plan is within the spreads)")
        if self.data_parallel_step_s is None:
            lines.append(f"predicted {self.predicted_step_s * 1e3:.1f} ms/step; pure data parallelism does not fit")
        elif self.plan.num_stages == 1:
            lines.append(
                f"predicted {self.predicted_step_s * 1e3:.1f} ms/step: no pipeline beats pure data parallelism here"
            )
        else:
            lines.append(
                f"predicted {self.predicted_step_s * 1e3:.1f} ms/step vs {self.data_parallel_step_s * 1e3:.1f} ms for "
                f"pure data parallelism ({self.data_parallel_step_s / self.predicted_step_s:.2f}x)"
            )
        if self.one_f_one_b_step_s is not None:
            held = (
                f"; each stage holds up to {min(2 * self.plan.num_stages - 1, self.plan.micro_batches)} micro-batches "
                f"(zb-h1 and 1F1B's first stage: {min(self.plan.num_stages, self.plan.micro_batches)}) to run "
                "further ahead"
                if self.plan.schedule in ("zb-h2", "zb-tail")
                else ""
            )
            fill = (
                "the weight-gradient halves (W) of each stage's last backwards fill the drain bubble, the other "
                "backwards run whole"
                if self.plan.schedule == "zb-tail"
                else "the weight-gradient halves of the backwards (W) fill the warm-up and drain bubbles"
            )
            lines.append(
                f"schedule {self.plan.schedule}: {fill}{held}; predicted {self.predicted_step_s * 1e3:.1f} ms/step against "
                f"{self.one_f_one_b_step_s * 1e3:.1f} ms under DAPPLE's 1F1B on the same stages"
                + (" (both measured above)" if any(t.plan.schedule == "dapple" for t in self.trials) else "")
            )
        for plan, why in self.offers:
            state = "chosen" if plan == self.plan else "offered"
            lines.append(f"{state} {plan.describe()}: {why}")
        if self.chunks_refused is not None:
            lines.append(f"plans with several stages per rank group were not offered: {self.chunks_refused}")
        if self.lever is not None:
            lines.append(self.lever)
        if self.stage_memory_bytes:
            lines.append(f"predicted peak memory per rank (budget {format_bytes(self.cluster.memory_bytes)}):")
            lines += stage_memory_lines(self.plan, self.stage_memory_bytes, self.cluster.memory_bytes)
        return "\n".join(lines)
