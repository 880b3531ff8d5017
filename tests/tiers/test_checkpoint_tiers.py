"""A checkpoint served from its own shards: every tier's rows bit-identical to the converted table's,
a damaged page caught by every reader, a changed shard and a foreign sidecar refused."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_offload import open_table
from engram_offload.engram.config import EngramConfig
from engram_offload.errors import ChecksumError, TableFormatError
from engram_offload.serving.layered import LayeredStore
from engram_offload.serving.sharding import shard_columns, shard_rows
from engram_offload.table.checkpoint import index_checkpoint
from engram_offload.table.convert import convert_checkpoint
from engram_offload.table.format import read_header
from engram_offload.table.generate import make_random_checkpoint, random_rows
from engram_offload.table.stream import PAGE

from released_checkpoint import write_indexed_checkpoint
from second_uid import NOBODY, in_child, needs_root
from tier_cases import direct_io_refused, uring_available

TIERS = [
    ("memory", {}),
    ("pinned", {}),
    ("shared", {}),
    ("mmap", {}),
    ("direct", {"engine": "threads", "queue_depth": 4, "scales": "read"}),
    ("direct", {"engine": "uring", "queue_depth": 8, "scales": "read"}),
    ("direct", {"engine": "threads", "scales": "memory"}),
    ("direct", {"engine": "uring"}),  # its scales in a shared segment
]
TIER_IDS = ["memory", "pinned", "shared", "mmap", "direct-threads", "direct-uring", "direct-scales-memory",
            "direct-scales-shared"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny released-format V4.1 checkpoint, indexed, and its table rows."""
    directory = tmp_path_factory.mktemp("released")
    _, raw = write_indexed_checkpoint(directory / "ckpt")
    return directory / "ckpt", raw


@pytest.fixture(scope="module")
def larger(tmp_path_factory):
    """A generated released-format checkpoint of about 200 MB (every 16th row straddles two pages, each
    layer's scales end inside a page), indexed; its rows and the table converted from it."""
    directory = tmp_path_factory.mktemp("generated")
    config = make_random_checkpoint(directory / "ckpt", EngramConfig.from_name("deepseek-v4.1-flash").scaled(1e-3),
                                    seed=5, progress=False)
    index_checkpoint(directory / "ckpt", config, progress=False)
    table = convert_checkpoint(directory / "ckpt", directory / "v41.table", config, progress=False)
    return directory / "ckpt", np.concatenate(list(random_rows(config, 5))), table


def _opened(path, tier, **options):
    """``open_table``, the pinned tier's warning expected on a machine without CUDA."""
    warns = pytest.warns(RuntimeWarning, match="pinned tier") if "pinned" in str(tier) and not torch.cuda.is_available() \
        else contextlib.nullcontext()
    with warns:
        return open_table(path, tier, **options)


def _skip(tier, options, directory):
    if tier == "direct" and direct_io_refused(directory):
        pytest.skip(f"O_DIRECT refused on {directory}")
    if options.get("engine") == "uring" and not uring_available():
        pytest.skip("native io_uring helper not available")


def _edge_rows(path) -> np.ndarray:
    """Rows at the edges of what a reader plans: each layer's first and last, a row straddling two
    pages of each layer's values, rows on the shards' first and last Engram pages."""
    header = read_header(path)
    ck = header.checkpoint
    ids = []
    for layer, base in zip(ck.config.layer_ids, ck.config.layer_row_bases):
        values = ck.parts[layer][0]
        rows = ck.config.rows_per_layer[layer]
        ids += [base, base + rows - 1]
        straddle = [r for r in range(min(rows, 64)) if (values.offset + r * values.row_bytes) % PAGE + values.row_bytes > PAGE]
        ids += [base + r for r in straddle[:2]]
    return np.unique(np.array(ids, np.int64))


@pytest.mark.parametrize("tier,options", TIERS, ids=TIER_IDS)
def test_every_tier_serves_the_tiny_checkpoints_rows_bit_identical(tiny, tier, options, shm_dir):
    path, raw = tiny
    _skip(tier, options, path)
    extra = {"shm_dir": shm_dir} if tier in ("shared", "direct") else {}
    with _opened(path, tier, **options, **extra) as store:
        assert store.num_rows == len(raw)
        np.testing.assert_array_equal(store.read_raw(np.arange(store.num_rows)).numpy(), raw)
        np.testing.assert_array_equal(store.read_raw(np.arange(store.num_rows)[::-7]).numpy(), raw[::-7])


@pytest.mark.parametrize("tier,options", TIERS, ids=TIER_IDS)
def test_every_tier_serves_a_generated_checkpoint_as_its_converted_table(larger, tier, options, shm_dir):
    path, raw, table = larger
    _skip(tier, options, path)
    extra = {"shm_dir": shm_dir} if tier in ("shared", "direct") else {}
    rng = np.random.default_rng(len(tier) + len(options))
    ids = np.concatenate([_edge_rows(path), rng.integers(0, len(raw), 20_000)])
    with _opened(path, tier, **options, **extra) as store, open_table(table, "mmap") as converted:
        got = store.read_raw(ids).numpy()
        np.testing.assert_array_equal(got, raw[ids])
        np.testing.assert_array_equal(got, converted.read_raw(ids).numpy())


def test_a_checkpoint_is_the_table_convert_writes(larger):
    """Same layout, page sums and fingerprint: a shared segment, row server or pool of either serves the other."""
    path, _, table = larger
    ours, theirs = read_header(path), read_header(table)
    assert ours.layout == theirs.layout and ours.fingerprint() == theirs.fingerprint()
    np.testing.assert_array_equal(ours.page_sums, theirs.page_sums)
    assert read_header(path / "engram-offload.index").fingerprint() == ours.fingerprint()


def test_shared_first_loader_then_attacher_and_a_segment_of_the_converted_table(larger, shm_dir):
    path, raw, table = larger
    ids = np.arange(0, len(raw), 37)
    with open_table(path, "shared", shm_dir=shm_dir) as first, open_table(path, "shared", shm_dir=shm_dir) as later, \
            open_table(table, "shared", shm_dir=shm_dir) as converted:
        assert first.tier.loaded and not later.tier.loaded and not converted.tier.loaded
        for store in (first, later, converted):
            np.testing.assert_array_equal(store.read_raw(ids).numpy(), raw[ids])


@pytest.mark.parametrize("spec", ["1=memory/14=direct", "1=mmap/14=pinned", "1=shared/14=memory"])
def test_per_layer_placements_of_a_checkpoint(larger, spec, shm_dir):
    path, raw, _ = larger
    _skip("direct", {}, path)
    ids = np.concatenate([_edge_rows(path), np.random.default_rng(1).integers(0, len(raw), 5000)])
    with _opened(path, spec, cache_bytes=1 << 20, **({"shm_dir": shm_dir} if "shared" in spec or "direct" in spec
                                                     else {})) as store:
        assert isinstance(store, LayeredStore)
        np.testing.assert_array_equal(store.read_raw(ids).numpy(), raw[ids])


@pytest.mark.parametrize("tier", ["memory", "pinned"])
def test_a_ranks_share_of_a_checkpoint_holds_only_its_columns_rows(larger, tier):
    path, raw, _ = larger
    config = read_header(path).config
    for rank in range(4):
        columns = shard_columns(config, rank, 4)
        span = np.concatenate([np.arange(lo, hi) for lo, hi in shard_rows(config, columns).ranges.tolist()])
        with _opened(path, tier, columns=columns) as store:
            assert store.stats()["dram_bytes"] < len(raw) * config.row_bytes / 3
            np.testing.assert_array_equal(store.read_raw(span).numpy(), raw[span])


def test_the_row_server_serves_a_checkpoint(tiny, tmp_path):
    from engram_offload.serving.rowserver import RowClient

    from row_servers import serving

    path, raw = tiny
    _skip("direct", {}, path)
    sockets = Path(tmp_path.name)  # Unix socket paths are short: a folder of /tmp
    folder = Path("/tmp") / f"ck-{os.getpid()}-{sockets}"
    folder.mkdir()
    try:
        with serving(path, folder / "rows.sock", store=open_table(path, "direct", cache_bytes=64 * raw.shape[1],
                                                                  scales="memory")), \
                RowClient(folder / "rows.sock") as client:
            np.testing.assert_array_equal(client.read_raw(np.arange(len(raw))).numpy(), raw)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------- refusals
def _copy(source: Path, target: Path) -> Path:
    """A copy of an indexed checkpoint that is its own (indexed again there)."""
    shutil.copytree(source, target, copy_function=shutil.copy2)
    (target / "engram-offload.index").unlink()
    index_checkpoint(target, read_header(source).config, progress=False)
    return target


def _damage(shard: Path, at: int) -> None:
    """Flip a byte of ``shard`` at ``at``, keeping its size and mtime (as a bad sector would)."""
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("tier,options", [("memory", {}), ("mmap", {}), ("direct", {"engine": "threads", "scales": "read"}),
                                          ("direct", {"engine": "uring", "scales": "memory"})],
                         ids=["memory", "mmap", "threads", "uring"])
def test_a_damaged_page_is_never_served(tiny, tmp_path, tier, options):
    path = _copy(tiny[0], tmp_path / "ckpt")
    _skip(tier, options, path)
    ck = read_header(path).checkpoint
    values = ck.parts[3][0]  # layer 3's values: its row 100, on a page of its own
    _damage(ck.shards[values.shard], values.offset + 100 * values.row_bytes + 3)
    base = ck.config.layer_row_base(3)
    match = rf"{ck.shards[values.shard]}: the page at byte 8,192 \({values.tensor} rows 97..161\) does not match the checksum"
    with pytest.raises(ChecksumError, match=match):
        with open_table(path, tier, **options) as store:
            store.read_raw([base + 100])


def test_a_shard_changed_since_indexing_is_refused_at_open(tiny, tmp_path):
    path = _copy(tiny[0], tmp_path / "ckpt")
    shard = read_header(path).checkpoint.shards[1]
    os.utime(shard, ns=(0, os.stat(shard).st_mtime_ns + 1))
    for opened in (path, path / "engram-offload.index"):
        with pytest.raises(TableFormatError, match=rf"^{shard} is not the shard indexed in .*: index it again with "
                                                   rf"engram-offload index {path}$"):
            open_table(opened, "mmap")


def test_a_sidecar_others_may_write_is_refused(tiny, tmp_path):
    path = _copy(tiny[0], tmp_path / "ckpt")
    sidecar = path / "engram-offload.index"
    assert os.stat(sidecar).st_mode & 0o022 == 0  # written closed to others whatever the umask
    os.chmod(sidecar, 0o664)
    with pytest.raises(TableFormatError, match=r"is mode 0664: other users may write it"):
        open_table(path, "mmap")


def _first_byte(path: str) -> int:
    with open_table(path, "mmap") as store:
        return int(store.read_raw([0]).numpy()[0, 0])


@needs_root
def test_a_sidecar_of_another_uid_is_refused(tiny):
    """A sidecar another local user wrote is never believed (root's is: root is trusted)."""
    folder = Path(tempfile.mkdtemp(prefix="engram-ckpt-"))  # every local user may read it
    try:
        folder.chmod(0o755)
        path = _copy(tiny[0], folder / "ckpt")
        for shard in path.glob("*.safetensors"):
            shard.chmod(0o644)
        theirs = folder / "theirs"
        theirs.mkdir()
        os.chown(theirs, NOBODY, NOBODY)

        def index_as_them() -> str:
            return str(index_checkpoint(path, read_header(path).config, theirs / "their.index", progress=False)[0])

        kind, sidecar = in_child(index_as_them)
        assert kind == "ok", sidecar
        with pytest.raises(TableFormatError, match=rf"belongs to uid {NOBODY}, not to this process's uid 0 or root"):
            open_table(sidecar, "mmap")
        assert in_child(_first_byte, str(path)) == ("ok", int(tiny[1][0, 0]))  # root's sidecar, read by them
    finally:
        shutil.rmtree(folder, ignore_errors=True)
