"""The planner's dynamic program: a branch and bound over plans, exact for the analytic cost model.

**Why a dynamic program is exact here.** The cost model's latency is ``Z_0`` of the recurrence
in ``_recurrence``, computed from the last stage backwards. Building the pipeline from its last
stage forwards, a partial pipeline (a suffix) enters the rest of the computation only through
five numbers of its first stage (its :data:`~dapple_lightning.planner._recurrence.Tail`:
``D, Z, RT, X`` and its ``F + B``), that stage's devices per server (for the transfer to the
stage before it), the free devices per server (for placement) and its number of stages up to
``M`` (the warm-up depth ``K_s = min(S - s, M)`` of the stages before it changes both their
memory and their chains). Latency only grows with the five numbers, so for each state (layer,
free devices, first stage's devices, stage count) the search keeps the partial pipelines that
fewer than ``top`` others beat in all five. Nothing else is pruned except with bounds that are
provably below the final latency (branch and bound against the ``top``-th best plan found so
far). Tests compare it with enumerating every plan. With a ``beam``, each state keeps only its
partial plans of lowest ``Z``: fast, not guaranteed optimal.

A search runs per (micro-batch count, placement policy); ``_dp.plan_dapple`` decides which, in
what order, and with which cut points.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dapple_lightning.planner._cost import CostModel, Placement
from dapple_lightning.planner._placement import allocate, place
from dapple_lightning.planner._recurrence import Link, Terms, attach, stage_terms, through_link
from dapple_lightning.planner._stage_memory import MemoryParts, peak_bytes

__all__: list[str] = []


@dataclass(slots=True, eq=False)
class _Suffix:
    """A partial pipeline: its first stage, layers ``[start, end)`` on ``replicas`` devices, then
    ``rest``; with its stage count (up to ``M``) and the recurrence's five numbers of it."""

    stages: int
    d: float
    z: float
    round_trip: float
    x: float
    passes: float
    start: int
    end: int
    replicas: int
    recompute: bool
    rest: _Suffix | None
    beaten: int = 0
    """How many suffixes kept in its front beat it in all numbers when they came (it leaves at ``top``)."""


_Candidate = tuple[int, int, bool, Link | None, _Suffix | None]
"""A suffix ready to get a stage in front of it: the new stage's warm-up depth ``K``, the stage
count the longer suffix is kept under, whether the suffix's first stage warms up one
micro-batch less (``K - 1``: the two ping-pong), the suffix seen through the link to the new
stage (``None`` when the new stage is the last), and the suffix itself."""

_Cost = tuple[float, float, float, MemoryParts, MemoryParts | None, dict[int, tuple[float, Terms, bool] | None]]
"""A stage ``[i, j)`` priced: its forward and backward of one micro-batch, its all-reduce and
optimizer step, its memory parts, those when it recomputes (``None``: it may not), and its
:func:`_depth_terms` by warm-up depth as the search asks for them (the stage goes in front of
suffixes in many states; its numbers at a depth are the same in each)."""

_Placed = tuple[tuple[int, ...], Placement, float]
"""Where a new stage goes: the free devices per server after it, its devices (per server in the
new state's server order), and the seconds per byte of its transfer to the stage after it."""


class _Top:
    """The ``k`` best distinct plans found so far; the ``k``-th latency bounds the search."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.bound = math.inf
        self.cap = math.inf
        """A bound from ``k`` plans found elsewhere (see :meth:`limit`)."""
        self.items: list[tuple[float, tuple[Any, ...], Any]] = []
        self.seen: dict[tuple[Any, ...], tuple[float, Any]] = {}
        """Every plan offered, kept or not (valid plans, so bounds for a later search)."""

    def offer(self, z: float, key: tuple[Any, ...], payload: Any) -> None:
        self.seen.setdefault(key, (z, payload))
        if z > self.bound or any(key == k for _, k, _ in self.items):
            return
        self.items.append((z, key, payload))
        self.items.sort(key=lambda item: item[0])
        del self.items[self.k :]
        if len(self.items) >= self.k:
            # A hair above the k-th latency: bounds summed in another order of float
            # operations must not cut a plan that ties with it.
            self.bound = min(self.cap, self.items[-1][0] * (1 + 1e-12))

    def limit(self, bound: float) -> None:
        """Bound the search by ``bound`` from now on: the ``k``-th latency (a hair above) of
        ``k`` distinct plans of the space that are not offered here."""
        self.cap = min(self.cap, bound)
        self.bound = min(self.bound, self.cap)


_z = operator.attrgetter("z")


def _insert(front: list[_Suffix], new: _Suffix, k: int, beam: int | None) -> bool:
    """Add ``new`` to ``front`` (sorted by Z) unless ``k`` kept suffixes beat it in all numbers.

    The suffixes ``new`` beats count it; one that ``k`` suffixes have beaten leaves: each of
    them, with any stages in front, makes a distinct plan at least as fast, so it cannot be
    among the ``k`` best. (A counted suffix that left later was beaten by ``k`` others that beat
    these too.) With a ``beam``, only that many suffixes of lowest Z stay: a heuristic, for
    large searches.
    """
    z, d, x, round_trip, passes, stages = new.z, new.d, new.x, new.round_trip, new.passes, new.stages
    stop = bisect.bisect_right(front, z, key=_z)
    beaten = 0
    # Each test alone decides, so their order is only speed: the ones that fail most often first.
    for old in front[:stop]:
        if old.passes <= passes and old.x <= x and old.round_trip <= round_trip and old.d <= d and old.stages == stages:
            beaten += 1
            if beaten >= k:
                return False
    new.beaten = beaten
    start = bisect.bisect_left(front, z, 0, stop, key=_z)
    # The search calls this for every partial plan it keeps: the front is rebuilt only when one leaves.
    kept: list[_Suffix] | None = None
    for at, old in enumerate(front[start:], start):
        if passes <= old.passes and x <= old.x and round_trip <= old.round_trip and d <= old.d and stages == old.stages:
            old.beaten += 1
            if old.beaten >= k:
                if kept is None:
                    kept = front[start:at]
                continue
        if kept is not None:
            kept.append(old)
    if kept is not None:
        front[start:] = kept
        stop = bisect.bisect_right(front, z, key=_z)
    front.insert(stop, new)
    if beam is not None and len(front) > beam:
        del front[beam:]
        return stop < beam
    return True


def _depth_terms(
    forward: float, backward: float, memory: MemoryParts, lean: MemoryParts | None, depth: int, m: int, cap: float
) -> tuple[float, Terms, bool] | None:
    """A stage keeping ``depth`` micro-batches: its backward, its :func:`stage_terms` and whether
    it recomputes (only when it must: recomputing only makes the backward longer); ``None``
    when it does not fit under ``cap`` either way."""
    recompute = peak_bytes(memory, depth, m) > cap
    if recompute and (lean is None or peak_bytes(lean, depth, m) > cap):
        return None
    b = backward + forward if recompute else backward
    return b, stage_terms(forward, b, m, depth), recompute


class _Pass:
    """What one pass of the search (a micro-batch count, a placement policy, the cut points)
    computes once: the stage counts it may use, where stages may begin, and lower bounds.

    Lower bounds on the latency of any plan that puts layers ``[0, i)`` on ``left`` devices in
    front of a suffix whose Z is ``z``:

    - ``z + forward_per_sample[i] * samples[left] + forward_fixed[i]``: the prefix's forwards
      of micro-batch 0 precede every chain of the suffix (``Z_0 >= sum F + Z``), and no prefix
      stage has more than ``left`` replicas;
    - ``prefix_work[i] / left``: some prefix stage does at least its share of the prefix's work;
    - ``d + passes_per_sample[i] * samples[left] + passes_fixed[i]`` for a suffix whose ``D`` is
      ``d``: micro-batch 0's forward and backward through every prefix stage chain with the
      suffix's ``D`` (``D_t >= F_t + B_t + D_{t+1}``, and ``Z_0 >= D_0``).

    Stage costs are priced once (:meth:`stage_cost`), by the stage's layers, replicas and
    servers, whichever state asks; every pass of the search at the same micro-batch count
    (other placement policies, the coarse and the full cut points) shares them.
    """

    def __init__(
        self, model: CostModel, policy: str, micro_batches: int, cuts: Sequence[int] | None, replicas: Sequence[int]
    ) -> None:
        m = micro_batches
        layers = model.num_layers
        batch = model.profile.profile_batch_size
        forward_fixed, backward_fixed, forward_var, backward_var, _ = model.affine_prefix_sums()
        self.model = model
        self.cluster = model.cluster
        self.policy = policy
        self.micro_batches = m
        self.most = model.max_replicas(m)
        self.counts = [r for r in replicas if r <= self.most]
        self.samples = [0] + [model.samples(m, r) for r in range(1, model.cluster.world_size + 1)]
        self.allowed = sorted(set(range(1, layers)) if cuts is None else {c for c in cuts if 0 < c < layers})
        self.forward_fixed = forward_fixed
        self.forward_per_sample = [x / batch for x in forward_var]
        self.passes_fixed = [f + b for f, b in zip(forward_fixed, backward_fixed)]
        self.passes_per_sample = [(f + b) / batch for f, b in zip(forward_var, backward_var)]
        self.prefix_work = [
            model.global_batch * (forward_var[i] + backward_var[i]) / batch + m * (forward_fixed[i] + backward_fixed[i])
            for i in range(layers + 1)
        ]
        # Under "fresh" and "scatter", servers with equal (free devices, devices of the first
        # stage) are interchangeable (see _placement), so a state lists its servers sorted by
        # that pair, and placements equal up to renaming servers become one state. "append"
        # follows server numbers and keeps them.
        self._canonical = policy != "append"
        self.placed: dict[tuple[tuple[int, ...], tuple[int, ...] | None, int], _Placed] = {}
        """What :meth:`place` found, by its arguments: the search asks the same again and again
        (the search hands the same table to its passes under the same placement policy)."""
        self.costs: dict[tuple[int, int, int, int], _Cost | None] = {}
        """What :meth:`stage_cost` found, by its arguments (the search hands the same table to
        its passes over other placement policies)."""
        self.priced = 0
        """Stages ``[i, j)`` on a placement priced (forward, backward, closing, memory): each once."""

    def stage_cost(self, start: int, end: int, stage: Placement, cap: float, recompute: bool) -> _Cost | None:
        """Stage ``[start, end)`` on ``stage`` priced, or ``None`` when it does not fit under ``cap``
        (even recomputing, where ``recompute`` allows). Its price depends only on its layers,
        replicas and servers, not on the state that asks: each is computed once per pass."""
        key = (start, end, stage.replicas, stage.servers)
        if key in self.costs:
            return self.costs[key]
        model = self.model
        m = self.micro_batches
        samples = self.samples[stage.replicas]
        forward, backward = model.passes(start, end, m, samples)
        memory = model.memory.parts(start, end, samples, stage.replicas)
        lean = model.memory.parts(start, end, samples, stage.replicas, True) if recompute else None
        self.priced += 1
        cost: _Cost | None = None
        if peak_bytes(memory, 1, m) <= cap or (lean is not None and peak_bytes(lean, 1, m) <= cap):
            closing = model.allreduce(start, end, stage) + model.update(start, end)
            cost = (forward, backward, closing, memory, lean, {})
        self.costs[key] = cost
        return cost

    def place(self, free: tuple[int, ...], first: tuple[int, ...] | None, replicas: int) -> _Placed:
        """A new stage of ``replicas`` devices taken from ``free``, in front of a first stage
        with ``first`` devices per server (``None``: the new stage is the last)."""
        key = (free, first, replicas)
        placed = self.placed.get(key)
        if placed is None:
            cluster = self.cluster
            left, take = allocate(free, replicas, self.policy, cluster.devices_per_node, first)
            servers = sum(1 for c in take if c)
            per_byte = 0.0 if first is None else cluster.transfer_coefficient(take, first)
            if self._canonical:
                order = sorted(range(cluster.nodes), key=lambda n: (left[n], take[n]), reverse=True)
                left = tuple(left[n] for n in order)
                take = tuple(take[n] for n in order)
            placed = self.placed[key] = (left, Placement(replicas, servers, take), per_byte)
        return placed


_States = list[dict[tuple[int, ...], dict[tuple[tuple[int, ...], int] | None, list[_Suffix]]]]
"""``states[j][free][(first, n)]``: fronts of suffixes ``[j, L)`` of ``n`` stages (up to M)
that leave ``free`` devices per server and whose first stage has ``first`` devices per server."""


class _Search:
    """The branch and bound, run per (micro-batch count, placement policy); keeps the best plans
    of all its runs in ``top``."""

    def __init__(
        self,
        model: CostModel,
        top: int,
        replicas: Sequence[int],
        schedule: str,
        beam: int | None = None,
        memory_cap: float | None = None,
        recompute: bool = False,
    ) -> None:
        self.model = model
        self.recompute = recompute
        """Whether a stage that would not fit under the cap may recompute its activations."""
        self.memory_cap = model.cluster.memory_bytes if memory_cap is None else memory_cap
        """Most bytes a stage may take per device: the device memory, or less for a memory
        objective (``_objective`` says why the search stays exact under it)."""
        self.beam = beam
        self.top = _Top(top)
        self.replicas = tuple(replicas)
        self.schedule = schedule
        self.gpipe = schedule == "gpipe"
        self.states_expanded = 0
        """States whose stages the search priced (each its own pass over stage sizes and starts)."""
        self.priced = 0
        """Partial plans priced: a stage put in front of a suffix (the search's unit of work)."""
        self.kept = 0
        """Partial plans kept in a front when priced (some leave later, beaten or out of a beam)."""
        self.stages_priced = 0
        self.before = (0, 0, 0, 0)
        """:meth:`work` of an earlier search whose work this one continues."""
        self._costs: dict[int, dict[tuple[int, int, int, int], _Cost | None]] = {}
        """Stages ``[i, j)`` on a placement whose costs the search computed."""
        self._placed: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...] | None, int], _Placed]] = {}
        """Where :meth:`_Pass.place` put stages, per placement policy."""
        self.best_offered = math.inf
        self.end_bound = math.inf
        """The bound when the last run ended: that run found every plan of its own below it."""

    def sibling(self, top: int, beam: int | None) -> _Search:
        """A search of the same space for the ``top`` best that prices stages and places them in
        this one's tables (they depend on neither ``top`` nor the bound)."""
        other = _Search(self.model, top, self.replicas, self.schedule, beam, self.memory_cap, self.recompute)
        other._costs, other._placed = self._costs, self._placed
        return other

    def counts_in(self, other: _Search) -> None:
        """Count ``other``'s own work (not what it continues) as this search's."""
        own = (other.states_expanded, other.stages_priced, other.priced, other.kept)
        self.before = tuple(a + b for a, b in zip(self.before, own))  # type: ignore[assignment]

    def bounded(self, bound: float) -> None:
        """Start afresh on the best ``top`` plans, none found yet, under ``bound``."""
        self.top = _Top(self.top.k)
        self.top.limit(bound)

    def work(self) -> tuple[int, int, int, int]:
        """States expanded, stages priced, partial plans priced and kept, with :attr:`before`'s."""
        now = (self.states_expanded, self.stages_priced, self.priced, self.kept)
        return tuple(a + b for a, b in zip(self.before, now))  # type: ignore[return-value]

    def run(self, policy: str, micro_batches: int, cuts: Sequence[int] | None = None) -> float:
        """Offer the best plans with ``micro_batches`` under ``policy`` to ``self.top``.

        ``cuts`` restricts where stages begin (every layer when ``None``). Returns the
        latency of the best plan this run offered (``inf`` if none).
        """
        self.best_offered = math.inf
        search = _Pass(self.model, policy, micro_batches, cuts, self.replicas)
        # Stage costs depend on neither the placement policy nor the cut points: passes share them.
        search.costs = self._costs.setdefault(micro_batches, {})
        # Placements depend only on the policy: passes at other micro-batch counts share them.
        search.placed = self._placed.setdefault(policy, {})
        cluster = self.model.cluster
        layers = self.model.num_layers
        states: _States = [{} for _ in range(layers + 1)]
        states[layers][(cluster.devices_per_node,) * cluster.nodes] = {None: []}  # nothing placed yet
        for j in range(layers, 0, -1):
            for free, fronts in states[j].items():
                self._expand(search, states, j, free, fronts)
            states[j].clear()
        self.stages_priced += search.priced
        self.end_bound = self.top.bound
        return self.best_offered

    def _expand(
        self,
        search: _Pass,
        states: _States,
        j: int,
        free: tuple[int, ...],
        fronts: dict[tuple[tuple[int, ...], int] | None, list[_Suffix]],
    ) -> None:
        """Put every stage ``[i, j)`` the state allows in front of the suffixes of ``fronts``."""
        left = sum(free)
        if search.prefix_work[j] / left > self.top.bound:
            return
        # Micro-batch 0's forward, and its forward and backward, through layers [0, j) on at
        # most `left` replicas: lower bounds on what any prefix adds to Z and to D.
        head_start = search.forward_per_sample[j] * search.samples[left] + search.forward_fixed[j]
        head_passes = search.passes_per_sample[j] * search.samples[left] + search.passes_fixed[j]
        self.states_expanded += 1
        options = [r for r in search.counts if r < left]
        if left <= search.most:
            options.append(left)
        nbytes = self.model.cut_bytes(j, search.micro_batches)
        # Stages of different sizes often see a suffix through links of the same speed.
        links: dict[tuple[tuple[tuple[int, ...], int] | None, float], list[_Candidate]] = {}
        for r in options:
            groups = self._through_links(search, free, fronts, r, nbytes, (head_start, head_passes), links)
            for (left_free, stage), candidates in groups.items():
                if candidates:
                    self._prepend_stages(search, states, j, left - r, left_free, stage, candidates)

    def _through_links(
        self,
        search: _Pass,
        free: tuple[int, ...],
        fronts: dict[tuple[tuple[int, ...], int] | None, list[_Suffix]],
        replicas: int,
        nbytes: float,
        heads: tuple[float, float],
        links: dict[tuple[tuple[tuple[int, ...], int] | None, float], list[_Candidate]],
    ) -> dict[tuple[tuple[int, ...], Placement], list[_Candidate]]:
        """Each suffix seen through its link to a new stage of ``replicas`` devices, grouped by
        where that stage goes (the state it leads to); suffixes the bound rules out are left out.
        ``links`` keeps each front's candidates by the link's seconds per message, for the
        other stage sizes of the same state. ``heads``: lower bounds on what the layers in front
        add to Z and to D."""
        m = search.micro_batches
        gpipe = self.gpipe
        groups: dict[tuple[tuple[int, ...], Placement], list[_Candidate]] = {}
        for sub, front in fronts.items():
            first = None if sub is None else sub[0]
            left_free, stage, per_byte = search.placed.get((free, first, replicas)) or search.place(
                free, first, replicas
            )
            candidates = groups.setdefault((left_free, stage), [])
            if first is None:
                depth = m if gpipe else 1
                candidates.append((depth, 0 if gpipe else depth, not gpipe, None, None))
                continue
            send = search.cluster.message_time(nbytes, per_byte)
            seen = links.get((sub, send))
            if seen is None:
                seen = links[(sub, send)] = self._links(front, send, heads, m)
            candidates += seen
        return groups

    def _links(self, front: list[_Suffix], send: float, heads: tuple[float, float], m: int) -> list[_Candidate]:
        """The suffixes of ``front`` seen through a link of ``send`` seconds each way, up to the
        first that the bound rules out (by Z; by D, one at a time)."""
        gpipe = self.gpipe
        bound = self.top.bound
        head_start, head_passes = heads
        both = send + send
        out: list[_Candidate] = []
        stages = -1
        for suffix in front:  # sorted by Z: once one is out of the bound, so are the rest
            if send + suffix.z + head_start > bound:
                break
            if both + suffix.d + head_passes > bound:
                continue
            if suffix.stages != stages:  # one count per front unless it is a beam's
                # The stage count matters only through K = min(S - s, M) of the stages
                # before and of the suffix's first stage, and whether that one has K - 1: up to M.
                stages = suffix.stages
                depth = m if gpipe else min(stages + 1, m)
                next_depth = m if gpipe else min(stages, m)
                kept = 0 if gpipe else depth
                pairs = not gpipe and stages == depth - 1
            link = through_link(
                suffix.d, suffix.z, suffix.round_trip, suffix.x, suffix.passes, send, send, m, next_depth
            )
            out.append((depth, kept, pairs, link, suffix))
        return out

    def _prepend_stages(
        self,
        search: _Pass,
        states: _States,
        j: int,
        rest: int,
        left_free: tuple[int, ...],
        stage: Placement,
        candidates: list[_Candidate],
    ) -> None:
        """Stages ``[i, j)`` on ``stage`` in front of each of ``candidates``, for each ``i`` the
        bounds allow, leaving ``rest`` devices for the layers before ``i``: whole plans
        (``i == 0``) are offered to ``top``, partial ones kept in the fronts of their states."""
        top = self.top
        m = search.micro_batches
        beam = self.beam
        if rest == 0:
            starts: Iterable[int] = (0,)
        else:
            # Skip the cuts whose prefix alone is more work than `rest` devices can do within
            # the bound (prefix_work only grows with i).
            allowed = search.allowed
            top_i = bisect.bisect_right(search.prefix_work, top.bound * rest) - 1
            hi = min(bisect.bisect_left(allowed, j), bisect.bisect_right(allowed, top_i))
            starts = (allowed[x] for x in range(hi - 1, -1, -1))
        ahead_samples = search.samples[rest] if rest else 0
        costs = search.costs
        replicas, servers = stage.replicas, stage.servers
        for i in starts:
            # stage_cost's own table first: most stages were priced in another state.
            cost = costs.get((i, j, replicas, servers), costs)
            if cost is costs:
                cost = search.stage_cost(i, j, stage, self.memory_cap, self.recompute)
            if cost is None:
                break  # memory only grows as the stage takes earlier layers
            forward, backward, closing, _, _, _ = cost
            bound = top.bound
            all_passes = m * (forward + backward)
            if closing + all_passes > bound:
                break  # and so does the stage's own chain for earlier starts
            if i and search.prefix_work[i] / rest > bound:
                continue
            head_start = search.forward_per_sample[i] * ahead_samples + search.forward_fixed[i]
            head_passes = search.passes_per_sample[i] * ahead_samples + search.passes_fixed[i]
            # The stage's own passes (D >= M (F + B), Z >= closing + D) rule out every suffix.
            if closing + all_passes + head_start > bound or all_passes + head_passes > bound:
                continue
            # A full beam keeps its lowest Z: a suffix above its last one would leave at once.
            full = math.inf
            if beam is not None and i:
                front = states[i].get(left_free, {}).get((stage.take, 0))
                if front is not None and len(front) >= beam:
                    full = front[-1].z
                    if closing + all_passes > full:
                        continue
            self._attach_all(search, states, i, j, left_free, stage, cost, candidates, (head_start, head_passes), full)

    def _attach_all(
        self,
        search: _Pass,
        states: _States,
        i: int,
        j: int,
        left_free: tuple[int, ...],
        stage: Placement,
        cost: _Cost,
        candidates: list[_Candidate],
        heads: tuple[float, float],
        full: float,
    ) -> None:
        """Stage ``[i, j)`` of ``cost`` on ``stage`` in front of each of ``candidates`` that the
        bound (and ``full``, the last Z a full beam keeps) allows. ``heads``: lower bounds on
        what the layers before ``i`` add to Z and to D."""
        top = self.top
        m = search.micro_batches
        gpipe = self.gpipe
        beam = self.beam
        cap = self.memory_cap
        forward, backward, closing, memory, lean, by_depth = cost
        head_start, head_passes = heads
        fb = forward + backward
        bound = top.bound
        priced = kept = 0
        front: list[_Suffix] | None = None
        front_stages = -1
        for depth, stages, pairs, link, suffix in candidates:
            if link is not None:
                # Out of the bound or the beam before pricing: Z >= F + Z_link,
                # D >= F + B + D_link and Z >= closing + D.
                least_z = forward + link[1]
                least_d = fb + link[0]
                chain = closing + least_d
                if (
                    least_z > full
                    or chain > full
                    or least_z + head_start > bound
                    or chain + head_start > bound
                    or least_d + head_passes > bound
                ):
                    continue
            known = by_depth.get(depth, by_depth)
            if known is by_depth:
                known = by_depth[depth] = _depth_terms(forward, backward, memory, lean, depth, m, cap)
            if known is None:
                continue
            b, terms, recompute = known
            # D >= the warm-up window's chain: each jump waits a round trip through the link.
            if link is not None and terms[2] * (terms[0] + link[2]) + terms[3] + head_passes > bound:
                continue
            priced += 1
            d, z, round_trip, x, passes = attach(forward, b, closing, terms, link, pairs, gpipe)
            if z + head_start > bound or d + head_passes > bound:
                continue
            if i == 0:
                plan = _Suffix(stages, d, z, round_trip, x, passes, 0, j, stage.replicas, recompute, suffix)
                self._offer(plan, search.policy, m)
                bound = top.bound
                continue
            if front is None or front_stages != stages:
                # A beam keeps one front whatever the stage count.
                front_stages = stages
                sub = (stage.take, 0 if beam else stages)
                front = states[i].setdefault(left_free, {}).setdefault(sub, [])
            if z > full:
                continue
            new = _Suffix(stages, d, z, round_trip, x, passes, i, j, stage.replicas, recompute, suffix)
            kept += _insert(front, new, top.k, beam)
            if beam is not None:
                full = front[-1].z if len(front) >= beam else math.inf
        self.priced += priced
        self.kept += kept

    def _offer(self, plan: _Suffix, policy: str, m: int) -> None:
        spec: list[tuple[int, int, int, bool]] = []
        node: _Suffix | None = plan
        while node is not None:
            spec.append((node.start, node.end, node.replicas, node.recompute))
            node = node.rest
        # The policy places the same replica counts the same way up to renaming servers, so
        # the costs are those the search computed (plan_dapple checks).
        ranks = place(self.model.cluster, policy, [r for _, _, r, _ in spec])
        self.best_offered = min(self.best_offered, plan.z)
        self.top.offer(plan.z, (m, tuple(spec), ranks), (policy, m, tuple(spec), ranks))
