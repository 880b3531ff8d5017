"""Requests and streams: turn bookkeeping, TTFT/ITL accounting, cycling over a corpus."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.bench.corpus import Corpus
from engram_offload.bench.workload import Request, RequestStream, WorkloadShape


def corpus(sizes=(100, 50, 70)) -> Corpus:
    start = 0
    docs = []
    for n in sizes:
        docs.append(np.arange(start, start + n, dtype=np.int64))
        start += n
    return Corpus("numbers", tuple(docs), "test")


def test_a_chat_turn_prefills_then_decodes_answer_minus_one_tokens():
    r = Request(1, np.arange(10), [(6, 10)])  # 6 prompt tokens, 4 answer tokens
    assert r.in_prefill and r.next_piece(4).tolist() == [0, 1, 2, 3]
    r.advance(4, now=1.0)
    assert r.in_prefill and r.next_piece(99).tolist() == [4, 5]
    r.advance(2, now=2.0)
    assert r.ttft == [2.0] and r.output_tokens == 1 and not r.in_prefill
    for t, token in ((2.5, 6), (3.5, 7), (4.0, 8)):
        assert r.next_piece(5).tolist() == [token]  # one decode token, whatever the budget
        r.advance(1, now=t)
    assert r.done and r.output_tokens == 4 and r.itl == [0.5, 1.0, 0.5]


def test_the_last_answer_token_opens_the_next_turn():
    r = Request(1, np.arange(12), [(3, 6), (9, 12)])
    r.advance(3, 1.0)
    r.advance(1, 2.0)
    r.advance(1, 3.0)  # fed 5 == answer_end - 1: turn 0 over
    assert r.turn == 1 and r.turn_started == 3.0
    assert r.next_piece(100).tolist() == [5, 6, 7, 8]  # token 5 (last answer token) + the tool output
    r.advance(4, 4.5)
    assert r.ttft == [1.0, 1.5]


def test_stream_takes_consecutive_tokens_across_documents_and_wraps():
    c = corpus()
    stream = RequestStream(c, WorkloadShape("chat", prompt=60, answer=40))
    first, second = stream.next(), stream.next()
    assert first.tokens.tolist() == list(range(100))
    assert second.tokens.tolist() == list(range(100, 200))
    third = stream.next()
    assert stream.wrapped == 1 and third.tokens[:20].tolist() == list(range(200, 220))
    assert third.tokens[20:].tolist() == list(range(80))


def test_agent_sessions_grow_their_context_turn_by_turn():
    stream = RequestStream(corpus((5000,)), WorkloadShape("agent", prompt=100, answer=10, turns=3, tool=40), seed=1)
    r = stream.next()
    assert len(r.turns) == 4
    assert r.turns[0] == (100, r.turns[0][1])
    ends = [e for turn in r.turns for e in turn]
    assert ends == sorted(ends) and ends[-1] == r.tokens.size
    for (i0, a0), (i1, a1) in zip(r.turns, r.turns[1:]):
        assert 20 <= i1 - a0 <= 60  # tool output within +-50% of 40


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadShape("batch")
    with pytest.raises(ValueError, match="answer needs"):
        WorkloadShape("chat", answer=1)
