"""The ref_logprobs stage's output format: its one writer and its one reader.

    {out}/{split}-NNNNN.parquet   sample_id int64; chosen_logp, rejected_logp float64 (sums of the
                                  response tokens' log-probs under the reference model);
                                  chosen_tokens, rejected_tokens int32 (how many tokens each sums)

One shard per data-parallel rank; sample_id joins them to prep's preference pairs.
"""

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("chosen_logp", pa.float64()),
        ("rejected_logp", pa.float64()),
        ("chosen_tokens", pa.int32()),
        ("rejected_tokens", pa.int32()),
    ]
)
VALUES = tuple(SCHEMA.names[1:])


def write(columns: dict[str, list], out: str, split: str, shard: int) -> None:
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    table = pa.Table.from_arrays([pa.array(columns[name], field.type) for name, field in zip(SCHEMA.names, SCHEMA)], schema=SCHEMA)
    with fs.open(f"{root.rstrip('/')}/{split}-{shard:05d}.parquet", "wb") as f:
        pq.write_table(table, f)


def read(uri: str, split: str, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The values of `split` in the order of `sample_ids`; every pair must have its values."""
    fs, root = fsspec.core.url_to_fs(uri)
    files = sorted(fs.glob(f"{root.rstrip('/')}/{split}-*.parquet"))
    if not files:
        raise FileNotFoundError(f"{uri}: no {split}-*.parquet reference log-probs")
    table = pa.concat_tables([pq.read_table(f, filesystem=fs) for f in files])
    position = {sid: i for i, sid in enumerate(table.column("sample_id").to_pylist())}
    missing = [int(sid) for sid in sample_ids if sid not in position]
    if missing:
        raise KeyError(f"{uri}: reference log-probs lack sample ids {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    order = np.array([position[sid] for sid in sample_ids], dtype=np.int64)
    return {name: table.column(name).to_numpy()[order] for name in VALUES}
