"""Unit tests of models/moe.py: routing, message layout, buffer slots, signals, expected
memory contents, KV plan, option validation (pure Python)."""
import pytest

from models.fabric import LeafSpine
from models.moe import (DEFAULT_REGIONS, DEFAULTS, HEADER_BYTES, SIGNAL_BYTES, KvPlan, MoePlan,
                        combine_bytes, dispatch_bytes, dispatch_header, link_names,
                        parse_dispatch_header, scenario_config, signal_bytes, signalled_count)


def overlaps(ranges):
    ranges = sorted(ranges)
    return any(a_end > b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))


def test_message_sizes():
    assert dispatch_bytes(7168) == 7408 == 16 + 7168 + 56 * 4
    assert combine_bytes(7168) == 14336


def test_header_round_trip():
    header = dispatch_header(300, 5, (17, 3, 200))
    assert len(header) == HEADER_BYTES
    assert parse_dispatch_header(header) == (300, 5, (17, 3, 200))
    assert header[8 + 3:] == b"\xff" * 5


@pytest.mark.parametrize("ranks,tokens,topk,epr", [(8, 4, 2, 2), (8, 8, 8, 4), (4, 3, 1, 1),
                                                   (16, 2, 4, 16)])
def test_routing(ranks, tokens, topk, epr):
    plan = MoePlan(ranks, tokens, topk, epr, seed=3)
    for (rank, token), experts in plan.routing.items():
        assert len(set(experts)) == topk and all(0 <= e < ranks * epr for e in experts)
        assert plan.destinations[(rank, token)] == tuple(sorted({e // epr for e in experts}))
    assert MoePlan(ranks, tokens, topk, epr, seed=3).routing == plan.routing
    assert MoePlan(ranks, tokens, topk, epr, seed=4).routing != plan.routing or topk == ranks * epr


def test_one_message_per_token_and_destination():
    plan = MoePlan(8, 16, 4, 1, seed=2)
    for rank in range(8):
        writes = plan.dispatch_writes(rank)
        assert set(writes) == set(range(8)) - {rank}
        sent = sorted((w.dst, w.token) for ws in writes.values() for w in ws)
        local = plan.local_dispatch(rank)
        want = sorted((d, t) for t in range(16) for d in plan.destinations[(rank, t)])
        assert sent == [x for x in want if x[0] != rank]
        assert len(local) == sum(1 for d, _ in want if d == rank)
        for d, ws in writes.items():
            assert len(ws) == plan.count(rank, d)
            assert [w.token for w in ws] == sorted(w.token for w in ws)
            for w in ws:
                assert w.nbytes == 7408 and w.raddr == plan.dispatch_slot(rank, w.token)
                assert w.payload == plan.dispatch_payload(rank, w.token)
                token, source, experts = parse_dispatch_header(w.payload[:HEADER_BYTES])
                assert (token, source, experts) == (w.token, rank, plan.routing[(rank, w.token)])


def test_combine_returns_every_received_token():
    plan = MoePlan(8, 6, 3, 2, seed=5)
    returned = {}
    for d in range(8):
        received = plan.received(d)
        writes = plan.combine_writes(d)
        assert sorted((w.dst, w.token) for ws in writes.values() for w in ws) == \
            sorted((s, t) for s, t in received if s != d)
        for ws in writes.values():
            for w in ws:
                assert w.nbytes == 14336
                slot = plan.slot_of(w.dst, w.token, d)
                assert w.raddr == plan.combine_slot(w.token, slot)
                returned[(w.dst, w.token, slot)] = w.payload
        for address, payload in plan.local_combine(d):
            returned[("local", d, address)] = payload
    # every (token, slot) of every source filled exactly once
    total = sum(len(plan.destinations[(s, t)]) for s in range(8) for t in range(6))
    assert len(returned) == total


def test_signals_as_deepep_to_every_rank():
    """Dispatch adds -count - 1 (DeepEP's expert count), combine adds 1 (its flag); the
    receiver decodes the count from the 4-byte word the add leaves in a zeroed word."""
    plan = MoePlan(8, 5, 2, 2, seed=1)
    for rank in range(8):
        for phase in ("dispatch", "combine"):
            signals = plan.signals(rank, phase)
            assert [s.dst for s in signals] == list(range(8))
            for s in signals:
                assert s.address == plan.signal_word(phase, rank)
                word = signal_bytes(s.add)
                assert len(word) == SIGNAL_BYTES and any(word)
                if phase == "dispatch":
                    assert signalled_count(word) == plan.count(rank, s.dst)
                else:
                    assert s.add == 1
    # somebody gets zero tokens from somebody: still signalled, with -1
    assert any(s.add == -1 for r in range(8) for s in plan.signals(r, "dispatch"))
    assert signal_bytes(-1) == b"\xff" * 4 and signalled_count(bytes(4)) is None
    assert signalled_count(signal_bytes(-7)) == 6 and signalled_count(signal_bytes(-1)) == 0


def test_layout_disjoint_and_inside_regions():
    plan = MoePlan(8, 4, 8, 4, seed=7)
    receive = [(plan.dispatch_slot(s, t), plan.dispatch_slot(s, t) + plan.dispatch_bytes)
               for s in range(8) for t in range(4)]
    receive += [(plan.combine_slot(t, k), plan.combine_slot(t, k) + plan.combine_bytes)
                for t in range(4) for k in range(plan.slots)]
    receive += [(plan.signal_word(p, s), plan.signal_word(p, s) + SIGNAL_BYTES)
                for p in ("dispatch", "combine") for s in range(8)]
    send = [(plan.dispatch_send(t), plan.dispatch_send(t) + plan.dispatch_bytes) for t in range(4)]
    send += [(plan.combine_send(s, t), plan.combine_send(s, t) + plan.combine_bytes)
             for s in range(8) for t in range(4)]
    for ranges, region in ((receive, "receive"), (send, "send")):
        assert not overlaps(ranges)
        base, size = DEFAULT_REGIONS[region]
        assert all(base <= lo and hi <= base + size and lo % min(hi - lo, 64) == 0
                   for lo, hi in ranges)


def test_expected_covers_every_arrival():
    plan = MoePlan(4, 3, 2, 1, seed=9)
    for rank in range(4):
        expected = plan.expected(rank)
        addresses = [a for a, _, _ in expected]
        assert len(addresses) == len(set(addresses))
        arrivals = {w.raddr: w.payload for src in range(4) if src != rank
                    for ws in plan.dispatch_writes(src).values() for w in ws if w.dst == rank}
        arrivals.update({w.raddr: w.payload for src in range(4) if src != rank
                         for ws in plan.combine_writes(src).values() for w in ws if w.dst == rank})
        arrivals.update(dict(plan.local_dispatch(rank)))
        arrivals.update({a: p for d in range(4) for a, p in plan.local_combine(d) if d == rank})
        for address, payload, _ in expected:
            if address in arrivals:
                assert arrivals.pop(address) == payload
        assert not arrivals


@pytest.mark.parametrize("kwargs,option", [
    (dict(topk=9), "topk"), (dict(topk=0), "topk"),
    (dict(ranks=2, experts_per_rank=1, topk=3), "topk 3 exceeds"),
    (dict(ranks=64, experts_per_rank=8), "experts"),
    (dict(hidden=100), "hidden"), (dict(tokens=0), "tokens"),
    (dict(tokens=64), "tokens 64"), (dict(ranks=1), "ranks"), (dict(seed=-1), "seed"),
])
def test_bad_moe_options(kwargs, option):
    with pytest.raises(ValueError, match=option):
        MoePlan(**kwargs)


def test_kv_plan():
    plan = KvPlan(8, 1, 6, 3, 5000, 1000, 2, seed=4)
    kv = plan.kv_writes()
    assert [w.nbytes for w in kv] == [5000] * 3 and {(w.src, w.dst) for w in kv} == {(1, 6)}
    assert plan.background_ranks == [0, 2, 3, 4, 5, 7]
    assert plan.background_writes(1) == {} and plan.background_writes(6) == {}
    bg = plan.background_writes(0)
    assert set(bg) == {2, 3, 4, 5, 7} and all(len(ws) == 2 for ws in bg.values())
    for rank in range(8):
        expected = plan.expected(rank)
        ranges = [(a, a + len(p)) for a, p, _ in expected]
        assert not overlaps(ranges)
        assert len(expected) == (4 if rank == 6 else 0 if rank == 1 else 10)
    staged = [a for a, _ in plan.staging(0)]
    assert len(staged) == len(set(staged)) == 10


@pytest.mark.parametrize("kwargs,option", [
    (dict(kv_src=3, kv_dst=3), "differ"), (dict(kv_dst=8), "kv_dst"),
    (dict(kv_blocks=64, kv_block_bytes=65536), "kv_blocks"), (dict(kv_blocks=0), "kv_blocks"),
    (dict(background_bytes=0), "background_bytes"),
    (dict(background_messages=100, background_bytes=65536), "background_messages"),
])
def test_bad_kv_options(kwargs, option):
    with pytest.raises(ValueError, match=option):
        KvPlan(**kwargs)


def test_scenario_config():
    config = scenario_config({}, max_ranks=8)
    assert {k: config[k] for k in DEFAULTS} == DEFAULTS
    assert (config["leaves"], config["nics_per_leaf"], config["spines"]) == (4, 2, 2)
    assert config["dispatch_bytes"] == 7408 and config["combine_bytes"] == 14336
    assert scenario_config({"ranks": 4, "scenario": "kv", "kv_dst": 3}, max_ranks=8)["leaves"] == 2
    small = scenario_config({"ranks": 6, "spines": 1}, max_ranks=8)
    assert (small["leaves"], small["nics_per_leaf"], small["spines"]) == (3, 2, 1)
    for bad, option in (({"ranks": 6, "tokens": 0}, "tokens"), ({"ranks": 5}, "even"),
                        ({"ranks": 16}, "ranks"), ({"scenario": "x"}, "scenario"),
                        ({"tokns": 3}, "tokns"), ({"pcap_link": "leaf9.p0"}, "pcap_link"),
                        ({"memory_latency": 0}, "memory_latency"),
                        ({"wire_delay": 0}, "wire_delay"), ({"topk": 20}, "topk"),
                        ({"spines": 0}, "spines"), ({"spines": 15}, "spines"),
                        ({"spines": 1.5}, "spines"), ({"ranks": 4, "pcap_link": "leaf0.p3",
                                                       "spines": 1}, "pcap_link"),
                        ({"ack_timeout": 32}, "ack_timeout"), ({"cut_at": -1}, "cut_at"),
                        ({"cut_link": "leaf9.p0", "ack_timeout": 3}, "^cut_link 'leaf9"),
                        ({"cut_link": "leaf0.p2"}, "needs an ack_timeout")):
        with pytest.raises(ValueError, match=option):
            scenario_config(bad, max_ranks=8)


def test_link_names():
    fabric = LeafSpine(2, 4, 2)
    names = link_names(fabric)
    assert len(names) == 16 and "nic0.p0" in names and "leaf0.p2" in names
    assert names["leaf0.p2"].b == ("spine0", 0)
    assert link_names(fabric, "nic3-leaf1") == {"nic3.p0": names["nic3.p0"]}
