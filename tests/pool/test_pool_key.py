"""The pool key file: written 0600 once, found where documented, and never believed when
another user could have written or read it, or when it is not a small regular file."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from engram_offload.pool.key import KEY_ENV, PoolKeyError, key_path, load_key, read_key_password

HEX = "0123456789abcdef" * 4
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")


def write(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


def refused(path, **options) -> str:
    with pytest.raises(PoolKeyError) as caught:
        load_key(path, **options)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_missing_key_file_is_written_0600_in_a_0700_folder_and_read_back(tmp_path):
    path = tmp_path / "config" / "engram-offload" / "pool.key"
    assert refused(path) == (f"no pool key file at {path}: the row checks need the publisher's; copy it here "
                             f"(mode 0600) or set {KEY_ENV} to its path")
    key = load_key(path, create=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(key.password) >= 24 and len(key.secret) == 32 and key.path == path
    assert load_key(path) == key and load_key(path, create=True) == key  # written once
    assert key.password not in repr(key) and key.secret.hex() not in repr(key)
    assert read_key_password(path) == key.password and read_key_password(tmp_path / "none") is None


def test_the_key_file_is_named_by_the_environment_else_under_the_config_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert key_path() == tmp_path / "xdg" / "engram-offload" / "pool.key"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert key_path() == tmp_path / "home" / ".config" / "engram-offload" / "pool.key"
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "elsewhere.key"))
    assert key_path() == tmp_path / "elsewhere.key"


def test_processes_writing_the_key_file_at_once_all_get_the_same_key(tmp_path):
    path, keys = tmp_path / "pool.key", []
    barrier = threading.Barrier(8)

    def write_one() -> None:
        barrier.wait()
        keys.append(load_key(path, create=True))

    threads = [threading.Thread(target=write_one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(keys) == 8 and len({(k.password, k.secret) for k in keys}) == 1
    assert os.listdir(tmp_path) == ["pool.key"]  # no temporary file left behind


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o700])
def test_a_key_file_other_users_may_read_or_write_is_refused(tmp_path, mode):
    path = write(tmp_path / "pool.key", f"password pw\nkey {HEX}\n", mode)
    if not mode & 0o077:
        assert load_key(path).password == "pw"  # 0700 is the owner's alone
        return
    assert refused(path, create=True) == (f"the pool key file {path} must be yours and closed to other users (owner "
                                          f"uid {os.geteuid()}, mode {mode:04o}): chown it and chmod 600 {path}")


@needs_root
def test_a_key_file_of_another_uid_is_refused_even_where_the_operator_expected_to_write_one(tmp_path):
    """Another user planted a key of its own where the operator's first publish would write
    one (a folder both may write): it is refused, never used."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    path = write(shared / "pool.key", f"password theirs\nkey {HEX}\n")
    os.chown(path, 65534, 65534)
    assert refused(path, create=True).startswith(f"the pool key file {path} must be yours and closed to other users "
                                                 "(owner uid 65534, mode 0600)")


def test_a_link_a_folder_a_fifo_or_an_oversized_file_is_never_believed(tmp_path):
    real = write(tmp_path / "real.key", f"password pw\nkey {HEX}\n")
    (tmp_path / "link.key").symlink_to(real)
    assert refused(tmp_path / "link.key", create=True) == (
        f"the pool key file {tmp_path / 'link.key'} is a symbolic link: give the path of a regular file of yours")
    assert refused(tmp_path, create=True) == (
        f"the pool key file {tmp_path} is not a regular file: give the path of the key file itself")
    os.mkfifo(tmp_path / "fifo.key", 0o600)
    started = time.monotonic()
    assert "is not a regular file" in refused(tmp_path / "fifo.key")
    assert time.monotonic() - started < 5  # no wait for a writer
    for size in (4097, 4 << 20):
        big = write(tmp_path / f"big-{size}.key", "password " + "x" * size + f"\nkey {HEX}\n")
        assert refused(big, create=True) == (
            f"the pool key file {big} is larger than 4096 bytes, so not a key file: remove it to have a new one "
            f"written, or set {KEY_ENV} to another file")


@pytest.mark.parametrize("text", [
    "", "hunter2\n", "password pw\n", f"key {HEX}\n".replace("0", "g"), f"password two words\nkey {HEX}\n",
    f"password \"quoted\"\nkey {HEX}\n", f"password pw\nkey {HEX[:-2]}\n", f"password pw\nkey {HEX}\nuser alice\n",
])
def test_a_key_file_that_is_not_a_password_and_a_key_is_refused(tmp_path, text):
    path = write(tmp_path / "pool.key", text)
    assert refused(path, create=True) == (
        f"the pool key file {path} is not 'password WORD' and 'key <64 hex digits>' lines (a password: 1-512 "
        f"printable characters, no spaces or quotes): remove it to have a new one written, or set {KEY_ENV} to "
        "another file")


def test_a_key_file_may_hold_no_password_and_comments(tmp_path):
    path = write(tmp_path / "pool.key", f"# the pool of rack 7\nkey {HEX}\n")
    key = load_key(path)
    assert key.password is None and key.secret == bytes.fromhex(HEX)
    assert read_key_password(path) is None
