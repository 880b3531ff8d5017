"""``safeio``: an input is opened without blocking and read with a bound; an output replaces
nothing unless forced, and a failed write names its file."""

from __future__ import annotations

import errno
import os
import socket
import threading

import pytest

from engram_offload.table.safeio import open_input, output_path, parse_json, read_input, refuse_existing


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def opened_in_a_thread(fn, *args):
    """``fn(*args)`` in a thread that must end within 30 s (a blocking open would not): what it
    returned or raised."""
    result: list = []

    def run():
        try:
            result.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"{fn.__name__} blocked"
    return result[0]


def test_a_fifo_a_device_a_socket_and_a_folder_are_refused_before_any_read(tmp_path, fifo):
    sock = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
        for path, kind in [(fifo, "a FIFO (named pipe)"), ("/dev/zero", "a character device"), (sock, "a socket"),
                           (tmp_path, "a folder")]:
            got = opened_in_a_thread(read_input, path, "token log")
            assert isinstance(got, ValueError)
            assert str(got) == f"{path} is {kind}, not a regular file: give the token log itself"


def test_a_link_to_a_fifo_is_refused_and_a_link_to_a_file_followed(tmp_path, fifo):
    (tmp_path / "to-pipe").symlink_to(fifo)
    (tmp_path / "file").write_bytes(b"1 2 3")
    (tmp_path / "to-file").symlink_to(tmp_path / "file")
    assert isinstance(opened_in_a_thread(read_input, tmp_path / "to-pipe", "x"), ValueError)
    assert read_input(tmp_path / "to-file", "x") == b"1 2 3"


def test_a_regular_file_reads_blocking_again_and_absent_names_what(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    with open_input(tmp_path / "f", "server file") as f:
        assert os.get_blocking(f.fileno()) and f.read() == b"abc"
    with pytest.raises(FileNotFoundError) as caught:
        open_input(tmp_path / "none", "server file")
    assert str(caught.value) == f"no server file at {tmp_path / 'none'}"


def test_an_input_over_its_bound_is_refused_in_one_line(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 101)
    (tmp_path / "fits").write_bytes(b"x" * 100)
    assert read_input(tmp_path / "fits", "server file", max_bytes=100) == b"x" * 100
    with pytest.raises(ValueError) as caught:
        read_input(tmp_path / "big", "server file", max_bytes=100)
    assert str(caught.value) == f"{tmp_path / 'big'} is over 100 B, the most a server file may hold: give a smaller server file"


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000 + "]" * 100_000, "F nests JSON too deeply to read: give a flat object"),
    (b'{"a": "\xff"}', "F is not UTF-8 text: give a JSON object"),
    ("{x", "F is not valid JSON (Expecting property name enclosed in double quotes, line 1): give a JSON object"),
])
def test_json_that_cannot_be_read_is_one_line(text, message):
    with pytest.raises(ValueError) as caught:
        parse_json(text, "F")
    assert str(caught.value) == message


def test_an_output_never_replaces_a_file_unless_forced(tmp_path):
    out = tmp_path / "out.npy"
    out.write_bytes(b"old")
    with pytest.raises(FileExistsError) as caught:
        refuse_existing(out, False, "trace")
    assert str(caught.value) == f"{out} exists: the trace is not written over it; give another path, or --force to replace it"
    with pytest.raises(FileExistsError):
        with output_path(out, False) as tmp:
            tmp.write_bytes(b"new")
    assert out.read_bytes() == b"old"
    with output_path(out, True) as tmp:
        tmp.write_bytes(b"new")
    assert out.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["out.npy"]


def test_a_write_that_fails_names_the_output(tmp_path, monkeypatch):
    out = tmp_path / "out.npy"
    with pytest.raises(OSError) as caught:
        with output_path(out, False) as tmp:
            with open(tmp, "wb") as f:  # as a full disk fails a write: no file named
                f.write(b"x")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(out))
    assert list(tmp_path.iterdir()) == []
