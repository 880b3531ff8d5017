"""``train``, ``eval``, ``scan``: the small trained Engram model (``model/``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import write_json_atomic
from ..tiers import tier_names
from ..units import MAX_THREADS, format_bytes, int_in_range, non_negative_int, positive_int
from . import UsageError
from .core import MemoryNeed, check_memory_needs
from .options import add_cache_bytes, add_json, add_json_out, removed_option

THREADS = int_in_range(1, MAX_THREADS)  # torch's thread pool crashes the process far above it
EVAL_BATCH = 16  # windows per forward pass of the reading commands (model.evaluate's default)
# What loading the model and the tokenizer and tokenizing take once torch is imported (measured:
# about 280 MiB of address space, its worker threads' stacks included); the tokenizer aborts
# the process, past any message, when an allocation fails.
LOAD_BYTES = 320 << 20

if TYPE_CHECKING:
    from ..model.skip import SkipPoint


def register(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser(
        "train", help="train the small Engram language model on the CPU",
        description="Train a small EngramLM (V4.1 Engram layers with hyper-connection branches), or with "
        "--no-engram its twin without Engram, on the code, documentation and prose this machine has "
        "installed (the sources not installed are named), seeded, and save it in the released "
        "DeepSeek-V4.1 on-disk format (fp8 rows with ue8m0 scales).",
    )
    tr.add_argument("--out", required=True, help="folder to write the checkpoint into")
    tr.add_argument("--seed", type=non_negative_int, default=0, help="random seed (same seed, same bytes; default 0)")
    tr.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (default 2,000)")
    tr.add_argument("--batch", type=positive_int, default=None, help="windows per step (default 16)")
    tr.add_argument("--seq-len", type=positive_int, default=None, help="tokens per window (default 128)")
    tr.add_argument("--max-train-tokens", type=positive_int, default=None,
                    help="tokenize at most this many training tokens, shared by kind and source (default 4,000,000)")
    tr.add_argument("--corpus", action="append", metavar="DIR", help="a folder of .py/.txt/.rst files (repeatable; "
                    "default: every installed source: the standard library, python3.11-doc, man pages, licence "
                    "texts, copyright files, debian-reference-en, debian-faq, doc-debian; missing ones are named)")
    tr.add_argument("--no-engram", action="store_true",
                    help="train the twin without Engram: the same seed, data, steps and backbone, no table")
    tr.add_argument("--row-dropout", type=float, default=None,
                    help="share of row reads replaced by another row of their head while training, as an unseen "
                    "n-gram's read is (default 0)")
    tr.add_argument("--unseen-rate", type=float, default=None,
                    help="share of positions whose 2-gram (and 3-gram) is read as unseen while training, its rows "
                    "replaced by random rows of their heads; as many more get an unseen 3-gram (default 0.3)")
    tr.add_argument("--gate-loss", type=float, default=None,
                    help="weight of the gate's cross-entropy as a detector of the rows replaced for unseen n-grams, added to the loss (default 5)")
    tr.add_argument("--table-init", choices=("normal", "zero"), default=None,
                    help="what a row no training n-gram writes holds (default normal: random, std 0.1)")
    tr.add_argument("--prime-start", type=positive_int, default=None,
                    help="table rows per head start at the first prime above this (default 20,000)")
    tr.add_argument("--threads", type=THREADS, default=1, help="torch CPU threads (default 1: reproducible)")
    tr.add_argument("--plot", help="loss-curve PNG (default: OUT-loss.png beside the folder)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.set_defaults(func=cmd_train)

    reads, as_json = _reading_parent(), _json_parent()
    ev = sub.add_parser(
        "eval", parents=[reads, as_json], help="held-out perplexity of the trained model, from any tier",
        description="Perplexity of the model on the held-out files of a corpus, per kind of text (code, "
        "documentation, prose), with Engram rows from the checkpoint or served from a tier; beside it, on the same "
        "tokens, its twin trained without Engram and the model with every gate forced to 0 (a lesion).",
    )
    ev.add_argument("--tier", choices=tier_names(local=True, private=True),
                    help="serve the rows from this tier (the table is converted from the checkpoint "
                    "unless --table is given); default: the checkpoint's own rows")
    ev.add_argument("--table", help="an already converted table file of the model (with --tier; default: converted from the checkpoint)")
    add_cache_bytes(ev, 0, percent=False, what="DRAM row cache in front of the tier (with --tier)")
    removed_option(ev, "--cache", "--cache-bytes SIZE with --tier (bytes: 256KiB, 512M, 2G; not a percentage)")
    ev.add_argument(
        "--lesion", action="store_true", help="report the model with every gate forced to 0 (the lesion) as its "
        "perplexity; the table printed below always gives the Engram model, the lesion and the twin")
    removed_option(ev, "--no-engram", "--lesion")
    ev.add_argument("--twin", metavar="DIR", help="the model's twin trained without Engram (default: the folder "
                    "NAME-no-engram beside the model, when there is one)")
    ev.set_defaults(func=cmd_eval)

    sc = sub.add_parser(
        "scan", parents=[reads, as_json], help="which n-grams the trained model's gates open for",
        description="Every (layer, order, head) row read on the held-out text with its gate: the top "
        "n-grams by mean gate, by read count and by gate x count, and the rank correlation of gate "
        "and read frequency.",
    )
    sc.add_argument("--top", type=positive_int, default=15, help="n-grams per list (default 15)")
    sc.add_argument("--min-reads", type=positive_int, default=3,
                    help="rows read fewer times are left out of the mean-gate list (default 3)")
    sc.add_argument("--plot", help="scatter PNG of mean gate vs read count per row (default: none)")
    sc.set_defaults(func=cmd_scan)

    cs = sub.add_parser(
        "cache-sim", parents=[reads, as_json],
        help="replay the model's held-out reads through LRU, LFU-aging and gate-aware caches",
        description="Scan the held-out text, then replay its reads (with their gates) through row caches "
        "of 1/5/10/20%% of the table under each policy: hit rate and share of the gate mass served.",
    )
    cs.set_defaults(func=cmd_cache_sim)

    sk = sub.add_parser(
        "skip-curve", parents=[reads, as_json],
        help="EXPERIMENTAL read-skip predictor: reads saved vs perplexity",
        description="Measure the experimental read-skip predictor (never on by default): skip an Engram "
        "layer's reads where the rows' remembered gates predict a weak gate, zero that contribution, "
        "and report reads saved against perplexity for each threshold.",
    )
    sk.add_argument("--thresholds", default="0.2,0.4,0.5,0.6,0.7,0.75,0.8,0.85,0.9,0.95",
                    help="comma-separated gate thresholds (default 0.2..0.95)")
    sk.add_argument("--plot", help="PNG of reads saved vs perplexity (default: none)")
    sk.set_defaults(func=cmd_skip_curve)


def _json_parent() -> argparse.ArgumentParser:
    """The output options every reading command shares."""
    p = argparse.ArgumentParser(add_help=False)
    add_json_out(p)
    add_json(p)
    return p


def _json_out(args: argparse.Namespace, record: dict) -> None:
    """``record`` into ``--json-out``'s file, when given."""
    if args.json_out:
        write_json_atomic(args.json_out, record)


def _reading_parent() -> argparse.ArgumentParser:
    """The model and the text every command that reads the model's held-out text shares."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--checkpoint", metavar="DIR", help="a trained model's folder (default: the model shipped in the package)")
    removed_option(p, "--model", "--checkpoint")
    p.add_argument("--corpus", action="append", metavar="DIR",
                   help="a folder of .py/.txt/.rst files (repeatable; kinds by suffix: .py code, .rst "
                   "documentation, .txt prose; default: every installed source the model was trained on)")
    p.add_argument("--all-files", action="store_true",
                   help="every file of the checkpoint's training corpus, not only its held-out ones (another "
                   "corpus is always read whole)")
    p.add_argument("--max-tokens", type=non_negative_int, default=100_000,
                   help="tokens of text to read (default 100,000; 0 = all)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per window (default 128)")
    p.add_argument("--threads", type=THREADS, default=1, help="torch CPU threads (default 1)")
    return p


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from ..model.train import TrainSettings, plot_losses, train

    out, plot = train_outputs(args.out, args.plot)  # before any work: a bad path fails now, not at the end
    s = TrainSettings(seed=args.seed, corpus=args.corpus, engram=not args.no_engram)
    if args.row_dropout is not None and not 0 <= args.row_dropout < 1:
        raise UsageError(f"--row-dropout must be at least 0 and below 1, got {args.row_dropout}")
    if args.unseen_rate is not None and not 0 <= args.unseen_rate <= 0.5:
        raise UsageError(f"--unseen-rate must be between 0 and 0.5, got {args.unseen_rate}")
    if args.gate_loss is not None and not args.gate_loss >= 0:
        raise UsageError(f"--gate-loss must be at least 0, got {args.gate_loss}")
    for name in ("steps", "batch", "seq_len", "max_train_tokens", "row_dropout", "table_init", "prime_start",
                 "unseen_rate", "gate_loss"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    b, t, v, h = s.batch, s.seq_len, s.vocab, s.attention_heads
    check_memory_needs([
        MemoryNeed(f"--seq-len {t}" if t * 16 > b * 128 else f"--batch {b}", b * t * (2 * v + h * t) * 4,
                   f"{b:,} windows x {t:,} tokens x ({v:,} logits x 2 + {h} heads x {t:,} attention) x 4 B"),
    ])  # --max-train-tokens only caps what the corpus gives: not an allocation of its own
    torch.set_num_threads(args.threads)
    log = (lambda msg: None) if args.no_progress else (lambda msg: print(msg, file=sys.stderr))
    result = train(s, out, progress=not args.no_progress, log=log, warn=lambda msg: print(msg, file=sys.stderr))
    plot_losses(result.history, plot)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    last = result.history[-1]
    print(f"saved {out} ({format_bytes(size)}) after {s.steps} steps on {result.train_tokens:,} training "
          f"tokens in {result.seconds:.0f} s; held-out loss {last.get('held_out_loss', float('nan')):.3f}; "
          f"loss curve {plot}")
    return 0


def _writable_folder(folder: Path, what: str) -> None:
    """Refuse (``UsageError``) a folder that cannot be created or written: its nearest existing
    part must be a folder this process may write in."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{what}: {existing} is a file, not a folder: give another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{what}: cannot write in {existing}: give a path you may write to")


def train_outputs(out_arg: str, plot_arg: str | None) -> tuple[Path, Path]:
    """The checkpoint folder and loss-curve file of ``train``, checked before training starts:
    the folder is not a file and can be written; the plot is a file name (default
    ``OUT-loss.png`` beside the folder, named after the folder even for ``.``)."""
    if not out_arg.strip():
        raise UsageError("--out is empty: give the folder to write the checkpoint into")
    out = Path(out_arg)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out_arg} is a file: give a folder to write the checkpoint into "
                         "(created if missing)")
    _writable_folder(out, "--out")
    if plot_arg:
        plot = Path(plot_arg)
    else:
        whole = out.resolve()
        plot = whole.parent / f"{whole.name}-loss.png" if whole.name else whole / "loss.png"
    if plot.is_dir():
        raise UsageError(f"--plot {plot} is a folder: give a .png file name")
    if not plot.absolute().parent.is_dir():
        raise UsageError(f"--plot: folder {plot.absolute().parent} does not exist: create it first")
    _writable_folder(plot.absolute().parent, "--plot")
    return out, plot


def _check_reading_memory(args: argparse.Namespace, cache: int = 0) -> None:
    """Refuse up front (exit 2) a --seq-len or --cache-bytes the machine cannot hold (--max-tokens only
    caps what the corpus gives, and the corpus is read in bounded pieces)."""
    t = args.seq_len
    needs = [MemoryNeed(f"--seq-len {t}", EVAL_BATCH * t * t * 4,
                        f"{EVAL_BATCH} windows x {t:,} x {t:,} attention scores x 4 B"),
             MemoryNeed("loading the model and the tokenizer", LOAD_BYTES,
                        "their weights, vocabulary and threads, beyond the modules already loaded",
                        fix="raise the address-space limit (ulimit -v) or free memory")]
    if cache:
        needs.append(MemoryNeed(f"--cache-bytes {format_bytes(cache)}", cache, "the row cache"))
    check_memory_needs(needs)


def trained_on(model_dir: Path, corpus: list[str] | None) -> bool:
    """Whether ``corpus`` (``--corpus``; None: the default one) is the one the checkpoint in
    ``model_dir`` was trained on (its ``training.json``; a checkpoint without one was trained on
    the default corpus, as the shipped model was)."""
    try:
        trained = json.loads((model_dir / "training.json").read_text())["settings"]["corpus"]
    except (OSError, ValueError, KeyError, TypeError):
        trained = None

    def roots(c: list[str] | None) -> set[Path] | None:
        return None if c is None else {Path(r).resolve() for r in c}

    return roots(trained) == roots(corpus)


def _held_out_pieces(args: argparse.Namespace, model_dir: Path) -> list:
    """The windows to read, every kind's one after another (see ``_held_out_by_kind``)."""
    return [p for pieces in _held_out_by_kind(args, model_dir).values() for p in pieces]


def _held_out_by_kind(args: argparse.Namespace, model_dir: Path) -> dict[str, list]:
    """The windows to read by kind of text: the held-out files of the checkpoint's training
    corpus, or the whole of any other corpus (nothing of it was trained on); ``--all-files``:
    every file. ``--max-tokens`` is shared equally by the kinds."""
    from ..engram.tokenizer import load_tokenizer
    from ..model.corpus import corpus_files, kind_sequences, split
    from ..model.evaluate import windows

    files = corpus_files(args.corpus)
    if not args.all_files and trained_on(model_dir, args.corpus):
        files = split(files)[1]
        if not files:
            raise UsageError("the corpus has no held-out file (one file in 20 is held out): "
                             "give a larger corpus or pass --all-files")
    by_kind = kind_sequences(files, load_tokenizer(), args.max_tokens or None, min_tokens=2)
    return {kind: windows(seqs, args.seq_len) for kind, seqs in by_kind.items()}


def _out_of_domain(args: argparse.Namespace, kinds: int) -> tuple[dict[str, list], dict[str, str]]:
    """The windows of each installed ``OUT_OF_DOMAIN`` source (a kind's share of ``--max-tokens``,
    its files in the order of their names' SHA-256), and why each other source is skipped."""
    from ..engram.tokenizer import load_tokenizer
    from ..model.corpus import OUT_OF_DOMAIN, find_sources, token_sequences
    from ..model.evaluate import windows

    found, missing = find_sources(OUT_OF_DOMAIN)
    budget = args.max_tokens // max(1, kinds) or None
    pieces = {s.label: windows(token_sequences(sorted(s.files(), key=lambda f: hashlib.sha256(f.name.encode()).digest()),
                                               load_tokenizer(), budget, min_tokens=2), args.seq_len) for s in found}
    return pieces, {s.label: f"not installed (apt-get install {s.package})" for s in missing}


def _load(args: argparse.Namespace, table: bool):
    import torch

    from ..model.checkpoint_io import load_model, shipped_model_dir

    _check_reading_memory(args, getattr(args, "cache_bytes", 0))
    torch.set_num_threads(args.threads)
    model_dir = Path(args.checkpoint) if args.checkpoint else shipped_model_dir()
    return model_dir, load_model(model_dir, table=table)


def cmd_eval(args: argparse.Namespace) -> int:
    from ..model.checkpoint_io import load_model, twin_dir
    from ..model.evaluate import compare, store_rows
    from ..model.ngrams import SeenNgrams
    from ..model.serving import served_table

    if (args.table or args.cache_bytes) and not args.tier:
        raise UsageError("--table and --cache-bytes need --tier")
    model_dir, model = _load(args, table=args.tier is None)
    twin_path = Path(args.twin) if args.twin else twin_dir(model_dir)
    if args.twin and not (twin_path / "config.json").is_file():
        raise UsageError(f"--twin {args.twin} holds no config.json: give the folder `train --no-engram` wrote")
    twin = load_model(twin_path) if (twin_path / "config.json").is_file() else None
    if twin is not None and twin.has_engram:
        raise UsageError(f"--twin {twin_path} has Engram layers: give the folder `train --no-engram` wrote")
    by_kind = _held_out_by_kind(args, model_dir)
    unseen, skipped = _out_of_domain(args, len(by_kind)) if args.corpus is None else ({}, {})
    seen = SeenNgrams.load(model_dir)
    serving = served_table(model_dir, args.tier, table=args.table, cache_bytes=args.cache_bytes) if args.tier \
        else nullcontext(None)
    with serving as store:
        rows = store_rows(store, model) if store is not None else None
        table = compare(model, twin, by_kind, rows, seen)
        other = {k: v for k, v in compare(model, twin, unseen, rows, seen).items() if k != "all"} if unseen else {}
        stats = store.stats() if store is not None else None
    result = table["all"]["lesion" if args.lesion else "engram"]
    record = {**result.to_dict(), "model": str(model_dir), "tier": args.tier or "checkpoint",
              "engram": not args.lesion, "windows": sum(len(p) for p in by_kind.values()), "seq_len": args.seq_len,
              "twin": str(twin_path) if twin is not None else None,
              "by_kind": {kind: {name: r.to_dict() for name, r in row.items()} for kind, row in table.items()},
              "out_of_domain": {k: {name: r.to_dict() for name, r in row.items()} for k, row in other.items()},
              "out_of_domain_skipped": skipped}
    everything = table["all"]
    record["lesion_over_engram"] = everything["lesion"].perplexity / everything["engram"].perplexity
    if twin is not None:
        record["twin_over_engram"] = everything["twin"].perplexity / everything["engram"].perplexity
    if stats is not None and args.cache_bytes:
        record["cache_hit_rate"] = stats["store"]["hit_rate"]
    _json_out(args, record)
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"{record['tokens']:,} tokens  perplexity {result.perplexity:.3f}  (nll {result.nll:.4f}; "
          f"rows from {record['tier']}; Engram {'on' if record['engram'] else 'zeroed'})")
    print(f"{'text':>14} {'tokens':>9} {'Engram':>9} {'twin':>9} {'twin/Engram':>11} {'lesion':>9}  "
          "gate on unseen / seen 2-grams, 3-grams (unseen share)")
    for kind, row in [*table.items(), *((f"unseen:{k}", row) for k, row in other.items())]:
        e = row["engram"]
        twin_ppl = f"{row['twin'].perplexity:>9.3f} {row['twin'].perplexity / e.perplexity:>10.3f}x" \
            if "twin" in row else f"{'-':>9} {'-':>11}"
        gates = "  ".join(f"{u:.3f} / {g:.3f} ({share:.0%})" for u, g, share in
                          zip(e.gates["gate_unseen"], e.gates["gate_seen"], e.gates["unseen_share"])) if e.gates else ""
        print(f"{kind:>14} {e.tokens:>9,} {e.perplexity:>9.3f} {twin_ppl} {row['lesion'].perplexity:>9.3f}  {gates}")
    for k, why in skipped.items():
        print(f"{'unseen:' + k:>14} skipped: {why}")
    worth = f"twin / Engram {record['twin_over_engram']:.3f}x" if twin is not None else \
        f"no twin at {twin_path} (train one with `train --no-engram`, or pass --twin)"
    print(f"table's worth: {worth}; lesion (gate forced to 0) / Engram {record['lesion_over_engram']:.3f}x")
    return 0


def cmd_scan(args: argparse.Namespace) -> int:
    from ..engram.tokenizer import load_tokenizer
    from ..model.checkpoint_io import written_rows
    from ..model.ngrams import SeenNgrams
    from ..model.scan import plot_scan, rank_correlation, scan, top_rows

    model_dir, model = _load(args, table=True)
    pieces = _held_out_pieces(args, model_dir)
    result = scan(model, pieces, seen=SeenNgrams.load(model_dir))
    read = result.read_rows
    counts, gates = result.counts[read], result.mean_gates[read]
    steady = counts >= args.min_reads
    correlation = rank_correlation(gates, counts)
    top = top_rows(model, result, load_tokenizer(), args.top, args.min_reads)
    summary = {
        "model": str(model_dir), "tokens": result.evaluation.tokens, "reads": int(result.counts.sum()),
        "rows_read": int(read.size), "table_rows": result.config_rows,
        "spearman_gate_vs_reads": correlation,
        f"spearman_gate_vs_reads_min{args.min_reads}": rank_correlation(gates[steady], counts[steady]),
        "mean_gate": float(result.gate_sums.sum() / max(1, result.counts.sum())),
        "rows_serving_one_ngram": float((result.distinct_ngrams[read] == 1).mean()),
        **_unseen_summary(result),
        **_unwritten_summary(result, written_rows(model_dir)),
        "top": top,
    }
    _json_out(args, summary)
    if args.plot:
        plot_scan(result, args.plot, correlation)
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
        return 0
    print(f"{summary['tokens']:,} tokens, {summary['reads']:,} reads of {summary['rows_read']:,} rows "
          f"(of {summary['table_rows']:,}); mean gate {summary['mean_gate']:.3f}")
    print(f"{summary['rows_serving_one_ngram']:.1%} of the rows read served a single n-gram (the rest collide)")
    unseen = _unseen_summary(result)
    if unseen:
        for n, share, gate, other in zip(range(2, 2 + len(unseen["unseen_ngram_reads"])), unseen["unseen_ngram_reads"],
                                         unseen["mean_gate_unseen_ngrams"], unseen["mean_gate_seen_ngrams"]):
            print(f"{share:.2%} of the {n}-gram reads were of {n}-grams no training window held: mean gate "
                  f"{gate:.3f} there, {other:.3f} on seen {n}-grams")
    if "unwritten_reads" in summary:
        print(f"{summary['unwritten_reads']:.2%} of the reads were of rows no training n-gram wrote: mean gate "
              f"{summary['mean_gate_unwritten']:.3f} there, {summary['mean_gate_written']:.3f} on written rows")
    print(f"Spearman(mean gate, reads) = {summary['spearman_gate_vs_reads']:+.3f} over every row read; "
          f"{summary[f'spearman_gate_vs_reads_min{args.min_reads}']:+.3f} over rows read >= {args.min_reads} times")
    for name, rows in top.items():
        print(f"\ntop n-grams {name.replace('_', ' ')}:")
        for r in rows:
            print(f"  L{r['layer']} n={r['order']} h{r['head']}  gate {r['mean_gate']:.3f}  reads {r['reads']:>6,}  "
                  f"{r['ngram']!r} ({r['ngram_share']:.0%} of the row's reads)")
    return 0


def _unwritten_summary(result, written) -> dict[str, float]:
    """The share of reads of rows no training n-gram wrote, and the mean gate there and on the
    written rows ({} when the checkpoint does not say which rows were written)."""
    if written is None:
        return {}
    unwritten = ~written
    reads = result.counts.sum()

    def mean_gate(rows) -> float:
        return float(result.gate_sums[rows].sum() / result.counts[rows].sum()) if result.counts[rows].sum() else float("nan")

    return {"unwritten_reads": float(result.counts[unwritten].sum() / max(1, reads)),
            "mean_gate_unwritten": mean_gate(unwritten), "mean_gate_written": mean_gate(written)}


def _unseen_summary(result) -> dict[str, list[float]]:
    """Per order (2-grams first): the share of reads of n-grams no training window held, and the
    mean gate on those reads and on the others ({} when the checkpoint keeps no training n-grams)."""
    if result.unseen_reads is None:
        return {}
    unseen, seen = result.unseen_reads, result.seen_reads

    def ratio(a, b) -> list[float]:
        return [float(x / y) if y else float("nan") for x, y in zip(a, b)]

    return {"unseen_ngram_reads": ratio(unseen, unseen + seen),
            "mean_gate_unseen_ngrams": ratio(result.unseen_gate_sums, unseen),
            "mean_gate_seen_ngrams": ratio(result.seen_gate_sums, seen)}


def cmd_cache_sim(args: argparse.Namespace) -> int:
    from ..cache.gate_policy import GateLFUPolicy
    from ..cache.policy import LFUPolicy, LRUPolicy
    from ..model.cache_sim import compare_policies
    from ..model.scan import scan

    model_dir, model = _load(args, table=True)
    result = scan(model, _held_out_pieces(args, model_dir))
    c = model.config
    step_reads = 16 * len(c.layer_ids) * c.cols_per_layer  # one position of a 16-window batch
    rows = compare_policies(result.trace_ids, result.trace_gates, c.num_rows, step_reads,
                            {"lru": LRUPolicy, "lfu-aging": LFUPolicy, "gate-lfu": GateLFUPolicy})
    record = {"model": str(model_dir), "reads": int(result.trace_ids.size), "table_rows": c.num_rows,
              "results": rows}
    _json_out(args, record)
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"{record['reads']:,} reads of a {c.num_rows:,}-row table")
    print(f"{'cache':>6} {'policy':>10} {'hit rate':>9} {'gate share':>11}")
    for r in rows:
        print(f"{r['fraction']:>6.0%} {r['policy']:>10} {r['hit_rate']:>9.4f} {r['gate_share']:>11.4f}")
    return 0


def cmd_skip_curve(args: argparse.Namespace) -> int:
    from ..model.skip import skip_curve

    try:
        thresholds = [float(x) for x in args.thresholds.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--thresholds must be comma-separated numbers, got {args.thresholds!r}") from None
    model_dir, model = _load(args, table=True)
    curve, baseline = skip_curve(model, _held_out_pieces(args, model_dir), thresholds)
    record = {"model": str(model_dir), "experimental": "read-skip predictor, off by default", "curve": curve,
              "random_baseline": baseline}
    _json_out(args, record)
    if args.plot:
        _plot_skip(curve, baseline, args.plot)
    if args.json:
        print(json.dumps(record))
        return 0
    print("EXPERIMENTAL read-skip predictor (off by default everywhere else)")
    print(f"{'threshold':>9} {'reads saved':>12} {'perplexity':>11} {'change':>8}")
    base = curve[0]["perplexity"]
    for r in curve:
        print(f"{r['threshold']:>9.2f} {r['reads_saved']:>12.1%} {r['perplexity']:>11.3f} "
              f"{r['perplexity'] / base - 1:>+8.2%}")
    for r in baseline:
        print(f"{'random':>9} {r['reads_saved']:>12.1%} {r['perplexity']:>11.3f} {r['perplexity'] / base - 1:>+8.2%}")
    return 0


def _plot_skip(curve: list[SkipPoint], baseline: list[SkipPoint], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["reads_saved"] * 100 for r in curve], [r["perplexity"] for r in curve], "o-",
            label="predictor (remembered gates)")
    ax.plot([0] + [r["reads_saved"] * 100 for r in baseline], [curve[0]["perplexity"]] + [r["perplexity"] for r in baseline],
            "s--", label="random skips")
    ax.legend()
    for r in curve:
        ax.annotate(f"{r['threshold']:g}", (r["reads_saved"] * 100, r["perplexity"]), fontsize=7)
    ax.set_xlabel("Engram reads skipped (%)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("EXPERIMENTAL read-skip predictor (off by default)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
