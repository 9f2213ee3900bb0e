"""The disk tier's block file (engine/kv_disk.py): one KV block, its header and a checksum.

A file holds one full prefix block, named by its content hash (BlockManager.chain_hash, seeded with
kv_connector.key_seed, so the name already tells model, KV dtype and block size apart):

    MAGIC (8 bytes) | header length (u32, little-endian) | header (JSON, UTF-8) | payload

The header names the format version, the tokenfab version that wrote it, the key seed (the model's
identity), the hash, the block size, each tensor's dtype and shape (the values, and the int8 scales
when the pool has them), the payload's length and its CRC-32. The payload is the tensors' bytes, one
after the other. `read_header` reads only the header (what a directory scan needs); `read_block` reads
the whole file and checks all of it. Anything wrong raises BlockFileError with the reason a log line
and a counter name: corrupt, truncated, foreign (another model or layout) or version.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenfab.version import __version__

MAGIC = b"TFKVBLK\x00"
FORMAT_VERSION = 1
_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 16
SUFFIX = ".kvblock"


class BlockFileError(Exception):
    """A block file that must not be loaded; `kind` is corrupt, truncated, foreign or version."""

    def __init__(self, kind: str, why: str):
        super().__init__(f"{kind}: {why}")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What every block of one engine looks like: its key seed, block size and per-tensor dtype and shape."""
    key_seed: int
    block_size: int
    tensors: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of_pool(cls, key_seed: int, block_size: int, pool: list[torch.Tensor]) -> "BlockLayout":
        """One block of each pool tensor (blocks on dim 2)."""
        return cls(key_seed, block_size, tuple((str(t.dtype).removeprefix("torch."), tuple(t[:, :, 0].shape))
                                               for t in pool))

    @property
    def payload_bytes(self) -> int:
        return sum(torch.empty(0, dtype=getattr(torch, d)).element_size() * _numel(s) for d, s in self.tensors)

    def header(self, block_hash: int, crc: int) -> bytes:
        return json.dumps({"format": FORMAT_VERSION, "tokenfab": __version__, "key_seed": self.key_seed,
                           "hash": block_hash, "block_size": self.block_size,
                           "tensors": [[d, list(s)] for d, s in self.tensors],
                           "payload_bytes": self.payload_bytes, "crc32": crc}, separators=(",", ":")).encode()

    def file_bytes(self, block_hash: int) -> int:
        """The size of a block file (the CRC's digits vary: the widest is counted)."""
        return len(MAGIC) + _LEN.size + len(self.header(block_hash, 0xFFFFFFFF)) + self.payload_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def file_name(block_hash: int) -> str:
    return f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}{SUFFIX}"


def hash_of(path: Path) -> int | None:
    """The block hash a file's name gives, or None when it is not a block file's name."""
    if path.suffix != SUFFIX:
        return None
    try:
        h = int(path.stem, 16)
    except ValueError:
        return None
    return h - (1 << 64) if h >= 1 << 63 else h


def encode_parts(layout: BlockLayout, block_hash: int, tensors: list[torch.Tensor]) -> list[bytes | memoryview]:
    """A block file's bytes as the header and one buffer per tensor (the tensors' memory, not copied)."""
    bufs = [memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B") for t in tensors]
    assert sum(b.nbytes for b in bufs) == layout.payload_bytes, (sum(b.nbytes for b in bufs), layout.payload_bytes)
    crc = 0
    for b in bufs:
        crc = zlib.crc32(b, crc)
    header = layout.header(block_hash, crc)
    return [MAGIC + _LEN.pack(len(header)) + header, *bufs]


def encode(layout: BlockLayout, block_hash: int, tensors: list[torch.Tensor]) -> bytes:
    """A block file's bytes."""
    return b"".join(encode_parts(layout, block_hash, tensors))


def _parse_header(head: bytes) -> tuple[dict, int]:
    """(header, payload offset) from a file's first bytes."""
    if len(head) < len(MAGIC) + _LEN.size or head[:len(MAGIC)] != MAGIC:
        raise BlockFileError("corrupt", "no block file magic")
    (n,) = _LEN.unpack_from(head, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if n > _MAX_HEADER:
        raise BlockFileError("corrupt", f"header length {n}")
    if len(head) < start + n:
        raise BlockFileError("truncated", "the header is cut off")
    try:
        header = json.loads(head[start:start + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BlockFileError("corrupt", "the header is not JSON") from None
    if not isinstance(header, dict):
        raise BlockFileError("corrupt", "the header is not a JSON object")
    return header, start + n


def check_header(header: dict, offset: int, file_size: int, layout: BlockLayout, block_hash: int) -> None:
    """Raise BlockFileError unless the header describes a block of `layout` under `block_hash`, whole."""
    if header.get("format") != FORMAT_VERSION or header.get("tokenfab") != __version__:
        raise BlockFileError("version", f"format {header.get('format')} of tokenfab {header.get('tokenfab')}, "
                                        f"not format {FORMAT_VERSION} of tokenfab {__version__}")
    tensors = header.get("tensors")
    ours = [[d, list(s)] for d, s in layout.tensors]
    if (header.get("key_seed"), header.get("block_size"), tensors) != (layout.key_seed, layout.block_size, ours):
        raise BlockFileError("foreign", f"key seed {header.get('key_seed')}, block size {header.get('block_size')}, "
                                        f"tensors {tensors}: another model or KV layout")
    if header.get("hash") != block_hash or header.get("payload_bytes") != layout.payload_bytes:
        raise BlockFileError("corrupt", "the header's hash or payload length does not match the file")
    if file_size < offset + layout.payload_bytes:
        raise BlockFileError("truncated", f"{file_size} bytes, {offset + layout.payload_bytes} expected")
    if file_size > offset + layout.payload_bytes:
        raise BlockFileError("corrupt", f"{file_size} bytes, {offset + layout.payload_bytes} expected")


def read_header(path: Path, layout: BlockLayout, block_hash: int) -> None:
    """Check a file's header (and its size) without reading the payload."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + _LEN.size + _MAX_HEADER)
        size = f.seek(0, 2)
    header, offset = _parse_header(head)
    check_header(header, offset, size, layout, block_hash)


def read_block(path: Path, layout: BlockLayout, block_hash: int) -> list[torch.Tensor]:
    """The block's tensors, after checking the header, the size and the checksum."""
    data = path.read_bytes()
    header, offset = _parse_header(data)
    check_header(header, offset, len(data), layout, block_hash)
    payload = memoryview(data)[offset:]
    if zlib.crc32(payload) != header.get("crc32"):
        raise BlockFileError("corrupt", "checksum mismatch")
    out, pos, buf = [], 0, bytearray(payload)
    for d, shape in layout.tensors:
        dtype = getattr(torch, d)
        n = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
        out.append(torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=pos).view(dtype).reshape(shape))
        pos += n
    return out
