"""Tests for the io_uring batched reader (engram_offload.tiers.uring)."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram_offload._native import native_disabled
from engram_offload.tiers import uring

needs_native = pytest.mark.skipif(
    not uring.available(), reason=f"io_uring helper unavailable: {uring.unavailable_reason()}"
)


def native(f):
    """Marks a test as needing the compiled helper; skipped cleanly without it."""
    return pytest.mark.native(needs_native(f))


FILE_SIZE = 4 * 1024 * 1024 + 1000  # deliberately not a multiple of 4096
ALIGN = 4096


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 array of nbytes whose base address is a multiple of align."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    out = raw[start : start + nbytes]
    assert out.ctypes.data % align == 0
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    path = tmp_path_factory.mktemp("uring") / "table.bin"
    payload = np.random.default_rng(1234).integers(0, 256, FILE_SIZE, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    return str(path), payload


@pytest.fixture()
def buffered_fd(data_file: tuple[str, bytes]):
    fd = os.open(data_file[0], os.O_RDONLY)
    yield fd
    os.close(fd)


@pytest.fixture()
def direct_fd(data_file: tuple[str, bytes]):
    try:
        fd = os.open(data_file[0], os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip("O_DIRECT not supported by the filesystem holding tmp_path (tmpfs?)")
        raise
    yield fd
    os.close(fd)


def test_available_is_cached_and_consistent() -> None:
    assert uring.available() == uring.available()
    assert (uring.unavailable_reason() is None) == uring.available()


@pytest.mark.parametrize("value,disabled", [(None, False), ("", False), ("0", False), ("1", True),
                                            ("yes", True), ("false", True)])
def test_one_reading_of_the_no_native_switch(monkeypatch: pytest.MonkeyPatch, value, disabled) -> None:
    if value is None:
        monkeypatch.delenv("ENGRAM_OFFLOAD_NO_NATIVE", raising=False)
    else:
        monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", value)
    assert native_disabled() is disabled
    if disabled:
        assert uring.available() is False


def test_env_var_disables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    assert uring.available() is False
    assert "ENGRAM_OFFLOAD_NO_NATIVE" in (uring.unavailable_reason() or "")
    with pytest.raises(RuntimeError):
        uring.UringReader(0)
    monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "0")  # "0" means: not disabled
    assert uring.available() == (uring.unavailable_reason() is None)


@native
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reads=st.lists(
        st.tuples(st.integers(0, FILE_SIZE - 1), st.integers(1, 20000)), min_size=0, max_size=300
    ),
    queue_depth=st.sampled_from([1, 2, 7, 32, 128]),
    scalar_length=st.booleans(),
)
def test_buffered_random_reads_match_pread(
    data_file: tuple[str, bytes], buffered_fd: int, reads, queue_depth: int, scalar_length: bool
) -> None:
    payload = data_file[1]
    offsets = np.array([o for o, _ in reads], dtype=np.int64)
    lengths = np.array([min(n, FILE_SIZE - o) for o, n in reads], dtype=np.int64)
    if scalar_length:
        # One length for all reads; keep every read inside the file.
        length = 513
        offsets = np.minimum(offsets, FILE_SIZE - length)
        lengths = np.full(len(offsets), length, dtype=np.int64)
    dest_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(reads) else np.zeros(0, np.int64)
    dest = np.full(int(lengths.sum()) + 7, 0xAB, dtype=np.uint8)
    with uring.UringReader(buffered_fd, queue_depth=queue_depth) as reader:
        reader.read(offsets, 513 if scalar_length else lengths, dest, dest_offsets)
    for o, n, d in zip(offsets, lengths, dest_offsets):
        assert dest[d : d + n].tobytes() == os.pread(buffered_fd, int(n), int(o))
        assert dest[d : d + n].tobytes() == payload[o : o + n]
    assert (dest[-7:] == 0xAB).all()  # nothing written past the requested ranges


@native
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    blocks=st.lists(st.integers(0, FILE_SIZE // 512 - 8), min_size=1, max_size=500),
    sectors=st.sampled_from([1, 2, 8]),
)
def test_direct_aligned_reads_match_pread(
    data_file: tuple[str, bytes], direct_fd: int, blocks, sectors: int
) -> None:
    payload = data_file[1]
    length = 512 * sectors
    # Logical block size may be 4096 on some devices; align to 4096 for safety.
    offsets = (np.array(blocks, dtype=np.int64) * 512) // ALIGN * ALIGN
    dest = aligned_empty(len(blocks) * ALIGN)
    dest_offsets = np.arange(len(blocks), dtype=np.int64) * ALIGN
    with uring.UringReader(direct_fd, queue_depth=64) as reader:
        reader.read(offsets, length, dest, dest_offsets)
    for i, o in enumerate(offsets):
        assert dest[i * ALIGN : i * ALIGN + length].tobytes() == payload[o : o + length]


@native
def test_duplicates_and_overlapping_destinations(data_file: tuple[str, bytes], buffered_fd: int) -> None:
    payload = data_file[1]
    offsets = np.array([100, 100, 100, 5000, 100], dtype=np.int64)
    dest = np.zeros(5 * 264, dtype=np.uint8)
    dest_offsets = np.arange(5, dtype=np.int64) * 264
    with uring.UringReader(buffered_fd) as reader:
        reader.read(offsets, 264, dest, dest_offsets)
        for i, o in enumerate(offsets):
            assert dest[i * 264 : (i + 1) * 264].tobytes() == payload[o : o + 264]
        # Same destination for every read: the result is one full copy.
        dest2 = np.zeros(264, dtype=np.uint8)
        reader.read(np.full(50, 777, dtype=np.int64), 264, dest2, np.zeros(50, dtype=np.int64))
        assert dest2.tobytes() == payload[777 : 777 + 264]


@native
def test_large_batch_more_than_queue_depth(data_file: tuple[str, bytes], direct_fd: int) -> None:
    payload = np.frombuffer(data_file[1], dtype=np.uint8)
    n = 5000
    rng = np.random.default_rng(7)
    offsets = rng.integers(0, FILE_SIZE // ALIGN - 1, n).astype(np.int64) * ALIGN
    dest = aligned_empty(n * ALIGN)
    with uring.UringReader(direct_fd, queue_depth=128) as reader:
        reader.read(offsets, ALIGN, dest, np.arange(n, dtype=np.int64) * ALIGN)
        # Batched: far fewer syscalls than reads.
        assert reader.syscalls < n // 8
    expected = payload[(offsets[:, None] + np.arange(ALIGN)[None, :])].reshape(-1)
    assert np.array_equal(dest, expected)


@native
def test_empty_batch_and_zero_length(buffered_fd: int) -> None:
    dest = np.zeros(10, dtype=np.uint8)
    with uring.UringReader(buffered_fd) as reader:
        reader.read(np.zeros(0, np.int64), 0, dest, np.zeros(0, np.int64))
        reader.read(np.array([5], np.int64), np.array([0], np.int64), dest, np.array([10], np.int64))
    assert (dest == 0).all()


@native
@pytest.mark.parametrize(
    "offsets, lengths, dest_offsets",
    [
        ([0], [11], [0]),  # one byte too many
        ([0], [1], [10]),  # starts at the end
        ([0], [4], [-1]),  # negative dest offset
        ([-4096], [4], [0]),  # negative file offset
        ([0], [-1], [0]),  # negative length
        ([0, 0], [1, 1], [0, 2**62]),  # huge dest offset (overflow guard)
    ],
)
def test_bounds_errors_raise_value_error(buffered_fd: int, offsets, lengths, dest_offsets) -> None:
    dest = np.full(10, 0x5A, dtype=np.uint8)
    with uring.UringReader(buffered_fd) as reader:
        with pytest.raises(ValueError):
            reader.read(np.array(offsets, np.int64), np.array(lengths, np.int64), dest,
                        np.array(dest_offsets, np.int64))
    assert (dest == 0x5A).all()  # nothing was read


@native
def test_shape_and_type_errors(buffered_fd: int) -> None:
    dest = np.zeros(100, dtype=np.uint8)
    with uring.UringReader(buffered_fd) as reader:
        with pytest.raises(ValueError):
            reader.read(np.zeros(3, np.int64), 1, dest, np.zeros(2, np.int64))
        with pytest.raises(ValueError):
            reader.read(np.zeros(3, np.int64), np.ones(2, np.int64), dest, np.zeros(3, np.int64))
        with pytest.raises((TypeError, ValueError, BufferError)):
            reader.read(np.zeros(1, np.int64), 1, b"readonly", np.zeros(1, np.int64))


@native
def test_read_past_eof_raises(data_file: tuple[str, bytes], buffered_fd: int) -> None:
    dest = np.zeros(4096, dtype=np.uint8)
    with uring.UringReader(buffered_fd) as reader:
        # Starts inside the file, ends past EOF: short read, then 0 bytes.
        with pytest.raises(OSError) as info:
            reader.read(np.array([FILE_SIZE - 100], np.int64), 200, dest, np.zeros(1, np.int64))
        assert info.value.errno == errno.EIO
        assert str(FILE_SIZE - 100) in str(info.value) and "end of file" in str(info.value)
        # Entirely past EOF.
        with pytest.raises(OSError, match="end of file"):
            reader.read(np.array([0, FILE_SIZE + 4096], np.int64), 64, dest,
                        np.array([0, 64], np.int64))
        # The reader is still usable afterwards.
        reader.read(np.array([10], np.int64), 64, dest, np.zeros(1, np.int64))
        assert dest[:64].tobytes() == data_file[1][10:74]


@native
def test_direct_read_past_eof_raises(direct_fd: int) -> None:
    dest = aligned_empty(2 * ALIGN)
    last_block = FILE_SIZE // ALIGN * ALIGN  # holds the final 1000 bytes
    with uring.UringReader(direct_fd) as reader:
        with pytest.raises(OSError, match="end of file"):
            reader.read(np.array([last_block], np.int64), ALIGN, dest, np.zeros(1, np.int64))


@native
def test_direct_misaligned_raises_einval(direct_fd: int) -> None:
    dest = aligned_empty(2 * ALIGN)
    with uring.UringReader(direct_fd) as reader:
        with pytest.raises(OSError) as info:
            reader.read(np.array([1], np.int64), 512, dest, np.zeros(1, np.int64))
        assert info.value.errno == errno.EINVAL
        assert "offset 1 " in str(info.value)


@native
def test_bad_fd_raises_ebadf(data_file: tuple[str, bytes]) -> None:
    with pytest.raises(OSError) as info:
        uring.UringReader(987654)
    assert info.value.errno == errno.EBADF
    # A descriptor closed after the reader was created fails at read time.
    fd = os.open(data_file[0], os.O_RDONLY)
    reader = uring.UringReader(fd)
    os.close(fd)
    dest = np.zeros(64, dtype=np.uint8)
    with pytest.raises(OSError) as info:
        reader.read(np.arange(300, dtype=np.int64), 1, dest, np.zeros(300, np.int64))
    assert info.value.errno == errno.EBADF
    reader.close()


@native
def test_close_is_idempotent_and_blocks_reads(buffered_fd: int) -> None:
    reader = uring.UringReader(buffered_fd, queue_depth=8)
    assert reader.queue_depth == 8 and not reader.closed
    reader.close()
    reader.close()
    assert reader.closed
    with pytest.raises(ValueError):
        reader.read(np.zeros(1, np.int64), 1, np.zeros(1, np.uint8), np.zeros(1, np.int64))


@native
def test_threads_share_one_reader(data_file: tuple[str, bytes], buffered_fd: int) -> None:
    payload = data_file[1]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                offs = rng.integers(0, FILE_SIZE - 264, 200).astype(np.int64)
                dest = np.empty(200 * 264, dtype=np.uint8)
                reader.read(offs, 264, dest, np.arange(200, dtype=np.int64) * 264)
                for i in range(0, 200, 37):
                    assert dest[i * 264 : (i + 1) * 264].tobytes() == payload[offs[i] : offs[i] + 264]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with uring.UringReader(buffered_fd, queue_depth=16) as reader:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors


@native
def test_a_descriptor_number_reused_for_another_file_reads_that_file(data_file: tuple[str, bytes], tmp_path) -> None:
    """The ring registers the file it reads: a number closed and given to another file (the
    same number, another file) must read the new file, never the one registered before."""
    other = tmp_path / "other.bin"
    other_payload = bytes(reversed(data_file[1]))
    other.write_bytes(other_payload)
    fd = os.open(data_file[0], os.O_RDONLY)
    offsets, lengths = np.array([0, 70_000], np.int64), np.array([5000, 300], np.int64)
    dest_offsets = np.array([0, 5000], np.int64)
    try:
        with uring.UringReader(fd, 8) as reader:
            for path, payload in ((data_file[0], data_file[1]), (str(other), other_payload),
                                  (data_file[0], data_file[1])):
                replacement = os.open(path, os.O_RDONLY)
                os.dup2(replacement, fd)  # fd now names `path`'s file
                os.close(replacement)
                dest = np.zeros(5300, np.uint8)
                reader.read(offsets, lengths, dest, dest_offsets)
                assert reader.fixed_file
                assert dest[:5000].tobytes() == payload[:5000]
                assert dest[5000:].tobytes() == payload[70_000:70_300]
    finally:
        os.close(fd)
