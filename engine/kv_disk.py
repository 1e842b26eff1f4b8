"""The disk tier's files: one file per KV block, named by the block's prefix-chain hash, LRU by bytes.

No torch: a block's KV arrives as bytes (the host tier's layout) and leaves as bytes. Files are written by one
writer thread and read by one reader thread, so the engine's step never waits on the disk; the index (which
hashes are on disk, oldest first) belongs to the engine thread alone.

File format (``FORMAT_VERSION``): ``MAGIC``, a little-endian u32 header length, a JSON header, the payload.
The header names what the payload is valid for: the model, dtype, block size and tensor layout, the block's
hash and token ids, the payload's length and its CRC-32 (``crc32``; files of earlier builds carry a blake2b
digest under ``blake2b``, still verified). At start-up the index is rebuilt from the
headers; a file whose header does not parse, names another model, dtype, block size or layout, or whose
length disagrees is deleted. The checksum is verified on every read: a corrupt file is deleted and its tokens
are recomputed, never served. The checksum guards against a disk's corruption and torn writes, not against
someone who can write the directory (they could write a matching digest of any kind): CRC-32 runs at several
GB/s where blake2b ran at about one, and a returning 2k-token history (47 MB of bf16 KV) is verified on its
way to the first token.

A read lands in a buffer of its own (``readinto``, no copy through ``bytes``) that the engine copies once into
the host tier's block.

One file per block rather than per chain segment: a block is the unit the pools evict and hit, so a segment
file would be read whole for a partial hit and rewritten when its tail changes; at the block sizes served
here (hundreds of KiB per block in float32) a file's open/close costs little next to its payload.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import struct
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("chatsvc.engine.kv_disk")

FORMAT_VERSION = 1
MAGIC = b"CHATSVKV"
_LEN = struct.Struct("<I")
SUFFIX = ".kvb"
# Room counted for each file's header next to its payload when the tier's bytes are budgeted.
HEADER_ALLOWANCE = 4096

Payload = bytes | bytearray | memoryview


@dataclass(frozen=True)
class BlockFormat:
    """What a block's bytes mean: a file is only valid for a reader whose format is equal."""

    model: str
    dtype: str
    block_size: int
    layout: str  # axis order of the payload, e.g. "layer,kv,head,token,dim"
    shape: tuple[int, ...]
    payload_bytes: int


def encode_header(fmt: BlockFormat, block_hash: bytes, token_ids: tuple[int, ...], checksum: str) -> bytes:
    header = {**asdict(fmt), "version": FORMAT_VERSION, "hash": block_hash.hex(), "tokens": list(token_ids),
              CHECKSUM_KEY: checksum}
    body = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(body)) + body


CHECKSUM_KEY = "crc32"


def checksum(payload: Payload) -> str:
    return f"{zlib.crc32(payload):08x}"


def _blake2b(payload: Payload) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def checksum_matches(header: dict[str, object], payload: Payload) -> bool:
    """Whether the payload is the one the header's checksum was taken of (either kind this format has had)."""
    if CHECKSUM_KEY in header:
        return checksum(payload) == header[CHECKSUM_KEY]
    return "blake2b" in header and _blake2b(payload) == header["blake2b"]


class BadBlockFile(Exception):
    """A block file that must not be served: unreadable, corrupt, truncated or written for another format."""


def read_header(f: BinaryIO, fmt: BlockFormat, file_size: int) -> dict[str, object]:
    """The header of an open block file, checked against ``fmt`` and the file's size; BadBlockFile if not."""
    read = f.read
    if read(len(MAGIC)) != MAGIC:
        raise BadBlockFile("not a block file")
    raw_len = read(_LEN.size)
    if len(raw_len) != _LEN.size:
        raise BadBlockFile("truncated header")
    (length,) = _LEN.unpack(raw_len)
    if length > file_size:
        raise BadBlockFile("truncated header")
    try:
        header = json.loads(read(length))
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadBlockFile(f"header does not parse: {exc}") from exc
    if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
        raise BadBlockFile("another format version")
    for key, want in asdict(fmt).items():
        got = header.get(key)
        if (list(want) if isinstance(want, tuple) else want) != got:
            raise BadBlockFile(f"written for {key}={got!r}, not {want!r}")
    if len(MAGIC) + _LEN.size + length + fmt.payload_bytes != file_size:
        raise BadBlockFile("truncated or overlong payload")
    return header


class DiskStore:
    """The disk tier of one engine: ``directory`` holds at most ``capacity_bytes`` of block files."""

    def __init__(self, directory: str | os.PathLike[str], fmt: BlockFormat, capacity_bytes: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.format = fmt
        self.file_bytes = fmt.payload_bytes + HEADER_ALLOWANCE
        self.capacity_blocks = capacity_bytes // self.file_bytes
        # hash -> token ids, least recently used first. Engine thread only.
        self.index: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        # Payloads handed to the writer and not yet in their file: a read finds them here meanwhile.
        self._pending: dict[bytes, Payload] = {}
        self._failed: list[bytes] = []
        self._warned_full = False
        self.dropped_files = 0
        self.write_failures = 0
        self.written_blocks = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-writer")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")
        self._rebuild_index()

    # -- start-up -------------------------------------------------------------------------------
    def _path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}{SUFFIX}"

    def _rebuild_index(self) -> None:
        for tmp in self.directory.glob(f"*{SUFFIX}.tmp"):  # a write cut short by a crash
            tmp.unlink(missing_ok=True)
        found: list[tuple[float, bytes, tuple[int, ...]]] = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
                with path.open("rb") as f:
                    header = read_header(f, self.format, stat.st_size)
                block_hash = bytes.fromhex(str(header["hash"]))
                tokens = tuple(int(t) for t in header["tokens"])  # type: ignore[attr-defined]
                if path.name != f"{block_hash.hex()}{SUFFIX}" or len(tokens) != self.format.block_size:
                    raise BadBlockFile("name or tokens disagree with the header")
            except (OSError, BadBlockFile, ValueError, TypeError, KeyError) as exc:
                log.warning("dropping KV block file %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                self.dropped_files += 1
                continue
            found.append((stat.st_mtime, block_hash, tokens))
        for _, block_hash, tokens in sorted(found, key=lambda item: item[0]):
            self.index[block_hash] = tokens
        self._trim()

    # -- engine thread --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.index)

    @property
    def num_bytes(self) -> int:
        return len(self.index) * self.file_bytes

    def contains(self, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        return self.index.get(block_hash) == token_ids

    def write(self, block_hash: bytes, token_ids: tuple[int, ...], payload: Payload) -> None:
        """Put a block on disk in the background; it counts as there (and reads find it) at once."""
        if self.capacity_blocks == 0:
            return
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return
        self.index[block_hash] = token_ids
        with self._lock:
            self._pending[block_hash] = payload
        self._writer.submit(self._write_file, block_hash, token_ids)
        self._trim()

    def read(self, block_hash: bytes, token_ids: tuple[int, ...], touch: bool = True) -> Future[bytearray | None]:
        """The block's payload, read in the background; None where the file is gone or bad (then deleted).
        ``touch``: the read counts as a use (the block becomes the disk's most recently used)."""
        if touch and block_hash in self.index:
            self.index.move_to_end(block_hash)
        return self._reader.submit(self._read_file, block_hash, token_ids)

    def touch(self, block_hash: bytes) -> None:
        """A use of the block: the disk's most recently used."""
        if block_hash in self.index:
            self.index.move_to_end(block_hash)

    def forget(self, block_hash: bytes) -> None:
        """Drop a block the disk could not keep (a failed write, a bad file)."""
        self.index.pop(block_hash, None)

    def take_failed(self) -> list[bytes]:
        """Hashes whose write failed since the last call (disk full): they are not on disk after all."""
        with self._lock:
            failed, self._failed = self._failed, []
        for block_hash in failed:
            self.index.pop(block_hash, None)
        return failed

    def flush(self) -> None:
        """Wait until every write handed over so far is in its file (or has failed)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)

    def _trim(self) -> None:
        while len(self.index) > self.capacity_blocks:
            block_hash, _ = self.index.popitem(last=False)
            # On the writer's queue, after the block's own write if that is still pending.
            self._writer.submit(self._delete_file, block_hash)

    # -- writer and reader threads ----------------------------------------------------------------
    def _write_file(self, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        with self._lock:
            payload = self._pending.get(block_hash)
        if payload is None:
            return
        path = self._path(block_hash)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with tmp.open("wb") as f:
                f.write(encode_header(self.format, block_hash, token_ids, checksum(payload)))
                f.write(payload)
            os.replace(tmp, path)
            self.written_blocks += 1
        except OSError as exc:
            _remove(tmp)
            with self._lock:
                self._failed.append(block_hash)
                self.write_failures += 1
                warn = not self._warned_full
                self._warned_full = True
            if warn:  # once: a full disk fails every write, and recompute covers each of them
                log.warning("KV disk tier cannot write to %s (%s); evicted blocks will be recomputed",
                            self.directory, exc)
        finally:
            with self._lock:
                self._pending.pop(block_hash, None)

    def _delete_file(self, block_hash: bytes) -> None:
        _remove(self._path(block_hash))

    def _read_file(self, block_hash: bytes, token_ids: tuple[int, ...]) -> bytearray | None:
        with self._lock:
            pending = self._pending.get(block_hash)
        if pending is not None:
            return bytearray(pending)
        path = self._path(block_hash)
        payload = bytearray(self.format.payload_bytes)
        try:
            with path.open("rb") as f:
                header = read_header(f, self.format, os.fstat(f.fileno()).st_size)
                if f.readinto(payload) != len(payload):
                    raise BadBlockFile("truncated payload")
            if header.get("hash") != block_hash.hex() or tuple(header.get("tokens", ())) != token_ids:  # type: ignore[arg-type]
                raise BadBlockFile("another block's file")
            if not checksum_matches(header, payload):
                raise BadBlockFile("checksum mismatch")
        except FileNotFoundError:
            return None
        except (OSError, BadBlockFile) as exc:
            log.warning("dropping KV block file %s: %s", path.name, exc)
            _remove(path)
            with self._lock:
                self.dropped_files += 1
            return None
        return payload


def _remove(path: Path) -> None:
    """Delete a file if the directory still allows it: a broken disk must not stop the thread."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


HOME_FILE = "kv-home"


def kv_home(directory: str | os.PathLike[str]) -> str:
    """The lasting name of a disk tier's directory, made on first use: an engine restarted on the directory
    holds the same blocks under a new process, and routing by this name finds them (chatsvc.router)."""
    path = Path(directory) / HOME_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # the first of racing starters wins
        with os.fdopen(fd, "w") as f:
            f.write(f"kv-{secrets.token_hex(8)}\n")
    name = path.read_text().strip()
    if not name:  # a starter that lost the race read before the winner wrote
        raise RuntimeError(f"{path} is empty; it names the disk tier's directory (delete it to make a new one)")
    return name


__all__ = ["BadBlockFile", "BlockFormat", "DiskStore", "FORMAT_VERSION", "HOME_FILE", "MAGIC", "kv_home"]
