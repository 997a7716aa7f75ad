"""Token files and vocab maps: the two schemas that several steps share.

Token file (written by tokenize, read by vocab, extract, train): Parquet with columns
    id         string
    input_ids  list<int32>   the rendered conversation
    loss_mask  list<int8>    1 = a token the assistant generates (reasoning and end-of-turn
                             token included; role headers excluded)
    num_tokens int32
read back in record batches, never all at once.

Vocab file (written by vocab, read by extract, train, export): safetensors with
    d2t    [Vd] int64   offsets: target_id = i + d2t[i] (sorted, unique targets)
    t2d    [V]  bool    True where a target id is in the draft vocab
    counts [V]  int64   loss-masked token counts over the training split
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
])


class TokenWriter:
    """Append rows to a Parquet token file (write to a temp path; the caller renames it)."""

    def __init__(self, path: str | Path, row_group_rows: int = 1024):
        self.writer = pq.ParquetWriter(str(path), SCHEMA)
        self.rows: list[dict] = []
        self.row_group_rows = row_group_rows
        self.count = 0

    def write(self, id: str, input_ids: list[int], loss_mask: list[int]) -> None:
        assert len(input_ids) == len(loss_mask)
        self.rows.append({"id": id, "input_ids": input_ids, "loss_mask": loss_mask,
                          "num_tokens": len(input_ids)})
        if len(self.rows) >= self.row_group_rows:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.writer.write_table(pa.Table.from_pylist(self.rows, schema=SCHEMA))
            self.count += len(self.rows)
            self.rows = []

    def close(self) -> None:
        self.flush()
        self.writer.close()


def iter_token_batches(path: str | Path, batch_rows: int = 1024,
                       columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    yield from pq.ParquetFile(str(path)).iter_batches(batch_size=batch_rows, columns=columns)


def iter_samples(path: str | Path, batch_rows: int = 1024) -> Iterator[dict]:
    """{'id', 'input_ids': list[int], 'loss_mask': list[int], 'num_tokens'} one at a time."""
    for batch in iter_token_batches(path, batch_rows):
        yield from batch.to_pylist()


def num_rows(path: str | Path) -> int:
    return pq.ParquetFile(str(path)).metadata.num_rows


def lengths(path: str | Path) -> list[int]:
    """num_tokens of every row, in file order (reads one small column)."""
    return pq.read_table(str(path), columns=["num_tokens"]).column(0).to_pylist()


def ids_and_lengths(path: str | Path) -> tuple[list[str], list[int]]:
    """id and num_tokens of every row, in file order (two small columns)."""
    t = pq.read_table(str(path), columns=["id", "num_tokens"])
    return t.column("id").to_pylist(), t.column("num_tokens").to_pylist()


def read_rows(path: str | Path, indices: list[int]) -> list[dict]:
    """Selected rows by position (reads the needed columns, then takes)."""
    table = pq.read_table(str(path))
    return table.take(indices).to_pylist()


# ------------------------------------------------------------------------------------- vocab file
def save_vocab(path: str | Path, d2t, t2d, counts, metadata: dict | None = None) -> None:
    from drafter.core.rundir import safe_save_file

    safe_save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous(),
                    "counts": counts.contiguous()}, path,
                   {k: str(v) for k, v in (metadata or {}).items()})


def load_vocab(path: str | Path):
    """-> (d2t [Vd] int64, t2d [V] bool, counts [V] int64)."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    return t["d2t"], t["t2d"], t["counts"]
