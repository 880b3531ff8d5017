"""Requests for the serving benchmark: chat turns and agentic coding sessions over a corpus.

A ``Request`` is one sequence of token ids consumed turn by turn. Each turn prefills its
new input (the prompt, or a tool's output appended to the growing context) and then
decodes an answer. Answers are taken from the corpus too (teacher forcing): the backbone
has random weights, so its samples would be noise, while real text keeps the n-gram
statistics, and so the row-access pattern, of real traffic.

- ``chat``: one turn, ``prompt`` tokens in, ``answer`` tokens out.
- ``agent``: sessions modelled on AgentX's long-context coding traffic: a long first
  context (instructions and code), then ``turns`` rounds that each append a tool's output
  (file contents, test logs) of about ``tool`` tokens and decode an ``answer``. The context
  keeps growing across turns; every turn alternates heavy input with latency-sensitive
  generation.

``RequestStream`` hands out requests one after another for a closed loop (a new request
starts whenever one finishes), cycling over the corpus if it runs out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .corpus import Corpus

__all__ = ["Request", "RequestStream", "WorkloadShape", "WORKLOADS"]

WORKLOADS = ("chat", "agent")


@dataclass(frozen=True)
class WorkloadShape:
    """Token counts of a request (agent sizes vary +-50% per turn around these)."""

    kind: str = "agent"
    prompt: int = 512  # chat prompt, or an agent session's first context
    answer: int = 64  # tokens decoded per turn
    turns: int = 4  # agent turns after the first context
    tool: int = 256  # tokens of tool output appended per agent turn

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"unknown workload {self.kind!r}; choose one of: {', '.join(WORKLOADS)}")
        for name in ("prompt", "answer", "turns", "tool"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name} must be >= 1, got {getattr(self, name)}")
        if self.answer < 2:
            raise ValueError("an answer needs >= 2 tokens (the first comes from the prefill)")


@dataclass
class Request:
    """One sequence: ``tokens`` int64 [n] and its turns as (input end, answer end) positions.

    Turn k prefills tokens[start_k : input_end_k] (start_0 = 0; later turns start at the
    previous answer's last token, which is fed as part of the next input), emits its first
    output token when that prefill completes, then decodes tokens[input_end_k : answer_end_k - 1]
    one per step, each step emitting the next output token.
    """

    number: int
    tokens: np.ndarray
    turns: list[tuple[int, int]]
    fed: int = 0  # tokens fed to the model so far
    turn: int = 0
    turn_started: float = 0.0
    last_emit: float | None = None
    ttft: list[float] = field(default_factory=list)  # seconds, one per turn
    itl: list[float] = field(default_factory=list)  # seconds between output tokens
    output_tokens: int = 0

    @property
    def done(self) -> bool:
        return self.turn >= len(self.turns)

    @property
    def in_prefill(self) -> bool:
        return self.fed < self.turns[self.turn][0]

    def next_piece(self, budget: int) -> np.ndarray:
        """The tokens to feed this step: up to ``budget`` of the prefill, or one decode token."""
        input_end, _ = self.turns[self.turn]
        if self.fed < input_end:
            return self.tokens[self.fed: min(input_end, self.fed + max(1, budget))]
        return self.tokens[self.fed: self.fed + 1]

    def advance(self, fed: int, now: float) -> None:
        """Account a step that fed ``fed`` tokens and ended at ``now``."""
        input_end, answer_end = self.turns[self.turn]
        was_prefill = self.fed < input_end
        self.fed += fed
        if was_prefill:
            if self.fed >= input_end:  # prefill complete: the turn's first output token
                self.ttft.append(now - self.turn_started)
                self.output_tokens += 1
                self.last_emit = now
        else:  # a decode step emits the next output token
            assert self.last_emit is not None
            self.itl.append(now - self.last_emit)
            self.output_tokens += 1
            self.last_emit = now
        if self.fed >= input_end and self.fed >= answer_end - 1:
            self.turn += 1  # the answer's last token opens the next turn's input
            self.turn_started = now


class RequestStream:
    """Requests of one workload shape cut from a corpus, in order, cycling when it runs out."""

    def __init__(self, corpus: Corpus, shape: WorkloadShape, seed: int = 0) -> None:
        if not corpus.documents:
            raise ValueError(f"corpus {corpus.name!r} has no documents")
        self.corpus = corpus
        self.shape = shape
        self.rng = np.random.default_rng(seed)
        self._docs = [d for d in corpus.documents if d.size > 0]
        self._doc = 0
        self._pos = 0
        self.count = 0
        self.wrapped = 0  # times the corpus was used up and started again

    def _take(self, n: int) -> np.ndarray:
        """The next ``n`` tokens of the corpus, continuing across documents."""
        parts, need = [], n
        while need > 0:
            doc = self._docs[self._doc]
            part = doc[self._pos: self._pos + need]
            parts.append(part)
            need -= part.size
            self._pos += part.size
            if self._pos >= doc.size:
                self._doc, self._pos = self._doc + 1, 0
                if self._doc >= len(self._docs):
                    self._doc = 0
                    self.wrapped += 1
        return np.concatenate(parts)

    def _vary(self, n: int) -> int:
        return max(2, int(round(n * self.rng.uniform(0.5, 1.5))))

    def next(self) -> Request:
        s = self.shape
        if s.kind == "chat":
            lengths = [(s.prompt, s.answer)]
        else:
            lengths = [(s.prompt, self._vary(s.answer))] + [(self._vary(s.tool), self._vary(s.answer))
                                                            for _ in range(s.turns)]
        tokens, turns, end = [], [], 0
        for new_input, answer in lengths:
            tokens.append(self._take(new_input + answer))
            turns.append((end + new_input, end + new_input + answer))
            end += new_input + answer
        self.count += 1
        return Request(self.count, np.concatenate(tokens), turns)

    def __iter__(self) -> Iterator[Request]:
        while True:
            yield self.next()
