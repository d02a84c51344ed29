"""matchmaking/rules.py: the leader/follower decisions, tested without a swarm."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swarmgrad.averaging.matchmaking.key_manager import Declaration
from swarmgrad.averaging.matchmaking.protocol import MAX_HOLD, Begin, JoinRequest, Rejection
from swarmgrad.averaging.matchmaking.rules import LeaderView, MatchmakingRules
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import ProtocolViolation, ValidationError

PEERS = sorted(Identity.from_seed(bytes([i + 1]) * 32).peer_id for i in range(6))
ME = PEERS[2]


def rules(**kwargs) -> MatchmakingRules:
    kwargs.setdefault("target_group_size", 4)
    return MatchmakingRules(ME, **kwargs)


def request(ready_by=20.0, **kwargs) -> JoinRequest:
    fields = dict(prefix="avg", group_key="k", ready_by=ready_by, client_mode=False, gather=b"")
    return JoinRequest(**{**fields, **kwargs})


VIEW = LeaderView("k", ready_by=10.0, followers=frozenset())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"target_group_size": 1}, "target_group_size"),
        ({"target_group_size": True}, "target_group_size"),
        ({"min_group_size": 5}, "min_group_size"),
        ({"min_group_size": 0}, "min_group_size"),
        ({"max_gather_bytes": 0}, "max_gather_bytes"),
        ({"min_matchmaking_time": 0}, "min_matchmaking_time"),
        ({"request_timeout": float("nan")}, "request_timeout"),
        ({"request_timeout": None}, "request_timeout"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        rules(**kwargs)


def test_a_group_is_full_at_the_expected_size_within_the_target():
    r = rules(target_group_size=8)
    assert r.full_at(None) == 8
    assert r.full_at(3) == 3
    assert r.full_at(100) == 8
    for bad in (1, 2.5, True, "3"):
        with pytest.raises(ValidationError, match="expected_size"):
            r.full_at(bad)


def test_a_leader_begins_when_full_or_at_its_ready_by_and_a_client_never():
    r = rules()
    assert not r.time_to_begin(members=2, full_at=4, ready_by=10.0, now=9.0)
    assert r.time_to_begin(members=4, full_at=4, ready_by=10.0, now=9.0)
    assert r.time_to_begin(members=1, full_at=4, ready_by=10.0, now=10.0 - 1e-9)
    assert not rules(client_mode=True).time_to_begin(members=4, full_at=4, ready_by=1, now=9)
    assert not r.enough_to_begin(1) and r.enough_to_begin(2)
    assert rules(min_group_size=1).enough_to_begin(1)


def test_a_declaration_is_used_once_unless_it_is_past():
    r = rules(min_matchmaking_time=5.0)
    assert r.next_ready_by(now=100.0, remaining=30.0, scheduled_time=110.0) == (110.0, True)
    assert r.next_ready_by(now=100.0, remaining=3.0, scheduled_time=110.0) == (103.0, True)
    assert r.next_ready_by(now=100.0, remaining=30.0, scheduled_time=90.0) == (105.0, False)
    assert r.next_ready_by(now=100.0, remaining=2.0, scheduled_time=None) == (102.0, False)


def test_followers_come_after_their_leader_and_clients_follow_anyone():
    r = rules()
    before, after = Declaration(5.0, PEERS[0]), Declaration(15.0, PEERS[0])
    tie_low, tie_high = Declaration(10.0, PEERS[0]), Declaration(10.0, PEERS[4])
    assert r.may_follow(before, my_ready_by=10.0, now=1.0)
    assert not r.may_follow(after, my_ready_by=10.0, now=1.0)
    assert r.may_follow(tie_low, my_ready_by=10.0, now=1.0)  # peer id breaks the tie
    assert not r.may_follow(tie_high, my_ready_by=10.0, now=1.0)
    assert not r.may_follow(before, my_ready_by=10.0, now=5.0)  # its time has passed
    assert not r.may_follow(before, my_ready_by=10.0, now=1.0, banned=True)
    assert not r.may_follow(Declaration(5.0, PEERS[0], client_mode=True), my_ready_by=10, now=1)
    assert not r.may_follow(Declaration(5.0, ME), my_ready_by=10.0, now=1.0)
    assert rules(client_mode=True).may_follow(after, my_ready_by=10.0, now=1.0)


@given(
    st.lists(st.tuples(st.integers(0, 20), st.sampled_from(PEERS)), min_size=2, max_size=6),
)
def test_join_requests_point_down_one_order_so_no_two_peers_wait_for_each_other(entries):
    """Whatever the declarations: if a may follow b, b never may follow a."""
    decls = [Declaration(float(t), p) for t, p in set(entries)]
    for a in decls:
        for b in decls:
            if a.peer_id == b.peer_id:
                continue
            a_follows = MatchmakingRules(a.peer_id, 4).may_follow(b, my_ready_by=a.ready_by, now=-1)
            b_follows = MatchmakingRules(b.peer_id, 4).may_follow(a, my_ready_by=b.ready_by, now=-1)
            assert not (a_follows and b_follows)


def test_a_leader_accepts_a_later_follower_under_its_key():
    assert rules().judge_join(request(), PEERS[0], VIEW, now=5.0) is None
    # a client-mode follower may come earlier in the order
    assert rules().judge_join(request(1.0, client_mode=True), PEERS[0], VIEW, now=5.0) is None


@pytest.mark.parametrize(
    "case, reason, text",
    [
        ("too much data", Rejection.BAD_REQUEST, "exceeds 10"),
        ("banned", Rejection.BANNED, "banned"),
        ("not looking", Rejection.NOT_LOOKING, "not looking"),
        ("client leader", Rejection.NOT_A_LEADER, "never leads"),
        ("follows", Rejection.NOT_A_LEADER, "follows"),
        ("other key", Rejection.BAD_GROUP_KEY, "not 'other'"),
        ("duplicate", Rejection.DUPLICATE_PEER_ID, "already in this group"),
        ("earlier", Rejection.BAD_ORDER, "not after ours"),
        ("full", Rejection.GROUP_FULL, "full"),
        ("late", Rejection.TOO_LATE, "about to begin"),
    ],
)
def test_a_leader_refuses_a_join_naming_why(case, reason, text):
    r, req, view, now, banned = rules(max_gather_bytes=10), request(), VIEW, 5.0, False
    if case == "too much data":
        req = request(gather=b"x" * 11)
    elif case == "banned":
        banned = True
    elif case == "not looking":
        view = None
    elif case == "client leader":
        r = rules(client_mode=True)
    elif case == "follows":
        view = LeaderView("k", 10.0, frozenset(), PEERS[5], ("/ip4/1.2.3.4/tcp/5",))
    elif case == "other key":
        req = request(group_key="other")
    elif case == "duplicate":
        view = LeaderView("k", 10.0, frozenset({PEERS[0]}))
    elif case == "earlier":
        req = request(ready_by=9.0)
    elif case == "full":
        view = LeaderView("k", 10.0, frozenset(PEERS[3:6]))
    elif case == "late":
        now = 10.0
    rejection = r.judge_join(req, PEERS[0], view, now=now, banned=banned)
    assert rejection is not None and rejection.reason == reason and text in rejection.message
    if case == "follows":  # the follower is sent on to our leader, with its addresses
        assert rejection.suggested_leader == PEERS[5]
        assert rejection.suggested_maddrs == ("/ip4/1.2.3.4/tcp/5",)


def test_holds_are_granted_only_before_the_search_and_bounded():
    r = rules(target_group_size=2)
    held = request(hold=5.0)
    assert r.hold(held, looking=False, closed=False, held=0) == 5.0
    assert r.hold(request(hold=1e6), looking=False, closed=False, held=0) == MAX_HOLD
    assert r.hold(held, looking=True, closed=False, held=0) == 0
    assert r.hold(held, looking=False, closed=True, held=0) == 0
    assert r.hold(held, looking=False, closed=False, held=2) == 0  # two already wait
    assert r.hold(request(), looking=False, closed=False, held=0) == 0


def test_a_hinted_leader_holds_us_until_we_would_have_begun_ourselves():
    r = rules(request_timeout=2.0)
    assert r.hint_hold(left=30.0, begin_in=5.0) == 7.0
    assert r.hint_hold(left=4.0, begin_in=5.0) == 2.0  # a request_timeout left for the DHT
    assert r.hint_hold(left=1.0, begin_in=5.0) == 0.0


def test_a_begin_message_must_hold_us_the_leader_and_our_data_unchanged():
    r = rules()
    good = Begin(b"g" * 20, (PEERS[0], ME), (b"lead", b"mine"))
    info = r.check_group(good, PEERS[0], b"mine")
    assert info.peer_ids == (PEERS[0], ME) and info.gathered == (b"lead", b"mine")
    bad = {
        "lacks us": (Begin(b"g", (PEERS[0], PEERS[1]), (b"", b"")), b"mine"),
        "lacks the leader itself": (Begin(b"g", (ME, PEERS[1]), (b"mine", b"")), b"mine"),
        "altered our gathered data": (good, b"other"),
        "lists a member twice": (Begin(b"g", (PEERS[0], ME, ME), (b"", b"mine", b"m")), b"mine"),
    }
    for match, (begin, mine) in bad.items():
        with pytest.raises(ProtocolViolation, match=match):
            r.check_group(begin, PEERS[0], mine)
