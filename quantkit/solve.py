"""Exact multiple-choice knapsack: one item from each class, least total cost, usage within every budget.

The recipe search's optimisation problem (issue 27): each tensor group (a *class*) gets one candidate
type (an *item*), whose cost is the group's predicted KLD and whose weights are what it uses of each
resource (stored bytes on the CPU, on the GPU, seconds per generated token, ...).  :func:`solve` finds
the choice of least total cost whose usage fits every capacity, and proves it.

Method (pure numpy):

1. Per class, items that do not fit alone and items dominated by another of the same class (no
   cheaper and no heavier in any budgeted resource) are dropped; each class's lightest usage is spent
   whatever the choice, so only the rest is shared.  Budgets no choice can exceed are dropped, and
   classes that share no budget are solved apart (CPU and GPU byte budgets: two problems).
2. The Lagrangian dual of the budgets gives the LP bound (the multiple-choice LP relaxation is each
   class's convex hull).  Along a direction ``d`` over the resources, ``max_t L(t*d)`` is the LP bound
   of the single *surrogate* budget ``d.usage <= d.capacity``; the best direction is searched over the
   simplex.
3. Incumbents: a beam search (the search below, truncated), and a core heuristic: the Lagrangian
   choice repaired to fit, then the CORE_SIZE classes the Lagrangian leaves most open solved exactly
   with the others fixed.  Reduced-cost fixing then drops every item that cannot be in a cheaper
   solution.
4. Dynamic programming over Pareto states, class after class: a state is (usage, cost) of the classes
   decided so far.  A state dominated by another (in the usage columns still live: touched by a class
   decided and by one left) is dropped, and so is one whose cost plus the LP bound of the classes left
   with the capacity left (the best of the surrogate bounds of each budget and of the Lagrangian
   direction, precomputed per suffix as piecewise-linear functions) cannot beat the incumbent.  Where
   the states grow past a limit they are split into chunks, best bound first, searched depth-first:
   a branch and bound over blocks of states, in bounded memory.

One budget (bytes) or independent ones (CPU and GPU bytes) are proven optimal in about a second for
300 classes x 12 items.  A speed budget couples every class; its proofs take longer (tens of seconds
at 100-300 classes, or the time limit with a gap of ~1e-3).

When the search ends within ``time_limit`` the result is optimal (to a relative 1e-9 of the cost:
float sums); otherwise it is the best found, with a proven lower bound (the least bound of the states
not yet searched).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from .errors import QuantkitError

# States kept at one stage before they are split into chunks searched one after the other.  The
# dominance filter is O(S log S) for one budgeted resource, O(S^2) for several.
MAX_STATES_ONE = 20000
MAX_STATES_MANY = 2000
BEAM_WIDTH = 24
REL_TOL = 1e-9
CORE_SIZE = 40


@dataclass(frozen=True)
class Item:
    cost: float
    weights: tuple[float, ...]          # one per resource


@dataclass
class Solution:
    choice: list[int]                   # per class, the index of the chosen item
    cost: float
    usage: tuple[float, ...]            # per resource
    optimal: bool                       # proven optimal (relative tolerance REL_TOL)
    bound: float                        # proven lower bound of the optimal cost (== cost when optimal)
    states: int = 0                     # search states generated (the work done)
    seconds: float = 0.0

    @property
    def gap(self) -> float:
        """Relative distance between the cost and the proven bound (0 when optimal)."""
        return 0.0 if self.optimal else (self.cost - self.bound) / max(abs(self.cost), 1e-300)


class InfeasibleBudget(QuantkitError):
    """No choice fits the capacities.  ``smallest``: per resource the least usage any choice has
    (each resource on its own); the caller may render them (bytes as GiB) from the attributes."""

    def __init__(self, smallest: tuple[float, ...], capacity: tuple[float, ...], names: tuple[str, ...],
                 jointly: bool):
        self.smallest, self.capacity, self.names, self.jointly = smallest, capacity, names, jointly
        parts = [f"{names[r]} {_num(smallest[r])} (budget {_num(capacity[r])})"
                 for r in range(len(capacity)) if math.isfinite(capacity[r])]
        if jointly:
            msg = ("no choice meets all the budgets at once, though each alone can be met; smallest "
                   + ", ".join(parts))
        else:
            over = [p for r, p in zip([r for r in range(len(capacity)) if math.isfinite(capacity[r])], parts)
                    if smallest[r] > capacity[r]]
            msg = "budget too small: the smallest achievable " + "; ".join(over)
        super().__init__(msg)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else f"{x:.6g}"


# ---- one-resource convex hulls: the LP relaxation of a class ----

def _hull(s: np.ndarray, c: np.ndarray) -> list[int]:
    """Indices of the lower-left convex hull of the points (s, c): from the least s (cheapest among
    equals) along strictly decreasing cost with increasing slopes: the points an LP would mix."""
    order = np.lexsort((np.arange(len(s)), c, s))
    hull: list[int] = []
    for i in order:
        if hull and c[i] >= c[hull[-1]]:
            continue                                    # heavier and no cheaper than the last point
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is above the segment a-i (or on it): not a vertex of the hull
            if (c[b] - c[a]) * (s[i] - s[a]) >= (c[i] - c[a]) * (s[b] - s[a]):
                hull.pop()
            else:
                break
        hull.append(int(i))
    return hull


def lower_hull(items: list[Item], resource: int = 0) -> list[int]:
    """Indices of the items on the lower convex hull of (weights[resource], cost), by increasing
    weight and decreasing cost: the efficient choices of one class when only that resource counts."""
    if not items:
        return []
    s = np.array([it.weights[resource] for it in items], dtype=np.float64)
    c = np.array([it.cost for it in items], dtype=np.float64)
    return _hull(s, c)


class _SuffixBound:
    """For a surrogate direction d: F_k(x), the LP bound of classes k.. with surrogate capacity x."""

    def __init__(self, costs: list[np.ndarray], weights: list[np.ndarray], d: np.ndarray):
        n = len(costs)
        base_s, base_c, seg_s, seg_c, seg_slope, seg_pos = np.zeros(n), np.zeros(n), [], [], [], []
        for k, (c, w) in enumerate(zip(costs, weights)):
            s = w @ d
            h = _hull(s, c)
            base_s[k], base_c[k] = s[h[0]], c[h[0]]
            for a, b in zip(h, h[1:]):
                seg_s.append(s[b] - s[a])
                seg_c.append(c[b] - c[a])
                seg_slope.append((c[b] - c[a]) / (s[b] - s[a]))
                seg_pos.append(k)
        order = np.argsort(np.array(seg_slope), kind="stable")
        seg_s = np.array(seg_s)[order]
        seg_c = np.array(seg_c)[order]
        seg_pos = np.array(seg_pos, dtype=np.int64)[order]
        s0 = np.concatenate([np.cumsum(base_s[::-1])[::-1], [0.0]])
        c0 = np.concatenate([np.cumsum(base_c[::-1])[::-1], [0.0]])
        self.d = d
        self.x: list[np.ndarray] = []
        self.y: list[np.ndarray] = []
        for k in range(n + 1):
            keep = seg_pos >= k
            self.x.append(s0[k] + np.concatenate([[0.0], np.cumsum(seg_s[keep])]))
            self.y.append(c0[k] + np.concatenate([[0.0], np.cumsum(seg_c[keep])]))
        self.tol = [1e-12 * (abs(x[-1]) + 1.0) for x in self.x]

    def __call__(self, k: int, x: np.ndarray) -> np.ndarray:
        xs, ys = self.x[k], self.y[k]
        out = np.interp(x, xs, ys)
        out[x < xs[0] - self.tol[k]] = np.inf          # the classes left cannot fit at all
        return out


# ---- the Lagrangian direction ----

def _ray_max(C: np.ndarray, S: np.ndarray, X: float) -> tuple[float, float]:
    """(t, g(t)) with t >= 0 maximising g(t) = sum_rows min_j (C + t S) - t X (C padded with inf): the
    LP bound of the single surrogate budget S <= X.  g is concave and piecewise linear, its maximum at
    0 or where two items of a row tie: a bisection over those breakpoints on the sign of g's slope
    between them (any t gives a valid bound; this finds the best)."""
    rows = np.arange(C.shape[0])

    def slope(t):
        return float(S[rows, np.argmin(C + t * S, axis=1)].sum() - X)

    def g(t):
        return float(np.min(C + t * S, axis=1).sum() - t * X)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        t = (C[:, :, None] - C[:, None, :]) / (S[:, None, :] - S[:, :, None])
    t = np.unique(t[np.isfinite(t) & (t > 0)])
    t = np.concatenate([[0.0], t, [2 * t[-1] + 1 if len(t) else 1.0]])
    lo, hi = 0, len(t) - 1            # g rises on (t[lo], t[lo + 1]), falls after t[hi]
    if slope(0.5 * (t[0] + t[1])) <= 0:
        return 0.0, g(0.0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if slope(0.5 * (t[mid] + t[mid + 1])) > 0:
            lo = mid
        else:
            hi = mid
    return float(t[hi]), g(t[hi])


def _best_direction(C: np.ndarray, W: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """A direction d >= 0 over the resources with a large LP bound of its surrogate budget: a grid over
    the simplex (resources scaled by their capacity) refined by a pattern search.  Any d gives a valid
    bound; the best one reaches the LP bound of all budgets together (the Lagrangian dual)."""
    K = W.shape[2]
    Wn = W / scale                                      # every capacity is 1

    def h(d):
        return _ray_max(C, Wn @ d, float(d.sum()))[1]
    cands = [np.eye(K)[r] for r in range(K)] + [np.full(K, 1.0 / K)]
    if K == 2:
        cands += [np.array([a, 1 - a]) for a in np.linspace(0.1, 0.9, 9)]
    elif K == 3:
        cands += [np.array([i, j, 6 - i - j]) / 6 for i in range(7) for j in range(7 - i)]
    vals = [h(d) for d in cands]
    best = int(np.argmax(vals))
    d, v = cands[best], vals[best]
    step = 0.25
    while step > 1 / 64:
        improved = False
        for r in range(K):
            for q in range(K):
                if r == q or d[r] <= 0:
                    continue
                e = d.copy()
                e[q] += min(step, d[r])
                e[r] -= min(step, d[r])
                ve = h(e)
                if ve > v + 1e-12 * abs(v):
                    d, v, improved = e, ve, True
        if not improved:
            step /= 2
    return d / scale                                    # in the resources' own units


# ---- the search ----

class _Timeout(Exception):
    pass


class _Frame:
    """Back-pointers of the states grown from one block of entry states: links[j] = (parent index,
    item index) of the states at stage start + j + 1; the entry states are the parent frame's states
    at stage start picked by entry_ids."""
    __slots__ = ("parent", "start", "entry_ids", "links")

    def __init__(self, parent, start, entry_ids):
        self.parent, self.start, self.entry_ids, self.links = parent, start, entry_ids, []


def _trace(frame: _Frame, idx: int, n: int) -> list[int]:
    choice = [0] * n
    while frame is not None:
        for j in range(len(frame.links) - 1, -1, -1):
            par, item = frame.links[j]
            choice[frame.start + j] = int(item[idx])
            idx = int(par[idx])
        if frame.parent is not None:
            idx = int(frame.entry_ids[idx])
        frame = frame.parent
    return choice


def _nondominated(U: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Indices of the states no other state dominates (no more cost, no more usage in any column of U;
    of equal states the first).  Dominance is a strict order here, so every state dropped has a kept
    one that dominates it."""
    S, K = U.shape
    if K == 0:
        return np.array([int(np.argmin(c))])
    if K == 1:
        order = np.lexsort((c, U[:, 0]))
        cs = c[order]
        prev_min = np.minimum.accumulate(np.concatenate([[np.inf], cs[:-1]]))
        return order[cs < prev_min]
    keys = tuple(U[:, r] for r in range(K - 1, -1, -1)) + (c,)
    order = np.lexsort(keys)                        # by cost, then usage: a dominator comes first
    Us = U[order]
    bad = np.zeros(S, dtype=bool)
    block = 256
    tri = np.tri(block, block, -1, dtype=bool)      # j < i within a block
    if K == 2:
        # against the staircase (the Pareto front in usage) of the states kept from earlier blocks
        sx, sy = np.empty(0), np.empty(0)
        for a in range(0, S, block):
            b = min(S, a + block)
            bx, by = Us[a:b, 0], Us[a:b, 1]
            if len(sx):
                j = np.searchsorted(sx, bx, side="right") - 1
                bad[a:b] = (j >= 0) & (sy[np.maximum(j, 0)] <= by)
            le = (bx[None, :] <= bx[:, None]) & (by[None, :] <= by[:, None]) & tri[:b - a, :b - a]
            bad[a:b] |= le.any(axis=1)
            kept = ~bad[a:b]
            px = np.concatenate([sx, bx[kept]])
            py = np.concatenate([sy, by[kept]])
            o = np.lexsort((py, px))
            px, py = px[o], py[o]
            front = py < np.minimum.accumulate(np.concatenate([[np.inf], py[:-1]]))
            sx, sy = px[front], py[front]
        return order[~bad]
    for a in range(0, S, block):
        b = min(S, a + block)
        le = (Us[None, :b, :] <= Us[a:b, None, :]).all(axis=2)
        le[:, a:b] &= tri[:b - a, :b - a]
        bad[a:b] = le.any(axis=1)
    return order[~bad]


class _Search:
    """Dynamic programming over Pareto states, class after class, with bound pruning; chunks of states
    searched depth-first where they grow past max_states (see the module docstring)."""

    def __init__(self, costs, weights, cap, base_usage, base_cost, directions, deadline):
        self.C, self.W, self.cap = costs, weights, cap
        self.n = n = len(costs)
        self.K = K = cap.shape[0]
        self.base_usage, self.base_cost = base_usage, base_cost
        mins = np.array([w.min(axis=0) for w in weights]).reshape(n, K)
        self.min_left = np.vstack([np.cumsum(mins[::-1], axis=0)[::-1], np.zeros((1, K))])
        # the columns of the usage in which states after stage k can differ and still matter: touched
        # by a class decided and by a class left
        touch = np.array([(w > w.min(axis=0)).any(axis=0) for w in weights]).reshape(n, K)
        before = np.cumsum(touch, axis=0) > 0
        after = np.vstack([np.cumsum(touch[::-1], axis=0)[::-1] > 0, np.zeros((1, K), dtype=bool)])
        self.live = [np.flatnonzero(before[k] & after[k + 1]) for k in range(n)]
        self.bounds = [_SuffixBound(costs, weights, d) for d in directions]
        self.deadline = deadline
        self.ub = math.inf
        self.best: list[int] | None = None
        self.states = 0
        self.scale = sum(float(c.max() - c.min()) for c in costs) + abs(base_cost)
        self.max_states = max(MAX_STATES_ONE if max(len(x) for x in self.live) <= 2 else MAX_STATES_MANY, 1)

    def cut(self) -> float:
        """States whose bound reaches this cannot beat the incumbent (by more than the tolerance)."""
        return self.ub - REL_TOL * (abs(self.ub) + self.scale) if math.isfinite(self.ub) else math.inf

    def bound(self, k: int, U: np.ndarray) -> np.ndarray:
        rem = self.cap[None, :] - U
        lb = np.full(len(U), -np.inf)
        for b in self.bounds:
            lb = np.maximum(lb, b(k, rem @ b.d))
        return lb

    def run(self, beam: int | None = None) -> float:
        """Search from the root; returns the least bound of what was left unsearched (inf when the
        search completed).  beam: keep only the best `beam` states per stage (a heuristic)."""
        U0 = self.base_usage[None, :].copy()
        c0 = np.array([self.base_cost])
        stack = [(_Frame(None, 0, None), 0, U0, c0, c0 + self.bound(0, U0))]
        while stack:
            frame, k, U, c, lb = stack.pop()
            keep = lb < self.cut()
            if not keep.any():
                continue
            if not keep.all():                      # (never the root: one state)
                frame = _Frame(frame.parent, k, frame.entry_ids[keep])
                U, c, lb = U[keep], c[keep], lb[keep]
            try:
                self._descend(frame, k, U, c, lb, stack, beam)
            except _Timeout as t:
                return min([t.args[0]] + [float(e[4].min()) for e in stack])
        return math.inf

    def _descend(self, frame, k, U, c, lb, stack, beam):
        n, K = self.n, self.K
        while True:
            if time.monotonic() > self.deadline:
                raise _Timeout(float(lb.min()))
            Ck, Wk = self.C[k], self.W[k]
            m, S = len(Ck), len(c)
            U2 = (U[:, None, :] + Wk[None, :, :]).reshape(S * m, K)
            c2 = (c[:, None] + Ck[None, :]).ravel()
            self.states += S * m
            ids = np.flatnonzero((U2 + self.min_left[k + 1] <= self.cap).all(axis=1) & (c2 < self.cut()))
            U2, c2 = U2[ids], c2[ids]
            lb2 = c2 + self.bound(k + 1, U2)
            good = lb2 < self.cut()
            ids, U2, c2, lb2 = ids[good], U2[good], c2[good], lb2[good]
            if not len(ids):
                return
            if k + 1 == n:
                i = int(np.argmin(c2))
                frame.links.append((ids // m, ids % m))
                self.best = _trace(frame, i, n)
                frame.links.pop()
                self.ub = float(c2[i])
                return
            keep = _nondominated(U2[:, self.live[k]], c2)
            ids, U2, c2, lb2 = ids[keep], U2[keep], c2[keep], lb2[keep]
            if beam is not None and len(ids) > beam:
                sel = np.argsort(lb2, kind="stable")[:beam]
                ids, U2, c2, lb2 = ids[sel], U2[sel], c2[sel], lb2[sel]
            frame.links.append((ids // m, ids % m))
            k, U, c, lb = k + 1, U2, c2, lb2
            if len(c) > self.max_states:
                order = np.argsort(lb, kind="stable")
                size = max(1, self.max_states // 4)
                for a in range(len(order) - (len(order) - 1) % size - 1, -1, -size):
                    ch = order[a:a + size]          # pushed worst first: the best bounds are searched first
                    stack.append((_Frame(frame, k, ch), k, U[ch], c[ch], lb[ch]))
                return


def _pareto(c: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Indices (ascending) of the items of a class no other item dominates (of equal items the first)."""
    keys = tuple(w[:, r] for r in range(w.shape[1] - 1, -1, -1)) + (c,)
    kept: list[int] = []
    for i in np.lexsort(keys):
        if not any((w[j] <= w[i]).all() for j in kept):
            kept.append(int(i))
    return np.array(sorted(kept), dtype=np.int64)


class _Infeasible(Exception):
    pass


@dataclass
class _Part:
    choice: list[int]           # per class of the component, the index into its items
    cost: float
    optimal: bool
    bound: float
    states: int


def _core_incumbent(costs, weights, cap, red, deadline) -> list[int] | None:
    """A good feasible choice: the Lagrangian choice (least reduced cost) repaired to fit, then the
    CORE_SIZE classes whose choice the Lagrangian leaves most open solved exactly with the others
    fixed (the core of Pisinger's algorithms).  None when no fitting choice is found."""
    n, K = len(costs), len(cap)
    choice = [int(np.argmin(red[i, :len(costs[i])])) for i in range(n)]
    usage = np.sum([weights[i][choice[i]] for i in range(n)], axis=0)
    # repair: while over a budget, the move of least cost per unit of excess removed (the excess, in
    # capacities, falls at each move: no cycle)
    M = max(len(c) for c in costs)
    Cp = np.full((n, M), np.inf)
    Wp = np.zeros((n, M, K))
    for i in range(n):
        Cp[i, :len(costs[i])] = costs[i]
        Wp[i, :len(costs[i])] = weights[i]
    unit = np.where(cap > 0, cap, 1.0)
    rows = np.arange(n)
    for _ in range(20 * n * M):
        if not (usage > cap).any():
            break
        moved = usage + Wp - Wp[rows, choice][:, None, :]
        gain = (np.maximum(usage - cap, 0) / unit).sum() - (np.maximum(moved - cap, 0) / unit).sum(axis=2)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(gain > 0, (Cp - Cp[rows, choice][:, None]) / gain, np.inf)
        i, j = np.unravel_index(int(np.argmin(ratio)), ratio.shape)
        if not np.isfinite(ratio[i, j]):
            return None
        usage = moved[i, j]
        choice[i] = int(j)
    if (usage > cap).any():
        return None
    second = np.sort(red, axis=1)[:, 1]
    core = sorted(np.argsort(second, kind="stable")[:CORE_SIZE].tolist())
    rest = [i for i in range(n) if i not in set(core)]
    left = cap - np.sum([weights[i][choice[i]] for i in rest] or [np.zeros(K)], axis=0)
    now = time.monotonic()
    try:
        part = _solve_component([costs[i] for i in core], [weights[i] for i in core], left,
                                min(deadline, now + 0.25 * max(deadline - now, 0)), math.inf, core=False)
    except (_Infeasible, QuantkitError):
        return choice
    for i, j in zip(core, part.choice):
        choice[i] = j
    return choice


def _solve_component(costs: list[np.ndarray], weights: list[np.ndarray], cap: np.ndarray,
                     deadline: float, time_limit: float, core: bool = True) -> _Part:
    """Exact search of classes that share budgets: costs[i] (m_i,), weights[i] (m_i, K), each item
    fitting alone and none dominated.  Raises _Infeasible when no choice fits."""
    n, K = len(costs), len(cap)
    cand = [np.arange(len(c)) for c in costs]       # the items still in play, per class
    incumbent: list[int] | None = None
    ub = math.inf
    lower = -math.inf
    states = 0
    reduced_cost_fixed = False

    def cost_of(choice):
        return math.fsum(costs[i][choice[i]] for i in range(n))

    def fits(choice):
        return all(math.fsum(weights[i][choice[i], r] for i in range(n)) <= cap[r] for r in range(K))

    while True:
        free = [i for i in range(n) if len(cand[i]) > 1]
        fixed = [i for i in range(n) if len(cand[i]) == 1]
        base_usage = np.array([math.fsum(weights[i][cand[i][0], r] for i in fixed) for r in range(K)])
        base_cost = math.fsum(costs[i][cand[i][0]] for i in fixed)
        if not free:
            choice = [int(cand[i][0]) for i in range(n)]
            if fits(choice) and cost_of(choice) < ub:
                incumbent, ub = choice, cost_of(choice)
            break
        if (base_usage > cap).any():
            break                                   # nothing cheaper than the incumbent fits
        M = max(len(cand[i]) for i in free)
        Cp = np.full((len(free), M), np.inf)
        Wp = np.zeros((len(free), M, K))
        for a, i in enumerate(free):
            Cp[a, :len(cand[i])] = costs[i][cand[i]]
            Wp[a, :len(cand[i])] = weights[i][cand[i]]
        capf = cap - base_usage
        scale = np.where(capf > 0, capf, 1.0)
        d = _best_direction(Cp, Wp, scale) if K > 1 else 1.0 / scale
        t, lval = _ray_max(Cp, Wp @ d, float(capf @ d))
        lower = max(lower, min(lval + base_cost, ub))
        red = Cp + Wp @ (t * d)
        red -= red.min(axis=1, keepdims=True)       # reduced costs, >= 0 (inf for padding)
        if incumbent is not None and not reduced_cost_fixed:
            # reduced-cost fixing: an item whose reduced cost alone lifts the Lagrangian bound to the
            # incumbent's cost cannot be in a cheaper solution
            reduced_cost_fixed = True
            cut = ub - REL_TOL * (abs(ub) + 1.0) - lval - base_cost
            changed = False
            for a, i in enumerate(free):
                keep = red[a, :len(cand[i])] < cut
                if not keep.all():
                    changed = True
                    cand[i] = cand[i][keep]
                    if not len(cand[i]):            # no cheaper solution exists
                        return _Part(incumbent, ub, True, ub, states)
            if changed:
                continue
        # stages: classes grouped by the budgets they touch; in a group, the classes whose choice the
        # Lagrangian leaves most open come last
        second = np.sort(red, axis=1)[:, 1]
        support = [tuple(np.flatnonzero((Wp[a, :len(cand[i])] > Wp[a, :len(cand[i])].min(axis=0)).any(axis=0)))
                   for a, i in enumerate(free)]
        order_a = sorted(range(len(free)), key=lambda a: (len(support[a]), support[a], -second[a]))
        order = [free[a] for a in order_a]
        C = [costs[i][cand[i]] for i in order]
        W = [weights[i][cand[i]] for i in order]
        dirs = [np.eye(K)[r] / scale[r] for r in range(K)]
        if K > 1:
            dirs.append(d)
        search = _Search(C, W, cap, base_usage, base_cost, dirs, deadline)

        def chosen():
            pick = {i: int(cand[i][j]) for i, j in zip(order, search.best)}
            return [pick.get(i, int(cand[i][0])) for i in range(n)]
        if incumbent is None:
            # heuristics: a beam search (bounded work: n stages of BEAM_WIDTH states), then the core
            search.deadline = math.inf
            search.run(beam=BEAM_WIDTH)
            search.deadline = deadline
            states += search.states
            if search.best is not None:
                incumbent = chosen()
                ub = cost_of(incumbent)
            if core and len(free) > CORE_SIZE:
                found = _core_incumbent([costs[i][cand[i]] for i in free], [weights[i][cand[i]] for i in free],
                                        capf, red, deadline)
                if found is not None:
                    pick = {i: int(cand[i][j]) for i, j in zip(free, found)}
                    trial = [pick.get(i, int(cand[i][0])) for i in range(n)]
                    if cost_of(trial) < ub:
                        incumbent, ub = trial, cost_of(trial)
            if incumbent is not None and not reduced_cost_fixed:
                continue                            # fix by reduced costs, then search exactly
        search.ub, search.best, search.states = ub, None, 0
        pending = search.run()
        states += search.states
        if search.best is not None:
            incumbent = chosen()
            ub = cost_of(incumbent)
        if incumbent is None:
            if math.isfinite(pending):
                raise QuantkitError(f"no choice within the budgets found in {time_limit:g} s (the search "
                                    f"did not end: a longer time limit may find one)")
            raise _Infeasible
        done = not math.isfinite(pending)
        return _Part(incumbent, ub, done, ub if done else max(lower, min(pending, ub)), states)
    if incumbent is None:
        raise _Infeasible
    return _Part(incumbent, ub, True, ub, states)


def solve(classes: list[list[Item]], capacity: tuple[float, ...], *, time_limit: float = 30.0,
          names: tuple[str, ...] | None = None) -> Solution:
    """Choose one item per class minimising the total cost with the usage <= capacity per resource
    (``float('inf')``: unconstrained).  ``names`` name the resources in the infeasibility error.

    Raises InfeasibleBudget (a QuantkitError) when no choice fits; ValueError on malformed input
    (an empty class, a weight count that differs from the capacities, negative or non-finite values).
    """
    t0 = time.monotonic()
    deadline = t0 + time_limit
    cap_all = tuple(float(x) for x in capacity)
    K_all = len(cap_all)
    names = tuple(names) if names is not None else tuple(f"resource {r}" for r in range(K_all))
    if len(names) != K_all:
        raise ValueError(f"{len(names)} names for {K_all} resources")
    if any(math.isnan(x) for x in cap_all):
        raise ValueError(f"a capacity is NaN: {capacity}")     # (a negative one: an infeasible budget)
    costs, weights = [], []
    for ci, cls in enumerate(classes):
        if not cls:
            raise ValueError(f"class {ci} has no items")
        if any(len(it.weights) != K_all for it in cls):
            raise ValueError(f"class {ci}: an item's weights are not one per resource ({K_all})")
        c = np.array([float(it.cost) for it in cls], dtype=np.float64)
        w = np.array([[float(x) for x in it.weights] for it in cls], dtype=np.float64).reshape(len(cls), K_all)
        if not np.isfinite(c).all() or not np.isfinite(w).all() or (w < 0).any():
            raise ValueError(f"class {ci}: costs and weights must be finite, weights >= 0")
        costs.append(c)
        weights.append(w)
    n = len(classes)
    smallest = tuple(math.fsum(w[:, r].min() for w in weights) for r in range(K_all))
    if any(smallest[r] > cap_all[r] for r in range(K_all)):
        raise InfeasibleBudget(smallest, cap_all, names, jointly=False)
    jointly = InfeasibleBudget(smallest, cap_all, names, jointly=True)

    active = [r for r in range(K_all) if math.isfinite(cap_all[r])]
    cap = np.array([cap_all[r] for r in active], dtype=np.float64)
    # per class: the items that fit alone, and of those the ones no other dominates
    cand: list[np.ndarray] = []
    for c, w in zip(costs, weights):
        fit = np.flatnonzero((w[:, active] <= cap).all(axis=1))
        if not len(fit):
            raise jointly
        cand.append(fit[_pareto(c[fit], w[fit][:, active])])
    # each class's lightest usage per budget is spent whatever the choice: what is left to share
    lightest = np.array([[weights[i][cand[i], r].min() for r in active] for i in range(n)]).reshape(n, len(active))
    left = cap - np.array([math.fsum(lightest[:, a]) for a in range(len(active))])
    if (left < 0).any():
        raise jointly
    extra = [weights[i][cand[i]][:, active] - lightest[i] for i in range(n)]
    heaviest = np.array([math.fsum(e[:, a].max() for e in extra) for a in range(len(active))])
    binding = heaviest > left                       # budgets some choice can exceed
    touch = np.array([(e > 0).any(axis=0) & binding for e in extra]).reshape(n, len(active))
    # classes sharing a binding budget are one component; a class touching none takes its cheapest
    comp = list(range(len(active)))

    def root(a):
        while comp[a] != a:
            comp[a] = comp[comp[a]]
            a = comp[a]
        return a
    for i in range(n):
        rs = np.flatnonzero(touch[i])
        for r in rs[1:]:
            comp[root(r)] = root(rs[0])
    choice = [0] * n
    optimal, bound, states = True, 0.0, 0
    groups: dict[int, list[int]] = {}
    for i in range(n):
        rs = np.flatnonzero(touch[i])
        if len(rs):
            groups.setdefault(root(rs[0]), []).append(i)
        else:
            # the cheapest; of equal costs the lightest (cand is Pareto), then the first
            choice[i] = int(cand[i][np.argmin(costs[i][cand[i]])])
            bound += float(costs[i][choice[i]])
    for key, members in groups.items():
        rs = [a for a in range(len(active)) if binding[a] and root(a) == key]
        try:
            part = _solve_component([costs[i][cand[i]] for i in members],
                                    [extra[i][:, rs] for i in members], left[rs], deadline, time_limit)
        except _Infeasible:
            raise jointly from None
        for i, j in zip(members, part.choice):
            choice[i] = int(cand[i][j])
        optimal &= part.optimal
        bound += part.bound
        states += part.states
    cost = math.fsum(costs[i][choice[i]] for i in range(n))
    usage = tuple(math.fsum(weights[i][choice[i], r] for i in range(n)) for r in range(K_all))
    # (float sums in another order may differ in the last bits: seconds per token; bytes are exact)
    assert all(u <= cp + 1e-9 * abs(cp) for u, cp in zip(usage, cap_all)), (usage, cap_all)
    return Solution(choice, cost, usage, optimal, cost if optimal else min(bound, cost), states,
                    time.monotonic() - t0)
