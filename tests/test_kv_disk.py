"""The disk tier's files: round trip, restart, LRU by bytes, and every bad file dropped instead of served."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.kv_disk import HEADER_ALLOWANCE, SUFFIX, BlockFormat, DiskStore

FMT = BlockFormat(model="models/a.gguf", dtype="float32", block_size=4, layout="layer,kv,head,token,dim",
                  shape=(2, 2, 2, 4, 8), payload_bytes=2 * 2 * 2 * 4 * 8 * 4)
ROOT = Path(__file__).resolve().parents[1]


def _payload(seed: int) -> bytes:
    return bytes((seed * 31 + i) % 251 for i in range(FMT.payload_bytes))


def _block(i: int) -> tuple[bytes, tuple[int, ...]]:
    return bytes([i]) * 16, (i, i + 1, i + 2, i + 3)


def _store(path: Path, blocks: int = 8, fmt: BlockFormat = FMT) -> DiskStore:
    return DiskStore(path, fmt, blocks * (fmt.payload_bytes + HEADER_ALLOWANCE))


def _write(store: DiskStore, *ids: int) -> None:
    for i in ids:
        store.write(*_block(i), _payload(i))
    store.flush()


def test_round_trip_and_restart(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 1, 2)
    assert store.read(*_block(1)).result() == _payload(1)
    store.close()
    again = _store(tmp_path)  # a restart: the index comes from the files
    assert again.num_blocks == 2 and again.contains(*_block(2))
    assert again.read(*_block(2)).result() == _payload(2)
    assert again.dropped_files == 0


def test_read_before_the_write_lands_gets_the_pending_payload(tmp_path: Path) -> None:
    store = _store(tmp_path)
    block_hash, tokens = _block(3)
    store.write(block_hash, tokens, _payload(3))
    assert store.read(block_hash, tokens).result() == _payload(3)


def test_lru_by_bytes_deletes_the_oldest_file(tmp_path: Path) -> None:
    store = _store(tmp_path, blocks=2)
    _write(store, 1, 2)
    store.read(*_block(1)).result()  # 1 is now the most recently used
    _write(store, 3)
    assert not store.contains(*_block(2)) and store.contains(*_block(1)) and store.contains(*_block(3))
    assert sorted(p.name for p in tmp_path.glob(f"*{SUFFIX}")) == sorted(
        f"{_block(i)[0].hex()}{SUFFIX}" for i in (1, 3))
    assert store.num_bytes <= 2 * store.file_bytes


def _file(tmp_path: Path, i: int) -> Path:
    return tmp_path / f"{_block(i)[0].hex()}{SUFFIX}"


def test_corrupt_payload_is_dropped_on_read(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 1)
    data = bytearray(_file(tmp_path, 1).read_bytes())
    data[-10] ^= 0xFF
    _file(tmp_path, 1).write_bytes(bytes(data))
    assert store.read(*_block(1)).result() is None
    assert not _file(tmp_path, 1).exists() and store.dropped_files == 1


def _legacy_file(tmp_path: Path, i: int, payload: bytes) -> None:
    """A block file as earlier builds wrote it: the payload's digest a blake2b under ``blake2b``."""
    import hashlib
    import json

    from engine.kv_disk import FORMAT_VERSION, MAGIC

    block_hash, tokens = _block(i)
    header = {**dataclasses.asdict(FMT), "version": FORMAT_VERSION, "hash": block_hash.hex(), "tokens": list(tokens),
              "blake2b": hashlib.blake2b(_payload(i), digest_size=16).hexdigest()}
    body = json.dumps(header).encode()
    _file(tmp_path, i).write_bytes(MAGIC + len(body).to_bytes(4, "little") + body + payload)


def test_files_of_earlier_builds_are_verified_by_their_blake2b(tmp_path: Path) -> None:
    _legacy_file(tmp_path, 1, _payload(1))
    bad = bytearray(_payload(2))
    bad[3] ^= 0x10
    _legacy_file(tmp_path, 2, bytes(bad))
    store = _store(tmp_path)
    assert store.num_blocks == 2
    assert store.read(*_block(1)).result() == _payload(1)
    assert store.read(*_block(2)).result() is None and not _file(tmp_path, 2).exists()


@pytest.mark.parametrize("damage", ["truncated", "not a block file", "foreign model", "other dtype",
                                    "other block size", "renamed"])
def test_bad_files_are_dropped_at_start_up(tmp_path: Path, damage: str) -> None:
    store = _store(tmp_path)
    _write(store, 1, 2)
    store.close()
    path = _file(tmp_path, 1)
    fmt = FMT
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "not a block file":
        path.write_bytes(b"hello")
    elif damage == "foreign model":
        fmt = dataclasses.replace(FMT, model="models/b.gguf")
    elif damage == "other dtype":
        fmt = dataclasses.replace(FMT, dtype="bfloat16", payload_bytes=FMT.payload_bytes // 2)
    elif damage == "other block size":
        fmt = dataclasses.replace(FMT, block_size=8)
    else:
        path.rename(_file(tmp_path, 9))
        path = _file(tmp_path, 9)
    again = _store(tmp_path, fmt=fmt)
    assert not path.exists()
    if damage in ("foreign model", "other dtype", "other block size"):
        assert again.num_blocks == 0 and again.dropped_files == 2  # both files were written for another format
    else:
        assert again.num_blocks == 1 and again.dropped_files == 1
        assert again.read(*_block(2)).result() == _payload(2)
        assert again.read(*_block(1)).result() is None


def test_leftover_temporary_files_are_removed(tmp_path: Path) -> None:
    (tmp_path / f"{'ab' * 16}{SUFFIX}.tmp").write_bytes(b"half a write")
    _store(tmp_path)
    assert not list(tmp_path.iterdir())


def test_disk_full_degrades_to_misses_with_one_warning(tmp_path: Path) -> None:
    """A real write limit (RLIMIT_FSIZE, in a child process so it binds nothing else) fails every write with
    an OSError: the blocks leave the index, nothing raises, and the warning is logged once."""
    script = textwrap.dedent(f"""
        import logging, resource, signal, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_kv_disk import _block, _payload, _store
        from pathlib import Path
        logging.basicConfig(level=logging.WARNING)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
        store = _store(Path({str(tmp_path)!r}))
        for i in range(3):
            store.write(*_block(i), _payload(i))
        store.flush()
        failed = store.take_failed()
        print("RESULT", len(failed), store.write_failures, store.num_blocks, store.read(*_block(0)).result())
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "RESULT 3 3 0 None" in proc.stdout
    assert proc.stderr.count("cannot write") == 1
    assert not list(tmp_path.glob(f"*{SUFFIX}*"))


def test_kv_home_names_the_directory_for_good_and_survives_the_start_up_scan(tmp_path: Path) -> None:
    from engine.kv_disk import HOME_FILE, kv_home

    first = kv_home(tmp_path / "kv")
    _write(_store(tmp_path / "kv"), 1, 2)
    assert kv_home(tmp_path / "kv") == first and first.startswith("kv-")
    _store(tmp_path / "kv")  # a restart's index rebuild keeps the name
    assert kv_home(tmp_path / "kv") == first != kv_home(tmp_path / "other")
    (tmp_path / "kv" / HOME_FILE).write_text("")
    with pytest.raises(RuntimeError, match="empty"):
        kv_home(tmp_path / "kv")
