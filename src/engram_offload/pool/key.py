"""The operator's pool key file: the Redis password and the secret that keys the row checksums.

One 0600 file of the operator's, ``$ENGRAM_OFFLOAD_POOL_KEY`` or else
``$XDG_CONFIG_HOME/engram-offload/pool.key`` (``~/.config/engram-offload/pool.key``), of
two lines::

    password <the pool's Redis password>
    key <64 hex digits: the row key>

``pool serve`` and ``pool publish`` write one when there is none; the clients (``pool
status``, the remote tier and so the plugins) read it. It is believed only when it is a
regular file opened without following a link, owned by this uid, closed to all others,
and at most 4 KiB.

With the row key a row's checksum is a MAC (``PoolKey.row_tags``, a PMAC): the row's
16-byte blocks, after a block of the table's fingerprint and the row id, each XORed with
a secret mask of its position, are encrypted with AES-128; their 64-bit words are summed,
and the sum encrypted again with a second key. Without the key no one can compute the
checksum of a row, so rows written by someone who lacks it fail their check. AES is
OpenSSL's (the ``libcrypto`` Python's ``hashlib`` uses): one call encrypts a request's
blocks, off the GIL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from ..errors import TierError

__all__ = ["KEY_ENV", "PoolKey", "PoolKeyError", "key_path", "load_key", "read_key_password"]

KEY_ENV = "ENGRAM_OFFLOAD_POOL_KEY"  # the key file's path, when not the default one
MAX_KEY_FILE_BYTES = 4096
CHUNK_ROWS = 4096  # rows a row_tags step encrypts at once
PASSWORD = re.compile(r"[!#-&(-\[\]-~]{1,512}")  # printable ASCII without spaces, quotes or backslashes


class PoolKeyError(TierError):
    """The pool key file is missing, or not to be believed."""


def key_path() -> Path:
    """The key file: ``$ENGRAM_OFFLOAD_POOL_KEY``, else ``engram-offload/pool.key`` in
    ``$XDG_CONFIG_HOME`` (``~/.config``)."""
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV])
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "engram-offload" / "pool.key"


@dataclass(frozen=True)
class PoolKey:
    """The pool's password (None: none) and the row key (32 bytes) from a key file."""

    password: str | None = field(repr=False)
    secret: bytes = field(repr=False)
    path: Path | None = None

    def _derive(self, purpose: bytes, size: int = 16) -> bytes:
        return hashlib.blake2b(purpose, key=self.secret, digest_size=size, person=b"engram-pool").digest()

    @cached_property
    def _aes_keys(self) -> tuple[bytes, bytes]:
        return self._derive(b"blocks"), self._derive(b"final")

    def row_tags(self, data, row_bytes: int, stride: int, fp: str, ids: np.ndarray) -> np.ndarray:
        """The MAC (uint64 ``[n]``) of the ``row_bytes``-byte row at the start of each
        ``stride`` bytes of ``data``, as rows ``ids`` of table ``fp``."""
        view = memoryview(data).cast("B")
        n = len(view) // stride
        rows = np.ndarray((n, row_bytes), np.uint8, view, 0, (stride, 1))
        ids = np.asarray(ids)
        masks = _masks(self.secret, row_bytes)
        first, final = self._aes_keys
        tags = np.zeros((n, 2), "<u8")
        for start in range(0, n, CHUNK_ROWS):
            count = min(CHUNK_ROWS, n - start)
            blocks = _scratch(count * masks.shape[1]).reshape(count, -1)  # a header block, the row's blocks
            head = blocks[:, :16].view("<u8")
            head[:, 0] = int(fp, 16)
            head[:, 1] = ids[start: start + count]
            blocks[:, 16: 16 + row_bytes] = rows[start: start + count]
            blocks[:, 16 + row_bytes:] = 0
            blocks ^= masks[:count]
            _aes_ecb(first, blocks)
            tags[start: start + count, 0] = np.einsum("ij->i", blocks.view("<u8"))  # their sum, mod 2^64
        _aes_ecb(final, tags)
        return tags[:, 0]

    def record_tag(self, *parts: bytes) -> str:
        """A MAC of ``parts`` (hex): binds the pool's meta keys to the key."""
        mac = hashlib.blake2b(key=self._derive(b"records", 32), digest_size=16)
        for part in parts:
            mac.update(len(part).to_bytes(8, "little"))
            mac.update(part)
        return mac.hexdigest()


@lru_cache(maxsize=8)
def _masks(secret: bytes, row_bytes: int) -> np.ndarray:
    """Each block position's secret mask for rows of ``row_bytes``, the header block's
    first, repeated for ``CHUNK_ROWS`` rows (uint8 ``[CHUNK_ROWS, 16 + row_bytes rounded up to 16]``)."""
    size = 16 + -(-row_bytes // 16) * 16
    data = hashlib.shake_256(b"engram-pool masks" + row_bytes.to_bytes(8, "little") + secret).digest(size)
    masks = np.tile(np.frombuffer(data, np.uint8), (CHUNK_ROWS, 1))
    masks.flags.writeable = False
    return masks


_local = threading.local()


def _scratch(size: int) -> np.ndarray:
    """This thread's scratch buffer (uint8 ``[size]``): kept, as a fresh one costs its page faults."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < size:
        buf = _local.buf = np.empty(size, np.uint8)
    return buf[:size]


def load_key(path: str | os.PathLike | None = None, *, create: bool = False) -> PoolKey:
    """The key file at ``path`` (default ``key_path()``), checked; with ``create``, a new
    one (a generated password and row key, mode 0600) when there is none."""
    path = Path(path) if path is not None else key_path()
    try:
        return _read(path)
    except FileNotFoundError:
        if not create:
            raise PoolKeyError(f"no pool key file at {path}: the row checks need the publisher's; copy it here "
                            f"(mode 0600) or set {KEY_ENV} to its path") from None
    _write_new(path)
    return _read(path)


def read_key_password(path: Path | None = None) -> str | None:
    """The password in the key file, or None when there is no key file."""
    try:
        return _read(path or key_path()).password
    except FileNotFoundError:
        return None


def _read(path: Path) -> PoolKey:
    """The checked key file at ``path``; ``FileNotFoundError`` when there is none."""
    fix = f"remove it to have a new one written, or set {KEY_ENV} to another file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        what = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        raise PoolKeyError(f"the pool key file {path} {what}: give the path of a regular file of yours") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PoolKeyError(f"the pool key file {path} is not a regular file: give the path of the key file itself")
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise PoolKeyError(f"the pool key file {path} must be yours and closed to other users (owner uid "
                            f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}): chown it and chmod 600 {path}")
        data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise PoolKeyError(f"the pool key file {path} is larger than {MAX_KEY_FILE_BYTES} bytes, so not a key file: {fix}")
    fields: dict[str, str] = {}
    for line in data.decode(errors="replace").splitlines():
        name, _, value = line.strip().partition(" ")
        if name and not name.startswith("#"):
            fields[name] = value.strip()
    password, secret = fields.pop("password", None), fields.pop("key", "")
    if fields or not re.fullmatch(r"[0-9a-f]{64}", secret) or (password is not None and not PASSWORD.fullmatch(password)):
        raise PoolKeyError(f"the pool key file {path} is not 'password WORD' and 'key <64 hex digits>' lines (a password: "
                        f"1-512 printable characters, no spaces or quotes): {fix}")
    return PoolKey(password, bytes.fromhex(secret), path)


def _write_new(path: Path) -> None:
    """Write a new key file at ``path`` (mode 0600), atomically: when another process wrote
    one first, that one stays."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = f"password {secrets.token_urlsafe(24)}\nkey {secrets.token_hex(32)}\n"
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.link(temp, path)
    except FileExistsError:
        pass
    finally:
        temp.unlink(missing_ok=True)


# -- AES-128 from OpenSSL's libcrypto ------------------------------------------------------------
@lru_cache(maxsize=1)
def _libcrypto() -> ctypes.CDLL:
    import _hashlib  # noqa: F401  (loads the libcrypto that Python itself uses)

    with open("/proc/self/maps") as maps:
        loaded = next((line.split()[-1] for line in maps if "/libcrypto" in line), None)
    name = loaded or ctypes.util.find_library("crypto")
    if name is None:
        raise RuntimeError("the pool's row checks need OpenSSL's libcrypto, which is not installed: install OpenSSL")
    lib = ctypes.CDLL(name)
    vp, c_int = ctypes.c_void_p, ctypes.c_int
    lib.EVP_CIPHER_CTX_new.restype = vp
    lib.EVP_aes_128_ecb.restype = vp
    lib.EVP_CIPHER_CTX_free.argtypes = [vp]
    lib.EVP_EncryptInit_ex.argtypes = [vp, vp, vp, ctypes.c_char_p, vp]
    lib.EVP_CIPHER_CTX_set_padding.argtypes = [vp, c_int]
    lib.EVP_EncryptUpdate.argtypes = [vp, vp, ctypes.POINTER(c_int), vp, c_int]
    return lib


def _aes_ecb(key: bytes, blocks: np.ndarray) -> None:
    """Encrypt ``blocks`` (C-contiguous, whole 16-byte blocks) in place, each block alone."""
    lib = _libcrypto()
    ctx = lib.EVP_CIPHER_CTX_new()
    if not ctx:
        raise MemoryError("OpenSSL could not allocate a cipher context")
    try:
        done = ctypes.c_int()
        ok = lib.EVP_EncryptInit_ex(ctx, lib.EVP_aes_128_ecb(), None, key, None) == 1
        ok = ok and lib.EVP_CIPHER_CTX_set_padding(ctx, 0) == 1
        base, size, step = blocks.ctypes.data, blocks.nbytes, 1 << 30
        for start in range(0, size, step):
            count = min(step, size - start)
            ok = ok and lib.EVP_EncryptUpdate(ctx, base + start, ctypes.byref(done), base + start, count) == 1
        if not ok:
            raise RuntimeError("OpenSSL's AES-128 failed: check the OpenSSL installation")
    finally:
        lib.EVP_CIPHER_CTX_free(ctx)
