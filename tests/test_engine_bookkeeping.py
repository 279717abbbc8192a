"""Engine bookkeeping (host side): block manager, sequences and scheduler, with property tests."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acache_jax.decoding.layout import Request, RequestError, Row, make_batch
from acache_jax.engine.block_manager import BlockManager, PoolFullError
from acache_jax.engine.scheduler import RequestTooLargeError, Scheduler
from acache_jax.engine.sequence import SequenceState, SequenceStatus
from acache_jax.network.config import ModelConfig, anchor_count

MASK = 999
AFFIX_LENS = {"a": 5, "b": 12, "c": 30}  # affix key -> affix length
BL = 4  # block_length in the property tests


def _seq(rid, left=3, gen=8, right=0, affix=None, position="prefix", policy="acache", tail=2):
    """A sequence with `left` prompt tokens and an affix `affix` (key of AFFIX_LENS) at `position`."""
    n = AFFIX_LENS[affix] if affix else 0
    if position == "prefix":
        lt, rt, start = n + left, right, 0
    elif position == "infix":
        lt, rt, start = left + n + tail, right, left
    else:  # suffix: the affix is the right part
        lt, rt, start = left, n, left + gen
    tokens = (np.arange(lt + gen + rt) % 50).astype(np.int32)
    tokens[lt:lt + gen] = MASK
    return SequenceState(rid, Row(tokens, lt, gen, start if n else 0, n), BL, affix_key=affix, policy=policy)


def _decode_private(seq: SequenceState, anchors: np.ndarray) -> np.ndarray:
    """decode.py's private columns for one unpadded row: argsort(shared, stable)[: T - L + K]."""
    t, a0, n = seq.num_columns, seq.row.affix_start, seq.affix_len
    shared = np.zeros(t, bool)
    shared[a0:a0 + n] = True
    shared[a0 + anchors] = False
    return np.argsort(shared, kind="stable")[: t - n + len(anchors)]


# ---- block manager ----

def test_slots_are_block_rows_in_block_order():
    np.testing.assert_array_equal(BlockManager.slots([3, 1], 6, 4), [12, 13, 14, 15, 4, 5])
    assert BlockManager.slots([3, 1], 6, 4).dtype == np.int32
    with pytest.raises(ValueError, match="9 slots asked of 2 blocks"):
        BlockManager.slots([3, 1], 9, 4)


def test_allocate_free_and_bad_frees():
    bm = BlockManager(4, 8)
    assert bm.blocks_for(17) == 3 and bm.blocks_for(16) == 2 and bm.blocks_for(0) == 0
    blocks = bm.allocate(17)
    assert len(blocks) == 3 and bm.num_free_blocks == 1 and not bm.can_allocate(2)
    with pytest.raises(PoolFullError, match="2 blocks needed for 9 slots, 1 of 4 free"):
        bm.allocate(9)
    shared, new = bm.acquire_shared("a", 3)
    with pytest.raises(ValueError, match="belong to a shared affix"):
        bm.free(shared)
    with pytest.raises(ValueError, match="listed twice"):
        bm.free([blocks[0], blocks[0]])
    bm.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        bm.free(blocks[:1])
    assert bm.num_free_blocks == 3  # the bad frees changed nothing


def test_shared_blocks_are_refcounted():
    bm = BlockManager(8, 4)
    first, new1 = bm.acquire_shared("a", 10)
    second, new2 = bm.acquire_shared("a", 10)
    assert (new1, new2) == (True, False) and first == second and len(first) == 3
    assert bm.resident("a") == (first, 2) and bm.num_free_blocks == 5
    with pytest.raises(ValueError, match="resident with 10 slots, asked for 11"):
        bm.acquire_shared("a", 11)
    bm.release_shared("a")
    assert bm.resident("a") == (first, 1) and bm.num_free_blocks == 5
    bm.release_shared("a")
    assert bm.resident("a") is None and bm.num_free_blocks == 8
    with pytest.raises(ValueError, match="no such resident affix"):
        bm.release_shared("a")


# ---- sequence ----

def test_slot_maps_of_a_prefix_request():
    """Own (non-affix) columns take the first private slots, before the probe; the anchors the rest."""
    seq = _seq(0, left=2, gen=4, affix="a")  # columns: affix 0-4, prompt 5-6, generation 7-10
    seq.num_anchors = 2
    seq.set_slots(np.arange(100, 108), np.arange(10, 15))
    np.testing.assert_array_equal(seq.read_slot_map, [10, 11, 12, 13, 14, 100, 101, 102, 103, 104, 105])
    seq.set_anchors(np.array([3, 1]))
    np.testing.assert_array_equal(seq.private_columns, [1, 3, 5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(seq.shared_columns, [0, 2, 4])
    np.testing.assert_array_equal(seq.read_slot_map, [10, 106, 12, 107, 14, 100, 101, 102, 103, 104, 105])


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from(["prefix", "infix", "suffix"]), st.sampled_from(list(AFFIX_LENS)),
       st.integers(1, 6), st.integers(1, 3), st.integers(0, 3))
def test_private_columns_match_the_static_path(data, position, affix, left, blocks, right):
    seq = _seq(0, left=left, gen=blocks * BL, right=0 if position == "suffix" else right, affix=affix,
               position=position)
    n = seq.affix_len
    anchors = np.array(data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)), np.int32)
    seq.num_anchors = len(anchors)
    assert seq.num_private(len(anchors)) == seq.num_columns - n + len(anchors)
    seq.set_anchors(anchors)
    np.testing.assert_array_equal(seq.private_columns, _decode_private(seq, anchors))
    expected = np.sort(np.concatenate([np.setdiff1d(np.arange(seq.num_columns), np.arange(n) + seq.row.affix_start),
                                       seq.row.affix_start + anchors]))
    np.testing.assert_array_equal(seq.private_columns, expected)
    base = _seq(1, left=left, gen=blocks * BL, affix=affix, position=position, policy="baseline")
    assert base.num_private(len(anchors)) == base.num_columns
    np.testing.assert_array_equal(base.private_columns, np.arange(base.num_columns))


@pytest.mark.parametrize("request_", [
    Request([5, 6, 7], affix_position="prefix"),
    Request([5, 6], tail=[8, 9, 10], affix_position="infix"),
    Request([5, 6, 7, 8], affix_position="suffix"),
    Request([5, 6, 7, 8, 9]),
])
def test_from_request_is_an_unpadded_make_batch_row(request_):
    affix = [40, 41, 42, 43, 44, 45]
    mcfg = ModelConfig(family="llada", vocab_size=1000, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=8, intermediate_size=8, rope_theta=1e4, rms_norm_eps=1e-5, max_seq_len=256,
                       qkv_bias=False, mask_token_id=MASK, eos_token_id=1, pad_token_id=0)
    batch = make_batch([request_], 8, mcfg, affix)
    valid = np.asarray(batch.valid[0])
    first = int(np.argmax(valid))
    seq = SequenceState.from_request("r", request_, affix, 8, 4, MASK)
    np.testing.assert_array_equal(seq.tokens, np.asarray(batch.tokens[0])[valid])
    assert seq.row.gen_start == batch.gen_start - first
    if request_.affix_position is None:
        assert seq.affix_key is None and seq.affix_len == 0
    else:
        assert seq.affix_key == tuple(affix) and seq.affix_len == batch.affix_len
        assert seq.row.affix_start == int(batch.affix_start[0]) - first


def test_bad_sequences_are_rejected_by_name():
    row = lambda n, gen, **kw: Row(np.asarray([1, 2] + [MASK] * gen, np.int32), 2, gen, **kw)
    with pytest.raises(RequestError, match="multiple of block_length"):
        SequenceState(0, row(2, 6), 4)
    with pytest.raises(RequestError, match="given together"):
        SequenceState(0, row(2, 4), 4, affix_key="a")
    with pytest.raises(RequestError, match="unknown policy"):
        SequenceState(0, row(2, 4), 4, policy="dual")
    with pytest.raises(RequestError, match="6 anchors for an affix of 5"):
        _seq(0, affix="a").num_private(6)


def test_blocks_advance_to_the_end():
    seq = _seq(0, left=3, gen=12)
    starts = [seq.block_start]
    while seq.advance_block():
        starts.append(seq.block_start)
    assert starts == [3, 7, 11] and seq.needs_recompute


# ---- scheduler ----

def test_queue_when_full_and_admit_when_freed():
    bm = BlockManager(num_blocks=10, block_size=4)
    sched = Scheduler(bm, max_batch=8)
    seqs = [_seq(i, left=3, gen=8, affix="b") for i in range(4)]  # private 11 + 1 anchor -> 3 blocks
    for s in seqs:
        sched.add(s, 1)
    admitted = sched.admit()  # affix 3 blocks + 2 x 3 private; the third would need 12
    assert admitted == seqs[:2] and sched.waiting == tuple(seqs[2:]) and bm.num_free_blocks == 1
    assert [s.affix_is_new for s in admitted] == [True, False] and all(s.needs_probe for s in admitted)
    assert sched.admit() == []  # nothing fits: it waits, no crash
    sched.finish(seqs[0])
    assert seqs[0].status is SequenceStatus.FINISHED and sched.admit() == [seqs[2]]
    for s in (seqs[1], seqs[2]):
        sched.finish(s)
    assert bm.resident("b")[1] == 3  # finished requests keep the affix until the next admission has looked
    sched.drain()
    assert bm.resident("b") is None  # the last user left; the next admission refills the affix
    assert sched.admit() == [seqs[3]] and seqs[3].affix_is_new
    sched.finish(seqs[3])
    sched.drain()
    assert sched.idle and bm.num_free_blocks == 10


def test_max_batch_bounds_the_running_set_and_the_plan_sorts_the_work():
    sched = Scheduler(BlockManager(100, 4), max_batch=3)
    base = [_seq(i, policy="baseline", affix="a") for i in range(2)]
    probed = _seq(2, affix="b")
    for s in base:
        sched.add(s, 5)
    sched.add(probed, 3)
    sched.add(_seq(3, affix="b"), 3)
    plan = sched.schedule(MASK)
    assert sched.running == (*base, probed) and not base[0].needs_probe and base[0].shares_affix is False
    assert plan.probe == [probed] and plan.recompute == base and plan.decode == [] and plan.fills == [probed]
    assert plan.loop == base and plan.segments == [probed, *base]
    base[0].needs_recompute = False
    probed.set_anchors(np.array([0, 5, 7]))
    plan = sched.schedule(MASK)
    assert plan.recompute == [base[1], probed] and plan.decode == [base[0]] and plan.fills == []


def test_a_step_token_bound_runs_the_longest_waiting_first_and_never_starves_one():
    """Scheduler(max_step_tokens=): mid-block rows, then the request waiting longest (always, even
    over the bound), then the others that fit, in the order they became ready: one passed over goes
    before one that became ready after it."""
    sched = Scheduler(BlockManager(100, 4), max_batch=4, max_step_tokens=24)
    seqs = [_seq(i, left=3 + 6 * (i == 1), policy="baseline") for i in range(3)]  # 11, 17, 11 tokens
    for s in seqs:
        sched.add(s, 0)
    plan = sched.schedule(MASK)
    assert plan.recompute == [seqs[0], seqs[2]] and plan.decode == []  # 11 + 17 > 24: the second waits
    seqs[2].needs_recompute = False
    seqs[0].ready_since = sched._iteration  # as postprocess marks a request at its next block start
    plan = sched.schedule(MASK)  # ready since: the second before the first
    assert plan.decode == [seqs[2]] and plan.recompute == [seqs[1]]  # 4 (a block) + 17 fit; + 11 does not
    seqs[1].needs_recompute = False
    plan = sched.schedule(MASK)
    assert plan.decode == seqs[1:] and plan.recompute == [seqs[0]]  # 8 + 11
    lone = Scheduler(BlockManager(100, 4), max_batch=2, max_step_tokens=5)
    lone.add(big := _seq(9, left=20, policy="baseline"), 0)
    assert lone.schedule(MASK).recompute == [big]  # 28 tokens: over the bound, but the longest waiting
    with pytest.raises(ValueError, match="max_step_tokens must be positive"):
        Scheduler(BlockManager(10, 4), max_batch=2, max_step_tokens=0)


def test_a_request_that_can_never_fit_is_rejected_clearly():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(bm, max_batch=4)
    big = _seq(0, left=3, gen=8, affix="b")  # 11 + 2 anchors = 13 slots -> 4 blocks; affix 12 -> 3 blocks
    with pytest.raises(RequestTooLargeError, match=r"needs 4 private \+ 3 affix blocks of 4 slots .*pool's 6 blocks"):
        sched.add(big, 2)
    # A resident affix does not help: it stays resident while the request runs.
    small = _seq(1, left=1, gen=4, affix="b")
    sched.add(small, 0)
    assert sched.admit() == [small]
    with pytest.raises(RequestTooLargeError):
        sched.add(_seq(2, left=3, gen=8, affix="b"), 2)
    assert isinstance(RequestTooLargeError("x"), RequestError) and sched.waiting == ()


# ---- properties over random arrivals and finishes ----

def _slot_set(blocks, bs):
    return set(BlockManager.slots(blocks, len(blocks) * bs, bs).tolist())


def _check_invariants(bm: BlockManager, sched: Scheduler) -> None:
    bs, running = bm.block_size, sched.running
    private_blocks = [b for s in running for b in s.private_blocks]
    assert len(private_blocks) == len(set(private_blocks)), "a block is private to two live sequences"
    users = Counter(s.affix_key for s in running if s.shares_affix)
    shared_slots: dict = {}
    for key in AFFIX_LENS:
        resident = bm.resident(key)
        assert (resident is None) == (users[key] == 0), "shared blocks kept without users"
        if users[key]:
            assert resident[1] == users[key], "refcount differs from the live users"
            shared_slots[key] = _slot_set(resident[0], bs)
    all_shared = [s for slots in shared_slots.values() for s in slots]
    assert len(all_shared) == len(set(all_shared)), "two affixes share a slot"
    held = len(private_blocks) + len(all_shared) // bs
    assert held + bm.num_free_blocks == bm.num_blocks, "a block leaked or is held by nobody"

    owner: dict[int, object] = {}
    for s in running:
        assert s.status is SequenceStatus.RUNNING
        own = s.read_slot_map[s.private_columns].tolist()
        assert len(own) == len(set(own)) and set(own) <= _slot_set(s.private_blocks, bs)
        for slot in own:
            assert owner.setdefault(slot, s.request_id) == s.request_id, "a slot is owned by two live sequences"
            assert slot not in all_shared, "a private slot lies in a live shared block"
        reach = set(own) | (shared_slots[s.affix_key] if s.shares_affix else set())
        assert set(s.read_slot_map.tolist()) <= reach, "a sequence reads slots it does not own or share"
    for s in sched.waiting:
        assert s.status is SequenceStatus.WAITING and not s.private_blocks


def _probe(data, admitted):
    """Stand-in for the runner's probe: K random anchors per newly admitted sequence."""
    for s in admitted:
        anchors = data.draw(st.permutations(range(s.affix_len))) if s.affix_len else []
        s.set_anchors(np.array(anchors[:s.num_anchors], np.int32))


request_specs = st.fixed_dictionaries(dict(
    left=st.integers(1, 20), gen=st.integers(1, 4).map(lambda b: b * BL), right=st.integers(0, 3),
    affix=st.sampled_from([None, *AFFIX_LENS]), position=st.sampled_from(["prefix", "infix", "suffix"]),
    policy=st.sampled_from(["acache", "acache", "baseline"]), ratio=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
))
operations = st.lists(st.one_of(st.tuples(st.just("add"), request_specs), st.tuples(st.just("add"), request_specs),
                                st.tuples(st.just("finish"), st.integers(0, 63)),
                                st.tuples(st.just("admit"), st.none())), max_size=60)  # adds twice as likely


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 120), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 6), operations)
def test_random_arrivals_and_finishes_keep_the_pool_safe(data, num_blocks, block_size, max_batch, ops):
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_batch)
    for rid, (op, arg) in enumerate(ops):
        if op == "add":
            spec = dict(arg)
            ratio = spec.pop("ratio")
            seq = _seq(rid, **spec)
            k = anchor_count(ratio, seq.affix_len)
            affix = bm.blocks_for(seq.affix_len) if seq.shares_affix else 0
            need = bm.blocks_for(seq.num_private(k if seq.shares_affix else 0)) + affix
            if need > num_blocks:
                with pytest.raises(RequestTooLargeError):
                    sched.add(seq, k)
            else:
                sched.add(seq, k)
        elif op == "admit":
            _probe(data, sched.admit())
            if sched.waiting and len(sched.running) < max_batch:  # the head waits only for blocks
                head = sched.waiting[0]
                resident = head.shares_affix and bm.resident(head.affix_key) is not None
                affix = bm.blocks_for(head.affix_len) if head.shares_affix and not resident else 0
                assert not bm.can_allocate(bm.blocks_for(head.num_private(head.num_anchors)) + affix)
        elif sched.running:
            sched.finish(sched.running[arg % len(sched.running)])
            sched.drain()  # as the next iteration's schedule() does after admitting
        _check_invariants(bm, sched)

    # Drain: every accepted request fits an empty pool, so the queue always empties.
    for _ in range(len(ops) + 1):
        _probe(data, sched.admit())
        _check_invariants(bm, sched)
        for s in sched.running:
            sched.finish(s)
        sched.drain()
        if sched.idle:
            break
    assert sched.idle and bm.num_free_blocks == num_blocks
    assert all(bm.resident(key) is None for key in AFFIX_LENS)


def test_step_inputs_travel_in_one_buffer_and_come_back_exactly():
    """`runner.pack` / `unpack`: every leaf of a step's inputs (int32, uint32 seeds past 2^31, bool,
    float32 with signs and non-finite values, an absent leaf) returns bit for bit inside jit."""
    import jax

    from acache_jax.engine.runner import pack, unpack

    tree = dict(ids=np.arange(-3, 9, dtype=np.int32).reshape(3, 4), seeds=np.asarray([0, 2**31 + 5, 2**32 - 1], np.uint32),
                active=np.asarray([True, False, True]), weight=np.asarray([-1.5, np.inf, np.nan, 0.0], np.float32),
                probe=None, scalar=np.int32(7))
    packing, buffer = pack(tree)
    assert buffer.dtype == np.int32 and buffer.ndim == 1
    back = jax.jit(unpack, static_argnums=0)(packing, buffer)
    assert back["probe"] is None
    for name in ("ids", "seeds", "active", "weight", "scalar"):
        got = np.asarray(back[name])
        assert got.dtype == np.asarray(tree[name]).dtype and got.shape == np.shape(tree[name]), name
        bits = lambda a: np.atleast_1d(a).view(np.uint8)
        np.testing.assert_array_equal(bits(got), bits(np.asarray(tree[name])), err_msg=name)


def test_a_step_runs_on_a_compiled_token_axis_within_the_padding_bound():
    """`Runner.token_axis`: a step reuses the shortest axis already run (same read widths, same probe
    use) of at most REUSE_PADDING x its tokens, else compiles its `token_bucket`; over random
    traffic that is far fewer programs than one per bucket."""
    from types import SimpleNamespace

    from acache_jax.decoding.layout import token_bucket
    from acache_jax.engine.runner import REUSE_PADDING, Runner

    runner = SimpleNamespace(read_widths=[64, 32], _token_axes={}, fixed_shapes=False)
    axis = lambda n, probing=False: Runner.token_axis(runner, n, probing)
    assert axis(300) == token_bucket(300) == 320
    assert axis(250) == 320  # 320 <= 1.5 x 250
    assert axis(200) == token_bucket(200) == 208  # 320 > 1.5 x 200
    assert axis(220) == 320 and axis(150) == 208  # the shortest that fits
    assert axis(210) == token_bucket(210) == 224  # 320 > 1.5 x 210
    assert axis(250, probing=True) == token_bucket(250)  # a probing step is another program
    runner.read_widths = [128, 32]
    assert axis(250) == token_bucket(250)  # so is one with other read widths

    rng = np.random.default_rng(0)
    runner = SimpleNamespace(read_widths=[64, 32], _token_axes={}, fixed_shapes=False)
    counts = rng.integers(16, 5000, size=2000)
    axes = [axis(int(n)) for n in counts]
    assert all(n <= m <= max(token_bucket(int(n)), REUSE_PADDING * n) for n, m in zip(counts, axes))
    assert len(set(axes)) < 0.5 * len({token_bucket(int(n)) for n in counts})
    assert {axis(int(n)) for n in counts} <= set(axes)  # a second pass compiles nothing new


def test_an_adaptive_budget_gives_back_the_anchor_slots_it_did_not_use():
    """Admission reserves the most anchors; once the probe says how many the mass needs (clipped
    to the bounds), the blocks beyond them are free again and the kept slots are the reserve's first."""
    from acache_jax.decoding.acache import Ranking  # noqa: PLC0415 (the only test here that needs jax)
    from acache_jax.engine.scheduler import StepOutput  # noqa: PLC0415

    bm = BlockManager(num_blocks=40, block_size=4)
    sched = Scheduler(bm, max_batch=4)
    seqs = [_seq(i, left=3, gen=8, affix="c") for i in range(3)]  # 11 own columns + up to 15 anchors
    for s in seqs:
        sched.add(s, 15, 2)
    plan = sched.schedule(MASK)
    assert plan.probe == seqs and all(len(s.private_blocks) == bm.blocks_for(11 + 15) for s in seqs)
    reserved = [s.read_slot_map[s.own_columns].copy() for s in seqs]
    free = bm.num_free_blocks
    order = np.tile(np.arange(30)[::-1], (3, 1))
    covering = np.array([1, 6, 30])  # below the floor, within the bounds, above the cap
    sched.postprocess(plan, StepOutput(np.zeros((0, BL), np.int32), np.zeros(0), np.zeros(0),
                                       Ranking(order, covering)), MASK, None)
    assert [s.num_anchors for s in seqs] == [2, 6, 15]
    assert [s.anchors.tolist() for s in seqs] == [[28, 29], list(range(24, 30)), list(range(15, 30))]
    assert [len(s.private_blocks) for s in seqs] == [bm.blocks_for(11 + k) for k in (2, 6, 15)]
    assert bm.num_free_blocks == free + sum(bm.blocks_for(26) - bm.blocks_for(11 + k) for k in (2, 6, 15))
    for s, own in zip(seqs, reserved):
        np.testing.assert_array_equal(s.read_slot_map[s.own_columns], own)  # the fixed slots did not move
        assert len(set(s.read_slot_map[s.private_columns].tolist())) == s.num_private(s.num_anchors)
    for s in seqs:
        sched.cancel(s)
    assert bm.num_free_blocks == bm.num_blocks
