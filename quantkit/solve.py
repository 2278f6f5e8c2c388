"""Exact multiple-choice knapsack: one item from each class, least total cost, usage within every budget.

The recipe search's optimisation problem (issue 27): each tensor group (a *class*) gets one candidate
type (an *item*), whose cost is the group's predicted KLD and whose weights are what it uses of each
resource (stored bytes on the CPU, on the GPU, seconds per generated token, ...).  :func:`solve` finds
the choice of least total cost whose usage fits every capacity, and proves it.

Method (pure numpy):

1. Per class, items that do not fit alone and items dominated by another of the same class (no
   cheaper and no heavier in any budgeted resource) are dropped.  Resources that no choice can exceed
   are dropped from the search too.
2. The Lagrangian dual of the budgets gives the LP bound of the whole problem (the multiple-choice
   LP relaxation is the convex hull of each class).  It is maximised along rays: for a direction
   ``d`` over the resources, ``max_t L(t*d)`` is the LP bound of the single *surrogate* budget
   ``d.usage <= d.capacity``, computed exactly from each class's lower convex hull.
3. A beam search (the exact search below, truncated) gives a good incumbent; reduced-cost fixing
   against the Lagrangian removes every item that cannot be in a cheaper solution.
4. Dynamic programming over Pareto states, class after class: a state is (usage, cost) of the classes
   decided so far; a state dominated by another is dropped, and so is one whose cost plus the LP bound
   of the remaining classes with the remaining capacity (the best of the surrogate bounds: one per
   budgeted resource and the Lagrangian direction) cannot beat the incumbent.  Where the states grow
   past a limit they are split into chunks, best bound first, searched depth-first: a branch and bound
   over blocks of states, in bounded memory.

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
    """(t, value) maximising g(t) = sum_rows min_j (C + t S) - t X over t >= 0 (C padded with inf):
    the LP bound of one surrogate budget S <= X.  g is concave and piecewise linear; its maximum is at
    0 or at a breakpoint (two items of a row tie), found by ternary search over the sorted breakpoints."""
    with np.errstate(invalid="ignore", divide="ignore"):
        t = (C[:, :, None] - C[:, None, :]) / (S[:, None, :] - S[:, :, None])
    t = np.concatenate([[0.0], np.unique(t[np.isfinite(t) & (t > 0)])])

    def g(i):
        return float(np.min(C + t[i] * S, axis=1).sum() - t[i] * X)
    lo, hi = 0, len(t) - 1
    while hi - lo > 2:
        m1 = lo + (hi - lo) // 3
        m2 = hi - (hi - lo) // 3
        if g(m1) < g(m2):
            lo = m1 + 1
        else:
            hi = m2
    best = max(range(lo, hi + 1), key=g)
    return float(t[best]), g(best)


def _best_direction(C: np.ndarray, W: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """A direction d >= 0 (sum 1, over resources scaled by their capacity) with a large LP bound of
    the surrogate budget: a grid over the simplex refined by a pattern search.  Any d is a valid
    bound; the best one reaches the LP bound of all budgets together."""
    K = W.shape[2]
    Wn = W / cap                                        # scaled: every capacity is 1

    def h(d):
        return _ray_max(C, Wn @ d, float(d.sum()))[1]
    cands = [np.eye(K)[r] for r in range(K)] + [np.full(K, 1.0 / K)]
    if K == 2:
        cands += [np.array([a, 1 - a]) for a in np.linspace(0.1, 0.9, 9)]
    elif K == 3:
        g = 6
        cands += [np.array([i, j, g - i - j]) / g for i in range(g + 1) for j in range(g + 1 - i)]
    vals = [h(d) for d in cands]
    best = int(np.argmax(vals))
    d, v = cands[best], vals[best]
    step = 0.25 if K <= 3 else 0.5
    while step > 1e-3:
        improved = False
        for r in range(K):
            for q in range(K):
                if r == q or d[r] <= 0:
                    continue
                e = d.copy()
                mv = min(step, d[r])
                e[r] -= mv
                e[q] += mv
                ve = h(e)
                if ve > v * (1 + 1e-12) + 1e-300:
                    d, v, improved = e, ve, True
        if not improved:
            step /= 2
    return d / cap                                      # in the original units


def _lagrange_multipliers(C: np.ndarray, W: np.ndarray, cap: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, float]:
    """lam = t* d maximising the Lagrangian along d, and its value L(lam) (a lower bound)."""
    t, value = _ray_max(C, W @ d, float(cap @ d))
    return t * d, value


# ---- the search ----

class _Timeout(Exception):
    pass


class _Frame:
    """Back-pointers of the states found from one block of entry states: links[j] = (parent index,
    item index) of the states at stage start + j + 1; the entry states map to the parent frame's
    states at stage start through entry_ids."""
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


def _dominated(U: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Order of the states not dominated by another (no more usage anywhere, no more cost; of equal
    states the first), by increasing cost."""
    if U.shape[1] == 1:
        order = np.lexsort((c, U[:, 0]))
        cs = c[order]
        prev_min = np.minimum.accumulate(np.concatenate([[np.inf], cs[:-1]]))
        return order[cs < prev_min]
    keys = tuple(U[:, r] for r in range(U.shape[1] - 1, -1, -1)) + (c,)
    order = np.lexsort(keys)
    Us = U[order]
    S = len(order)
    bad = np.zeros(S, dtype=bool)
    block = max(1, 4_000_000 // max(S * U.shape[1], 1))
    idx = np.arange(S)
    for a in range(1, S, block):
        b = min(S, a + block)
        le = (Us[None, :b, :] <= Us[a:b, None, :]).all(axis=2)
        le &= idx[None, :b] < idx[a:b, None]
        bad[a:b] = le.any(axis=1)
    return order[~bad]


class _Search:
    def __init__(self, costs, weights, cap, base_usage, base_cost, directions, deadline):
        self.C, self.W, self.cap = costs, weights, cap
        self.n = len(costs)
        self.K = cap.shape[0]
        self.base_usage, self.base_cost = base_usage, base_cost
        mins = np.array([w.min(axis=0) for w in weights]).reshape(self.n, self.K)
        self.min_left = np.vstack([np.cumsum(mins[::-1], axis=0)[::-1], np.zeros((1, self.K))])
        self.bounds = [_SuffixBound(costs, weights, d) for d in directions]
        self.deadline = deadline
        self.ub = math.inf
        self.best: list[int] | None = None
        self.states = 0
        scale = sum(float(c.max() - c.min()) for c in costs) + abs(base_cost)
        self.scale = scale
        self.max_states = MAX_STATES_ONE if self.K == 1 else MAX_STATES_MANY

    def tol(self) -> float:
        return REL_TOL * (abs(self.ub) + self.scale) if math.isfinite(self.ub) else 0.0

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
            keep = lb < self.ub - self.tol()
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
                raise _Timeout(float(lb.min()) if len(lb) else math.inf)
            Ck, Wk = self.C[k], self.W[k]
            m = len(Ck)
            S = len(c)
            U2 = (U[:, None, :] + Wk[None, :, :]).reshape(S * m, K)
            c2 = (c[:, None] + Ck[None, :]).ravel()
            self.states += S * m
            ok = (U2 + self.min_left[k + 1] <= self.cap).all(axis=1)
            ok &= c2 < self.ub - self.tol()
            ids = np.flatnonzero(ok)
            U2, c2 = U2[ids], c2[ids]
            lb2 = c2 + self.bound(k + 1, U2)
            good = lb2 < self.ub - self.tol()
            ids, U2, c2, lb2 = ids[good], U2[good], c2[good], lb2[good]
            if not len(ids):
                return
            if k + 1 == n:
                i = int(np.argmin(c2))
                if c2[i] < self.ub:
                    frame.links.append((ids // m, ids % m))
                    self.best = _trace(frame, i, n)
                    frame.links.pop()
                    self.ub = float(c2[i])
                return
            keep = _dominated(U2, c2)
            ids, U2, c2, lb2 = ids[keep], U2[keep], c2[keep], lb2[keep]
            if beam is not None and len(ids) > beam:
                sel = np.argsort(lb2, kind="stable")[:beam]
                ids, U2, c2, lb2 = ids[sel], U2[sel], c2[sel], lb2[sel]
            frame.links.append((ids // m, ids % m))
            k += 1
            U, c, lb = U2, c2, lb2
            if len(c) > self.max_states:
                order = np.argsort(lb, kind="stable")
                size = max(1, self.max_states // 4)
                chunks = [order[a:a + size] for a in range(0, len(order), size)]
                for ch in reversed(chunks):         # the best bounds are searched first
                    stack.append((_Frame(frame, k, ch), k, U[ch], c[ch], lb[ch]))
                return


def _pareto(c: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Indices of the items of a class not dominated by another (of equal items the first)."""
    keys = tuple(w[:, r] for r in range(w.shape[1] - 1, -1, -1)) + (c,)
    order = np.lexsort(keys)
    kept: list[int] = []
    for i in order:
        if not any((w[j] <= w[i]).all() for j in kept):
            kept.append(int(i))
    return np.array(sorted(kept), dtype=np.int64)


def solve(classes: list[list[Item]], capacity: tuple[float, ...], *, time_limit: float = 30.0,
          names: tuple[str, ...] | None = None) -> Solution:
    """Choose one item per class minimising the total cost with the usage <= capacity per resource
    (``float('inf')``: unconstrained).  ``names`` name the resources in the infeasibility error.

    Raises InfeasibleBudget (a QuantkitError) when no choice fits; ValueError on malformed input
    (an empty class, a weight count that differs from the capacities, negative or non-finite values).
    """
    t0 = time.monotonic()
    cap_all = tuple(float(x) for x in capacity)
    K_all = len(cap_all)
    names = tuple(names) if names is not None else tuple(f"resource {r}" for r in range(K_all))
    if len(names) != K_all:
        raise ValueError(f"{len(names)} names for {K_all} resources")
    if any(math.isnan(x) or x < 0 for x in cap_all):
        raise ValueError(f"capacities must be >= 0 (or inf): {capacity}")
    costs, weights = [], []
    for ci, cls in enumerate(classes):
        if not cls:
            raise ValueError(f"class {ci} has no items")
        c = np.array([float(it.cost) for it in cls], dtype=np.float64)
        if any(len(it.weights) != K_all for it in cls):
            raise ValueError(f"class {ci}: an item's weights are not one per resource ({K_all})")
        w = np.array([[float(x) for x in it.weights] for it in cls], dtype=np.float64).reshape(len(cls), K_all)
        if not np.isfinite(c).all() or not np.isfinite(w).all() or (w < 0).any():
            raise ValueError(f"class {ci}: costs and weights must be finite, weights >= 0")
        costs.append(c)
        weights.append(w)
    n = len(classes)

    def finish(choice, optimal, bound, states=0):
        cost = math.fsum(costs[i][j] for i, j in enumerate(choice))
        usage = tuple(math.fsum(weights[i][j, r] for i, j in enumerate(choice)) for r in range(K_all))
        return Solution(list(choice), cost, usage, optimal, cost if optimal else min(bound, cost), states,
                        time.monotonic() - t0)

    smallest = tuple(math.fsum(w[:, r].min() for w in weights) for r in range(K_all))
    if any(smallest[r] > cap_all[r] for r in range(K_all)):
        raise InfeasibleBudget(smallest, cap_all, names, jointly=False)
    active = [r for r in range(K_all) if math.isfinite(cap_all[r])]
    cap = np.array([cap_all[r] for r in active], dtype=np.float64)
    # per class: the items that fit alone, then those no other item of the class dominates
    cand: list[np.ndarray] = []
    for c, w in zip(costs, weights):
        wa = w[:, active]
        fit = np.flatnonzero((wa <= cap).all(axis=1))
        if not len(fit):
            raise InfeasibleBudget(smallest, cap_all, names, jointly=True)
        cand.append(fit[_pareto(c[fit], wa[fit])])
    # budgets no choice can exceed are no constraint
    heaviest = np.array([math.fsum(weights[i][cand[i], r].max() for i in range(n)) for r in active])
    binding = [a for a, r in enumerate(active) if heaviest[a] > cap[a]]
    if not binding or n == 0:
        choice = [int(cand[i][np.argmin(costs[i][cand[i]])]) for i in range(n)]
        return finish(choice, True, -math.inf)
    active = [active[a] for a in binding]
    cap = cap[binding]
    # drop again what only the dropped resources made worth keeping
    for i in range(n):
        cand[i] = cand[i][_pareto(costs[i][cand[i]], weights[i][cand[i]][:, active])]

    deadline = t0 + time_limit
    incumbent: list[int] | None = None
    ub = math.inf
    states = 0
    lower = -math.inf
    fixed_by_reduced_cost = False

    def cost_of(choice):
        return math.fsum(costs[i][choice[i]] for i in range(n))

    while True:
        free = [i for i in range(n) if len(cand[i]) > 1]
        fixed = [i for i in range(n) if len(cand[i]) == 1]
        base_usage = np.array([math.fsum(weights[i][cand[i][0], r] for i in fixed) for r in active])
        base_cost = math.fsum(costs[i][cand[i][0]] for i in fixed)
        if not free:
            choice = [int(cand[i][0]) for i in range(n)]
            fits = all(math.fsum(weights[i][choice[i], r] for i in range(n)) <= cap_all[r] for r in active)
            if fits and cost_of(choice) < ub:
                incumbent, ub = choice, cost_of(choice)
            break
        if (base_usage > cap).any():
            break                                   # nothing cheaper than the incumbent fits
        K = len(active)
        M = max(len(cand[i]) for i in free)
        Cp = np.full((len(free), M), np.inf)
        Wp = np.zeros((len(free), M, K))
        for a, i in enumerate(free):
            Cp[a, :len(cand[i])] = costs[i][cand[i]]
            Wp[a, :len(cand[i])] = weights[i][cand[i]][:, active]
        capf = cap - base_usage
        scale = np.where(capf > 0, capf, 1.0)
        d = _best_direction(Cp, Wp, scale) if K > 1 else 1.0 / scale
        lam, lval = _lagrange_multipliers(Cp, Wp, capf, d)
        lower = max(lower, lval + base_cost)
        red = Cp + Wp @ lam
        red -= red.min(axis=1, keepdims=True)       # reduced costs, >= 0 (inf for padding)
        # stage order: the classes whose choice the Lagrangian leaves most open come last
        second = np.sort(red, axis=1)[:, 1]
        order = [free[a] for a in np.argsort(-second, kind="stable")]
        C = [costs[i][cand[i]] for i in order]
        W = [weights[i][cand[i]][:, active] for i in order]
        dirs = [np.eye(K)[r] / scale[r] for r in range(K)]
        if K > 1:
            dirs.append(d)
        search = _Search(C, W, cap, base_usage, base_cost, dirs, deadline)

        def chosen():
            pick = {i: int(cand[i][j]) for i, j in zip(order, search.best)}
            return [pick.get(i, int(cand[i][0])) for i in range(n)]
        if incumbent is None:
            search.deadline = math.inf              # bounded work: n stages of BEAM_WIDTH states
            search.run(beam=BEAM_WIDTH)
            search.deadline = deadline
            states += search.states
            if search.best is not None:
                incumbent = chosen()
                ub = cost_of(incumbent)
        if incumbent is not None and not fixed_by_reduced_cost:
            # reduced-cost fixing: an item whose reduced cost alone lifts the Lagrangian bound to the
            # incumbent's cost cannot be in a cheaper solution
            fixed_by_reduced_cost = True
            cut = ub - REL_TOL * (abs(ub) + 1.0) - lval - base_cost
            changed = False
            for a, i in enumerate(free):
                keep = red[a, :len(cand[i])] < cut
                if not keep.all():
                    changed = True
                    cand[i] = cand[i][keep]
                    if not len(cand[i]):
                        return finish(incumbent, True, ub, states)
            if changed:
                continue
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
            raise InfeasibleBudget(smallest, cap_all, names, jointly=True)
        return finish(incumbent, not math.isfinite(pending), max(lower, min(pending, ub)), states)
    if incumbent is None:
        raise InfeasibleBudget(smallest, cap_all, names, jointly=True)
    return finish(incumbent, True, ub, states)
