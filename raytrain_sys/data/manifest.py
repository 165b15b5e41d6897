"""The dataset manifest: the one list of shards, their row counts and hashes.

A dataset directory (local or ``s3://``) holds ``manifest.json`` plus the shard files it names.
The manifest is read once per job; nothing re-lists the directory afterwards. Sample ids are
positions in the manifest's concatenation of shards: shard ``i`` holds ids
``[row_offsets[i], row_offsets[i] + shards[i].num_rows)``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from raytrain_sys.errors import DataError

MANIFEST_NAME = "manifest.json"
TOKENS_FORMAT = "raytrain-sys/tokens-v1"  # parquet, one fixed-size binary column "tokens"
# tar shards + a seek index per shard (<shard>.idx); extra["fields"] maps column -> member extension
WEBDATASET_FORMAT = "raytrain-sys/webdataset-v1"
# parquet, one variable-length binary column "tokens", a document per row (row groups = shuffle
# blocks); extra["document_lengths"] = {path, num_bytes, sha256} of a side file holding every
# document's token count (little-endian uint32, sample id order), so plans never read the shards
DOCUMENTS_FORMAT = "raytrain-sys/documents-v1"
# your own Parquet files, indexed where they lie (prepare-data --index, data/table.py); extra:
# "schema" {column: arrow type}, "row_groups" (rows of each row group, per file)
TABLE_FORMAT = "raytrain-sys/table-v1"


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the dataset directory
    num_rows: int
    num_bytes: int
    sha256: str


@dataclass(frozen=True)
class DatasetManifest:
    format: str
    row_len: int  # tokens per row (model block_size + 1 for next-token targets); 0 for samples, documents
    shards: tuple[ShardInfo, ...]
    source: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.shards)

    @property
    def row_offsets(self) -> list[int]:
        offsets, total = [], 0
        for s in self.shards:
            offsets.append(total)
            total += s.num_rows
        return offsets

    @property
    def content_hash(self) -> str:
        """Changes whenever any shard's bytes, order or row count changes."""
        h = hashlib.sha256()
        h.update(f"{self.format}|{self.row_len}".encode())
        for s in self.shards:
            h.update(f"|{s.path}|{s.num_rows}|{s.sha256}".encode())
        return h.hexdigest()[:16]

    def to_json(self) -> str:
        d = asdict(self)
        d["shards"] = [asdict(s) for s in self.shards]
        d["num_rows"] = self.num_rows
        d["content_hash"] = self.content_hash
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> "DatasetManifest":
        try:
            d = json.loads(text)
            shards = tuple(ShardInfo(**s) for s in d["shards"])
            m = cls(format=d["format"], row_len=int(d["row_len"]), shards=shards,
                    source=d.get("source", ""), extra=d.get("extra", {}))
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{where} is not a valid dataset manifest ({exc}); "
                            f"re-create it with `raytrain-sys prepare-data`") from None
        if not m.shards:
            raise DataError(f"{where} lists no shards")
        if "content_hash" in d and d["content_hash"] != m.content_hash:
            raise DataError(f"{where} was edited by hand: its content_hash does not match its shards")
        return m
