"""quantkit.solve: the exact multiple-choice knapsack of the recipe search (issue 27).

Against brute force on many random small instances (1-3 resources, ties, equal weights, budgets at
the exact usage of a solution, unconstrained resources); a 300-class x 12-item instance shaped like a
recipe search (bytes ~ bpw, error ~ 2^-bpw) solved and proven optimal fast; infeasible budgets as one
line naming the smallest usage; malformed input.
"""
from __future__ import annotations

import itertools
import math
import random
import time

import numpy as np
import pytest

from quantkit.errors import QuantkitError
from quantkit.solve import InfeasibleBudget, Item, Solution, lower_hull, solve

INF = float("inf")


def brute_force(classes, capacity):
    """(least cost, every optimal choice) over all choices, or None when none fits."""
    best, choices = None, []
    for choice in itertools.product(*[range(len(c)) for c in classes]):
        usage = [sum(classes[i][j].weights[r] for i, j in enumerate(choice)) for r in range(len(capacity))]
        if all(u <= cap for u, cap in zip(usage, capacity)):
            cost = sum(classes[i][j].cost for i, j in enumerate(choice))
            if best is None or cost < best - 1e-12:
                best, choices = cost, [choice]
            elif abs(cost - best) <= 1e-12:
                choices.append(choice)
    return None if best is None else (best, choices)


def check_solution(classes, capacity, sol: Solution):
    usage = [math.fsum(classes[i][j].weights[r] for i, j in enumerate(sol.choice)) for r in range(len(capacity))]
    assert len(sol.choice) == len(classes)
    assert all(u <= cap for u, cap in zip(usage, capacity)), (usage, capacity)
    assert sol.usage == pytest.approx(tuple(usage))
    assert sol.cost == pytest.approx(math.fsum(classes[i][j].cost for i, j in enumerate(sol.choice)))


def random_instance(rng: random.Random):
    """Small integers, so ties (equal costs, equal weights, budgets met exactly) are frequent."""
    K = rng.randint(1, 3)
    n = rng.randint(1, 6)
    classes = [[Item(rng.randint(0, 20), tuple(rng.randint(0, 10) for _ in range(K)))
                for _ in range(rng.randint(1, 4))] for _ in range(n)]
    if rng.random() < 0.3:                      # a class of identical items, or of equal weights
        w = tuple(rng.randint(0, 10) for _ in range(K))
        classes[0] = [Item(rng.choice([3, 3, 5]), w) for _ in range(3)]
    capacity = []
    for _ in range(K):
        roll = rng.random()
        if roll < 0.15:
            capacity.append(INF)
        elif roll < 0.4:                        # exactly the usage of some choice
            choice = [rng.randrange(len(c)) for c in classes]
            capacity.append(sum(classes[i][j].weights[len(capacity)] for i, j in enumerate(choice)))
        else:
            capacity.append(rng.randint(0, 6 * n))
    return classes, tuple(capacity)


@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force(seed):
    rng = random.Random(seed)
    feasible = infeasible = 0
    for _ in range(400):
        classes, capacity = random_instance(rng)
        expected = brute_force(classes, capacity)
        if expected is None:
            with pytest.raises(InfeasibleBudget):
                solve(classes, capacity)
            infeasible += 1
            continue
        sol = solve(classes, capacity)
        check_solution(classes, capacity, sol)
        assert sol.optimal and sol.cost == pytest.approx(expected[0]) and sol.bound == pytest.approx(expected[0])
        assert tuple(sol.choice) in expected[1]
        feasible += 1
    assert feasible > 150 and infeasible > 20         # both kinds are exercised


def test_float_costs_match_brute_force():
    """Costs and weights of a recipe search's magnitudes (KLD ~1e-3, bytes ~1e9)."""
    rng = np.random.default_rng(7)
    for _ in range(150):
        K = int(rng.integers(1, 4))
        classes = [[Item(float(rng.lognormal(-7, 1)), tuple(float(x) for x in rng.integers(1, 4, K) * 10**9 // 7))
                    for _ in range(int(rng.integers(2, 5)))] for _ in range(int(rng.integers(2, 6)))]
        lo = [sum(min(it.weights[r] for it in c) for c in classes) for r in range(K)]
        hi = [sum(max(it.weights[r] for it in c) for c in classes) for r in range(K)]
        capacity = tuple(a + float(rng.uniform(0, 1)) * (b - a) for a, b in zip(lo, hi))
        expected = brute_force(classes, capacity)
        if expected is None:
            with pytest.raises(InfeasibleBudget):
                solve(classes, capacity)
            continue
        sol = solve(classes, capacity)
        check_solution(classes, capacity, sol)
        assert sol.optimal and sol.cost == pytest.approx(expected[0], rel=1e-9)


def recipe_like(n: int, m: int, seed: int, devices: int = 1, speed: bool = False):
    """n groups x m types: bytes = elements * bpw / 8 on the group's device, error ~ s * 2^-1.1bpw with
    noise (a non-convex frontier); speed: a last resource, seconds per token ~ bytes / bandwidth."""
    rng = np.random.default_rng(seed)
    bpw = np.sort(rng.uniform(2, 8.5, m))
    bandwidth = [60e9, 900e9]
    classes = []
    for _ in range(n):
        elements = int(rng.choice([1, 4, 16])) * int(rng.integers(1, 4)) * 10**6
        sensitivity = rng.lognormal(0, 1)
        device = int(rng.integers(0, devices))
        items = []
        for b in bpw:
            nbytes = round(elements * b / 8)
            w = [0.0] * devices
            w[device] = float(nbytes)
            if speed:
                w.append(nbytes / bandwidth[device])
            items.append(Item(float(sensitivity * 2.0 ** (-1.1 * b) * (1 + 0.05 * rng.standard_normal())), tuple(w)))
        classes.append(items)
    return classes


def budget(classes, fraction):
    K = len(classes[0][0].weights)
    lo = [sum(min(it.weights[r] for it in c) for c in classes) for r in range(K)]
    hi = [sum(max(it.weights[r] for it in c) for c in classes) for r in range(K)]
    return tuple(a + fraction * (b - a) for a, b in zip(lo, hi))


@pytest.mark.parametrize("fraction", [0.15, 0.5])
def test_300_classes_12_items_fast(fraction):
    classes = recipe_like(300, 12, seed=1)
    capacity = budget(classes, fraction)
    start = time.monotonic()
    sol = solve(classes, capacity, time_limit=60)
    elapsed = time.monotonic() - start
    check_solution(classes, capacity, sol)
    assert sol.optimal and sol.bound == sol.cost
    assert elapsed < 10, f"{elapsed:.1f} s"
    # the Lagrangian choice rounded down to fit is feasible and no better (the solver did some work)
    assert sol.cost <= greedy_cost(classes, capacity[0]) + 1e-12


def test_300_classes_two_devices_fast():
    """CPU and GPU byte budgets: groups on one device each, so two independent problems."""
    classes = recipe_like(300, 12, seed=2, devices=2)
    capacity = budget(classes, 0.3)
    start = time.monotonic()
    sol = solve(classes, capacity, time_limit=60)
    check_solution(classes, capacity, sol)
    assert sol.optimal and time.monotonic() - start < 10


def test_coupled_speed_budget_keeps_its_time_limit():
    """A speed budget couples the devices (seconds per token = bytes / bandwidth summed over both):
    out of time, the best found within about the limit, with a bound below it."""
    classes = recipe_like(100, 12, seed=1, devices=2, speed=True)
    capacity = budget(classes, 0.3)[:2] + budget(classes, 0.2)[2:]
    start = time.monotonic()
    sol = solve(classes, capacity, time_limit=1.0)
    assert time.monotonic() - start < 5
    check_solution(classes, capacity, sol)
    assert sol.bound <= sol.cost and sol.gap < 0.01


def greedy_cost(classes, cap):
    """A simple feasible answer: start from the lightest item of each class and take the best
    cost-per-byte upgrades of each class's hull while they fit."""
    choice = [min(range(len(c)), key=lambda j: (c[j].weights[0], c[j].cost)) for c in classes]
    used = sum(c[j].weights[0] for c, j in zip(classes, choice))
    moves = []
    for i, c in enumerate(classes):
        h = lower_hull(c)
        for a, b in zip(h, h[1:]):
            moves.append(((c[b].cost - c[a].cost) / (c[b].weights[0] - c[a].weights[0]), i, a, b))
    for _, i, a, b in sorted(moves):
        dw = classes[i][b].weights[0] - classes[i][a].weights[0]
        if choice[i] == a and used + dw <= cap:
            choice[i], used = b, used + dw
    return sum(c[j].cost for c, j in zip(classes, choice))


def capacity_dp(classes, capacity) -> float:
    """The least cost by dynamic programming over every integer usage (small integer weights, one or
    two resources): an independent exact reference for instances too large to enumerate."""
    shape = tuple(int(c) + 1 for c in capacity)
    best = np.full(shape, np.inf)
    best[(0,) * len(shape)] = 0.0
    for cls in classes:
        new = np.full(shape, np.inf)
        for it in cls:
            w = [int(x) for x in it.weights]
            if any(x >= n for x, n in zip(w, shape)):
                continue
            dst = tuple(slice(x, n) for x, n in zip(w, shape))
            src = tuple(slice(0, n - x) for x, n in zip(w, shape))
            new[dst] = np.minimum(new[dst], best[src] + it.cost)
        best = new
    return float(best.min())


def integer_instance(rng, n, m, K):
    """Costs falling with the weights, with noise (non-convex frontiers), some random items."""
    classes = []
    for _ in range(n):
        sens = rng.lognormal(0, 1)
        items = []
        for _ in range(m):
            w = rng.integers(0, 12, K)
            cost = sens * 2.0 ** (-0.4 * w.sum() / K) * (1 + 0.1 * rng.standard_normal()) if rng.random() < 0.8 \
                else rng.uniform(0, 2)
            items.append(Item(float(cost), tuple(int(x) for x in w)))
        classes.append(items)
    return classes


@pytest.mark.parametrize("K,n", [(1, 80), (2, 24)])
def test_search_paths_match_capacity_dp(monkeypatch, K, n):
    """Instances past brute force, with the state limit and the core made small so that the
    depth-first chunks and the core heuristic run: the same optimum as the capacity DP."""
    import quantkit.solve as solve_module
    monkeypatch.setattr(solve_module, "MAX_STATES_ONE", 40)
    monkeypatch.setattr(solve_module, "MAX_STATES_MANY", 40)
    monkeypatch.setattr(solve_module, "CORE_SIZE", 6)
    monkeypatch.setattr(solve_module, "BEAM_WIDTH", 2)
    rng = np.random.default_rng(K)
    for trial in range(6):
        classes = integer_instance(rng, n, 6, K)
        capacity = tuple(float(int(x)) for x in budget(classes, [0.15, 0.3, 0.6][trial % 3]))
        optimum = capacity_dp(classes, capacity)
        if optimum == np.inf:
            with pytest.raises(InfeasibleBudget, match="at once"):
                solve(classes, capacity)
            continue
        sol = solve(classes, capacity)
        check_solution(classes, capacity, sol)
        assert sol.optimal and sol.cost == pytest.approx(optimum, rel=1e-9)


def test_infeasible_budget_names_the_smallest_usage():
    classes = [[Item(1.0, (10, 0)), Item(0.5, (20, 0))], [Item(1.0, (5, 3)), Item(0.1, (9, 9))]]
    with pytest.raises(InfeasibleBudget) as err:
        solve(classes, (14, INF), names=("cpu bytes", "gpu bytes"))
    msg = str(err.value)
    assert "\n" not in msg and "cpu bytes 15 (budget 14)" in msg and "gpu" not in msg
    assert err.value.smallest == (15, 3) and isinstance(err.value, QuantkitError)


def test_jointly_infeasible():
    """Each budget alone can be met, never both at once."""
    classes = [[Item(0, (5, 0)), Item(0, (0, 5))], [Item(0, (5, 0)), Item(0, (0, 5))]]
    with pytest.raises(InfeasibleBudget, match="at once"):
        solve(classes, (4, 4))
    classes = [[Item(0, (5, 0)), Item(0, (0, 5))], [Item(0, (1, 1))]]
    with pytest.raises(InfeasibleBudget, match="at once"):
        solve(classes, (5, 5))
    assert solve(classes, (6, 5)).choice == [0, 0]


def test_edge_cases():
    sol = solve([], (10,))
    assert (sol.choice, sol.cost, sol.usage, sol.optimal, sol.bound) == ([], 0.0, (0.0,), True, 0.0)
    # unconstrained: the cheapest of each class (first of equals)
    classes = [[Item(3, (1,)), Item(1, (100,)), Item(1, (50,))], [Item(2, (0,))]]
    sol = solve(classes, (INF,))
    assert sol.choice == [1, 0] and sol.optimal and sol.cost == 3
    # a budget that every choice fits is no constraint either (of equal costs, the lighter)
    assert solve(classes, (1000,)).choice == [2, 0]
    # zero budget: only weightless items
    sol = solve([[Item(5, (0,)), Item(1, (1,))], [Item(2, (0,))]], (0,))
    assert sol.choice == [0, 0] and sol.cost == 7
    # identical items: any, the cost is what counts
    sol = solve([[Item(1, (2, 2))] * 4] * 5, (10, 10))
    assert sol.cost == 5 and sol.usage == (10, 10)
    # the budget met exactly
    sol = solve([[Item(1, (3,)), Item(0, (4,))], [Item(1, (3,)), Item(0, (4,))]], (7,))
    assert sol.cost == 1 and sol.usage == (7,)


def test_malformed_input_is_a_value_error():
    with pytest.raises(ValueError, match="no items"):
        solve([[]], (1,))
    with pytest.raises(ValueError, match="one per resource"):
        solve([[Item(1, (1, 2))]], (1,))
    with pytest.raises(ValueError, match="finite"):
        solve([[Item(float("nan"), (1,))]], (1,))
    with pytest.raises(ValueError, match="finite"):
        solve([[Item(1, (-1,))]], (1,))
    with pytest.raises(ValueError, match="NaN"):
        solve([[Item(1, (1,))]], (float("nan"),))
    # a negative capacity (a budget less than what the kept tensors take) is an infeasible budget
    with pytest.raises(InfeasibleBudget, match=r"resource 0 0 \(budget -5\)"):
        solve([[Item(1, (0,))]], (-5,))


def test_lower_hull():
    items = [Item(9, (1,)), Item(6, (2,)), Item(5, (3,)), Item(1, (4,)), Item(1, (5,)), Item(12, (0.5,)),
             Item(7, (2,))]
    # (3, 5) lies above the segment (2, 6)-(4, 1); (5, 1) is heavier for the same cost; (2, 7) costlier
    assert lower_hull(items) == [5, 0, 1, 3]
    assert lower_hull([]) == []


def test_time_limit_returns_best_found_with_a_true_bound():
    """Out of time: a fitting choice, not claimed optimal, with a bound below the true optimum."""
    rng = np.random.default_rng(11)
    classes = integer_instance(rng, 40, 8, 2)
    capacity = tuple(float(int(x)) for x in budget(classes, 0.3))
    optimum = capacity_dp(classes, capacity)
    sol = solve(classes, capacity, time_limit=0.0)
    check_solution(classes, capacity, sol)
    assert not sol.optimal and sol.bound <= optimum + 1e-9 <= sol.cost + 2e-9 and sol.gap > 0
    sol = solve(classes, capacity)
    assert sol.optimal and sol.cost == pytest.approx(optimum)
