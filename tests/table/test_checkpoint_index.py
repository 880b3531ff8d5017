"""``engram-offload index``: a checkpoint's sidecar, the checkpoint opened as its converted table,
``verify`` of a checkpoint, and what is refused (a damaged sidecar or shard, another folder's
sidecar, bytes that are not the table's rows)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from engram_offload import cli, open_table
from engram_offload.engram.config import EngramConfig
from engram_offload.errors import TableFormatError
from engram_offload.table.checkpoint import index_checkpoint
from engram_offload.table.format import read_header
from engram_offload.table.generate import make_random_checkpoint, make_random_table
from engram_offload.table.stream import PAGE

from released_checkpoint import table_rows, write_released_checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    ck = write_released_checkpoint(tmp_path / "ckpt")
    return ck.path, table_rows(ck)


def test_index_then_the_folder_opens_as_the_converted_table(checkpoint, tmp_path, capsys):
    path, raw = checkpoint
    assert cli.main(["index", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {path / 'engram-offload.index'}: 620 rows in {path}") and "/s); open" in out
    assert cli.main(["convert", str(path), "--out", str(tmp_path / "t.table"), "--no-progress"]) == 0
    ours, table = read_header(path), read_header(tmp_path / "t.table")
    assert ours.fingerprint() == table.fingerprint() and ours.layout == table.layout
    assert os.path.getsize(path / "engram-offload.index") < 2 * 4096  # small: a few sums a page
    with open_table(path, "mmap") as store:
        np.testing.assert_array_equal(store.read_raw(np.arange(len(raw))).numpy(), raw)


def test_index_elsewhere_and_open_the_sidecar(checkpoint, tmp_path, capsys):
    path, raw = checkpoint
    sidecar = tmp_path / "index" / "v41.index"
    sidecar.parent.mkdir()
    assert cli.main(["index", str(path), "--out", str(sidecar), "--no-progress"]) == 0
    assert f"open {sidecar} as the table" in capsys.readouterr().out
    with open_table(sidecar, "memory") as store:
        np.testing.assert_array_equal(store.tier.rows.numpy(), raw)
    with pytest.raises(FileNotFoundError, match=rf"{path} has no index \(engram-offload.index\): run engram-offload "
                                                rf"index {path} once"):
        open_table(path, "mmap")


def test_verify_checks_every_engram_page_of_a_checkpoint(checkpoint, capsys):
    path, _ = checkpoint
    index_checkpoint(path, open_header_config(path), progress=False)
    sidecar = path / "engram-offload.index"
    assert cli.main(["verify", str(sidecar), "--no-progress"]) == 0
    assert f"{sidecar}: OK" in capsys.readouterr().out
    ck = read_header(path).checkpoint
    scales = ck.parts[1][1]  # layer 1's scales: a byte of its last page, kept size and mtime
    shard = ck.shards[scales.shard]
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(scales.offset + scales.rows * scales.row_bytes - 1)
        f.write(b"\x01" if f.read(1) != b"\x01" else b"\x02")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cli.main(["verify", str(sidecar), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"FAILED: {shard}: the page at byte 4,096 (layers.1.engram.embed.scale rows 0..271, " \
           "layers.1.engram.embed.weight rows 0..26) does not match the checksum" in err
    assert f"re-index with engram-offload index {path}" in err


def open_header_config(path) -> EngramConfig:
    return EngramConfig.from_hf_config(path / "config.json")


def test_a_damaged_sidecar_is_refused(checkpoint):
    path, _ = checkpoint
    index_checkpoint(path, open_header_config(path), progress=False)
    sidecar = path / "engram-offload.index"
    data = bytearray(sidecar.read_bytes())
    data[-12] ^= 1  # a page sum
    sidecar.write_bytes(bytes(data))
    with pytest.raises(TableFormatError, match="its page checksums are damaged; index the checkpoint again"):
        open_table(path, "mmap")
    sidecar.write_bytes(bytes(data[:-4]))
    with pytest.raises(TableFormatError, match="is truncated or damaged"):
        open_table(path, "mmap")


def test_a_sidecar_moved_with_its_shards_indexes_the_old_folder(checkpoint, tmp_path):
    path, _ = checkpoint
    index_checkpoint(path, open_header_config(path), progress=False)
    moved = tmp_path / "moved"
    shutil.copytree(path, moved, copy_function=shutil.copy2)
    with pytest.raises(TableFormatError, match=rf"indexes {path}, not {moved}: index {moved} again"):
        open_table(moved, "mmap")


def test_what_is_not_the_tables_bytes_needs_convert(tmp_path, capsys):
    ck = write_released_checkpoint(tmp_path / "ckpt")
    config = json.loads((ck.path / "config.json").read_text())
    config["text_config"]["engram_row_format"] = "bf16"
    (ck.path / "config.json").write_text(json.dumps(config))
    assert cli.main(["index", str(ck.path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "layers.1.engram.embed.scale scales a bf16 embedding: convert this checkpoint instead" in err
    assert not (ck.path / "engram-offload.index").exists()
    assert cli.main(["index", str(tmp_path), "--no-progress"]) == 1
    assert f"no config.json in {tmp_path}" in capsys.readouterr().err


def test_index_shows_progress_and_its_rate(checkpoint, capsys):
    path, _ = checkpoint
    index_checkpoint(path, open_header_config(path), progress=True)
    assert "indexing ckpt: 40.0 KiB of 40.0 KiB (100%)" in capsys.readouterr().err


def test_a_generated_checkpoint_holds_the_random_tables_rows(tmp_path):
    """``make_random_checkpoint``: the released layout, straddling rows, scales ending inside a page,
    and the table ``convert`` makes of it is ``make_random_table``'s."""
    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(1e-4)
    read_back = make_random_checkpoint(tmp_path / "ckpt", config, seed=2, progress=False)
    assert read_back.rows_per_layer == config.rows_per_layer and read_back.row_format == "fp8_e4m3_ue8m0"
    index_checkpoint(tmp_path / "ckpt", read_back, progress=False)
    ck = read_header(tmp_path / "ckpt").checkpoint
    for layer in config.layer_ids:
        values, scales = ck.parts[layer]
        assert values.offset % PAGE == 4000 and (scales.offset + scales.rows * scales.row_bytes) % PAGE
    assert cli.main(["convert", str(tmp_path / "ckpt"), "--out", str(tmp_path / "c.table"), "--no-progress"]) == 0
    make_random_table(tmp_path / "r.table", config, seed=2)
    with open_table(tmp_path / "c.table", "memory") as converted, open_table(tmp_path / "r.table", "memory") as made:
        assert torch.equal(converted.tier.rows, made.tier.rows)


def test_every_command_that_takes_a_table_takes_a_checkpoint(checkpoint, capsys):
    """verify of the folder, bench-tier, and a row server whose client checks every row against the shards."""
    import signal
    import tempfile

    from engram_offload.serving.rowserver import RowClient, start_row_server

    path, raw = checkpoint
    index_checkpoint(path, open_header_config(path), progress=False)
    assert cli.main(["verify", str(path), "--no-progress"]) == 0
    assert "engram-offload.index: OK" in capsys.readouterr().out
    assert cli.main(["bench-tier", "--table", str(path), "--tier", "mmap", "--seconds", "0.2", "--batch", "64"]) == 0
    assert "rows/s" in capsys.readouterr().out
    sockets = tempfile.mkdtemp(prefix="ck-", dir="/tmp")  # Unix socket paths are short
    try:
        server = start_row_server(path, f"{sockets}/rows.sock", tier="mmap")
        try:
            with RowClient(f"{sockets}/rows.sock", table=path, verify="all") as client:
                np.testing.assert_array_equal(client.read_raw(np.arange(len(raw))).numpy(), raw)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
