"""The routing simulator's default scenario: bounded-load hashing keeps most of consistent
hashing's locality with a bounded imbalance, where random routing keeps one node's hit ratio."""

from __future__ import annotations

import pytest

from benchmarks.routing_sim import Scenario, main, simulate

DEFAULT = Scenario(nodes=8, cache=100, adapters=1000, zipf_s=1.0)


def test_bounded_load_hashing_reaches_the_target_at_8_nodes_of_100() -> None:
    bounded = simulate(DEFAULT, "bounded")
    random = simulate(DEFAULT, "random")
    chash = simulate(DEFAULT, "chash")

    assert bounded.hit_ratio >= 0.85
    assert bounded.imbalance <= 1.3
    assert random.hit_ratio <= 0.62  # no better than one node's LRU of 100
    assert bounded.gets * 3 <= random.gets
    assert chash.hit_ratio > bounded.hit_ratio and chash.imbalance > 1.3  # why the bound


def test_a_seed_gives_the_same_figures_and_another_seed_others() -> None:
    small = Scenario(nodes=4, cache=40, adapters=200, requests=8000)

    assert simulate(small, "sticky") == simulate(small, "sticky")
    assert simulate(small, "sticky") != simulate(Scenario(nodes=4, cache=40, adapters=200,
                                                          requests=8000, seed=2), "sticky")


def test_the_command_prints_a_row_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--nodes", "4", "--cache", "40", "--adapters", "200", "--requests", "4000"])

    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    rows = [line for line in lines if line.startswith("|  4 |")]
    assert [row.split("|")[3].strip() for row in rows] == ["random", "least", "chash",
                                                           "bounded", "sticky", "affinity"]
