"""A resident layer's window when the table ends inside a page: capped at the table's rows."""

from __future__ import annotations

import numpy as np
import torch

from engram_offload import open_table, write_table
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.rows import encode_rows
from engram_offload.serving.layered import dram_bytes, window_header
from engram_offload.table import read_header


def test_the_last_layers_window_stops_at_the_tables_last_row(tmp_path):
    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(1.9e-5)  # 21,622 rows: 7 in the last page
    header_rows = config.num_rows
    x = torch.randn(header_rows, config.head_dim)  # [rows, 256]
    path = write_table(tmp_path / "v41.tbl", config, x)
    raw = encode_rows(x, config.row_format).numpy()
    layout = read_header(path).layout
    assert header_rows % layout.rows_per_page  # the table ends inside a page
    first, last = config.layer_ids
    start = config.layer_row_base(last)
    window = window_header(read_header(path), start, header_rows)
    assert window.first_row + window.layout.num_rows == header_rows  # no row past the table's
    with open_table(path, {first: "direct", last: "memory"}) as store:
        resident = store.layers[1].resident
        assert resident.num_rows == header_rows - window.first_row
        assert dram_bytes(store) == resident.num_rows * config.row_bytes
        ids = np.arange(header_rows - 20, header_rows, dtype=np.int64)  # the last rows, the partial page's too
        assert np.array_equal(store.read_raw(ids).numpy(), raw[ids])
