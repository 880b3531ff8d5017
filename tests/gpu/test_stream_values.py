"""Words of host memory written and waited on by streams (``DeviceSync.write_value``,
``wait_value``, ``read_value``), and the tracing sync's capture and replay, on a CPU; the CUDA
stream memory operations in a real CUDA graph on a GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from engram_offload.gpu import sync as sync_module
from engram_offload.gpu.sync import HOST, MAIN, CudaSync, ImmediateSync, OrderingError, poll

from tracing_sync import CaptureError, TracingSync


def word(dtype=torch.int32) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype)[0]  # one element, as the lookups' state words


# ---------------------------------------------------------------------- the CPU's words
def test_immediate_words_are_written_at_once_and_waited_for_by_the_caller(monkeypatch):
    sync, w = ImmediateSync(), word(torch.int64)
    sync.write_value("side", w, -5)
    assert sync.read_value(w) == -5 and not sync.capturing() and sync.stream_memops()
    writer = threading.Thread(target=sync.write_value, args=(HOST, w, 7))
    writer.start()
    sync.wait_value(MAIN, w, 7)  # returns once the other thread's write lands
    writer.join(30)
    monkeypatch.setattr(sync_module, "WORD_WAIT_LIMIT_S", 0.05)
    with pytest.raises(TimeoutError, match=r"^main waited 0.05 s for a word to hold 8: whatever should write it "
                                           r"has stopped; check the thread that answers it$"):
        sync.wait_value(MAIN, w, 8)


def test_poll_gives_its_last_answer_at_the_limit():
    calls = []
    assert poll(lambda: calls.append(1) or len(calls) == 3, 30)
    assert not poll(lambda: False, 0.001)


def test_a_host_read_of_a_word_orders_the_streams_earlier_work_before_the_host():
    sync, w = TracingSync(), word()
    sync.run("side", lambda: None, writes={"slot": [0]})
    sync.write_value("side", w, 1)
    with pytest.raises(OrderingError, match="before its writer"):
        sync.run(HOST, lambda: None, reads={"slot": [0]})  # the host has not seen the word yet
    assert sync.read_value(w) == 1
    sync.run(HOST, lambda: None, reads={"slot": [0]})
    assert sync.log == ["side:<lambda>", "side:write_value", "host:<lambda>"]


def test_a_wait_on_a_word_orders_the_writers_earlier_work_before_the_stream():
    sync, w = TracingSync(), word()
    sync.run(HOST, lambda: None, writes={"rows": [0]})
    sync.write_value(HOST, w, 2)
    with pytest.raises(OrderingError, match="before its writer"):
        sync.run(MAIN, lambda: None, reads={"rows": [0]})
    sync.wait_value(MAIN, w, 2)
    sync.run(MAIN, lambda: None, reads={"rows": [0]})


def test_a_value_the_word_no_longer_holds_orders_nothing():
    sync, w = TracingSync(), word()
    sync.run("side", lambda: None, writes={"slot": [0]})
    sync.write_value("side", w, 1)
    w.fill_(3)  # written behind the sync's back
    assert sync.read_value(w) == 3
    with pytest.raises(OrderingError):
        sync.run(HOST, lambda: None, reads={"slot": [0]})


def test_a_wait_nobody_answers_is_a_hang():
    sync = TracingSync()
    sync.wait_limit_s = 0.05
    with pytest.raises(OrderingError, match=r"^main waited 0.05 s for a word to hold 1: on a GPU, a hang$"):
        sync.wait_value(MAIN, word(), 1)


# ---------------------------------------------------------------------- capture and replay
def test_a_capture_records_device_work_and_a_replay_runs_it_again():
    sync, w, done = TracingSync(), word(), word()
    runs = []
    with sync.capture() as graph:
        assert sync.capturing()
        sync.wait_stream("side", MAIN)  # the side stream joins the capture
        sync.run("side", lambda: runs.append("side"), writes={"buf": None})
        sync.write_value("side", w, 1)
        sync.wait_stream(MAIN, "side")
        sync.wait_value(MAIN, w, 1)
        sync.run(MAIN, lambda: runs.append("main"), reads={"buf": None})
        sync.write_value(MAIN, done, 9)
    assert runs == [] and int(w) == 0 and not sync.capturing()  # nothing ran
    for replay in range(1, 4):
        w.fill_(0)
        graph.replay()
        assert runs == ["side", "main"] * replay and int(done) == 9
    assert sync.host_knows_finished("side") is False  # a replay never makes the host wait


def test_a_capture_refuses_what_a_graph_cannot_replay():
    sync = TracingSync()
    event = sync.record(MAIN)  # outside the capture
    refused = [
        (lambda: sync.run(HOST, lambda: None), "on the host during a capture"),
        (lambda: sync.record(HOST), "on the host during a capture"),
        (lambda: sync.synchronize(None), "synchronize in the capturing thread"),
        (lambda: sync.read_value(word()), "read_value in the capturing thread"),
        (lambda: sync.write_value(HOST, word(), 1), "on the host during a capture"),
        (lambda: sync.run("side", lambda: None), "side, which has not joined the capture of main"),
        (lambda: sync.wait("side", event), "on an event recorded outside it"),
    ]
    for call, message in refused:
        with pytest.raises(CaptureError, match=message):
            with sync.capture():
                call()
    with pytest.raises(CaptureError, match="side is not joined back into main"):
        with sync.capture():
            sync.wait_stream("side", MAIN)
            sync.run("side", lambda: None)
    with sync.capture():
        inside = sync.record(MAIN)
    with pytest.raises(CaptureError, match="recorded during a capture, outside it"):
        sync.wait("side", inside)


def test_other_threads_are_not_captured():
    sync, w = TracingSync(), word()
    with sync.capture():
        other = threading.Thread(target=sync.write_value, args=(HOST, w, 4))
        other.start()
        other.join(30)
    assert int(w) == 4  # the reader threads of a lookup keep working while the engine captures


def test_a_replay_forks_the_captured_streams_from_the_capturing_one():
    sync = TracingSync()
    sync.run(MAIN, lambda: None, writes={"ids": None})  # before the graph's launch
    with sync.capture() as graph:
        sync.wait_stream("side", MAIN)
        sync.run("side", lambda: None, reads={"ids": None}, writes={"out": None})
        sync.wait_stream(MAIN, "side")
    graph.replay()
    sync.run(MAIN, lambda: None, reads={"out": None})  # joined back at the end of the replay
    sync.run(MAIN, lambda: None, writes={"ids": None})
    graph.replay()  # the next replay's side work is after main's write


# ---------------------------------------------------------------------- a GPU
def gpu_done(limit_s: float = 30.0) -> bool:
    """Whether the current stream's work so far ends within ``limit_s`` (never a hang)."""
    event = torch.cuda.Event()
    event.record()
    return poll(event.query, limit_s)


@pytest.mark.gpu
def test_cuda_streams_write_and_wait_on_host_words_inside_a_graph():
    sync = CudaSync()
    assert sync.stream_memops()
    words = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    big = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    gate, echo = words[0], words[1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager: the stream waits for the host, then answers
        sync.wait_value(MAIN, gate, 1)
        sync.write_value(MAIN, echo, 2)
        sync.write_value(MAIN, big[0], -(1 << 40))
    gate.fill_(1)
    with torch.cuda.stream(side):
        assert gpu_done()
    assert int(echo) == 2 and int(big[0]) == -(1 << 40)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    with torch.cuda.graph(graph):
        sync.wait_value(MAIN, gate, 3)
        counter.add_(1)
        sync.write_value(MAIN, echo, 4)
    for replay in range(1, 4):
        gate.fill_(0)
        echo.fill_(0)
        graph.replay()
        assert int(echo) == 0  # the replay waits for the host
        gate.fill_(3)
        assert gpu_done() and int(echo) == 4 and int(counter) == replay
