"""IdleEpisodes: the idle deadline is the hang rule on the longest an agent took to send an episode's next
request; held episodes past it expire (none with a request in progress) and are remembered as expired."""

from __future__ import annotations

import math

from rlplatform.actors.idle_episodes import IdleEpisodes
from rlplatform.monitoring.watchdog import HangRule


def test_episodes_idle_past_the_rule_on_the_longest_wait_expire_once_and_are_remembered():
    now = [0.0]
    idle = IdleEpisodes(HangRule(factor=10, floor_s=2), clock=lambda: now[0])
    assert idle.deadline_s() == 20.0  # nothing measured: the factor times the floor
    idle.answered("a", "10.0.0.1")
    now[0] = 0.5
    idle.requested("a")  # the agent came back after 0.5 s: 10 x 0.5 = 5 s
    assert idle.longest_wait_s == 0.5 and idle.deadline_s() == 5.0
    idle.answered("a", "10.0.0.1")
    idle.answered("b", "10.0.0.2")
    now[0] = 3.0
    idle.answered("c", "10.0.0.3")
    idle.ended("b")  # finished: no longer held
    now[0] = 6.0
    [gone] = idle.expire(busy=set())  # a, idle 5.5 s; c 3 s
    assert (gone.episode, gone.client, gone.idle_s, gone.deadline_s) == ("a", "10.0.0.1", 5.5, 5.0)
    assert idle.has_expired("a") and not idle.has_expired("c")
    assert idle.expire(busy=set()) == []  # once
    now[0] = 8.5
    assert [gone.episode for gone in idle.expire(busy=set())] == ["c"]
    idle.requested("a")  # a late request of an expired episode measures no wait
    assert idle.longest_wait_s == 0.5


def test_a_busy_episode_does_not_expire_and_without_a_rule_none_does():
    now = [0.0]
    idle = IdleEpisodes(HangRule(factor=2, floor_s=1), clock=lambda: now[0])
    idle.answered("a", "")
    now[0] = 10.0
    assert idle.expire(busy={"a"}) == []
    assert [gone.episode for gone in idle.expire(busy=set())] == ["a"]
    never = IdleEpisodes(None, clock=lambda: now[0])
    never.answered("a", "")
    now[0] = 1e9
    assert never.deadline_s() == math.inf and never.expire(busy=set()) == []
