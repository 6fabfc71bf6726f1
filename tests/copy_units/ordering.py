# copies: ordering.py
# Gathered rows (two replicas, padding, a repeat) back in dataset order; numpy only.
import io
import sys

import numpy as np
from ordering import (exactly_once, merge_rank_files, pad_eval_rows, rank_file_name,
                      save_rank_file)

assert not [m for m in sys.modules if m.startswith("torch")], "ordering.py imported torch"
index = np.array([[0, 2, 4], [1, 3, -1]])  # rank 0's rows, rank 1's rows (one padding row)
values = index[..., None] * 10.0
out = exactly_once(index, index >= 0, values, n=5)
assert out.index.tolist() == [0, 1, 2, 3, 4] and out.values[:, 0].tolist() == [0, 10, 20, 30, 40]
for rank in (0, 1):  # the rank-file protocol: each rank writes, the master merges
    buf = io.BytesIO()
    save_rank_file(buf, index[rank], None, values[rank], rank=rank, world_size=2, n=5)
    with open(rank_file_name(rank, 2), "wb") as f:
        f.write(buf.getvalue())
assert np.array_equal(merge_rank_files(".", 2, 5).values, out.values)
rows = [{"input_ids": [1, 2], "attention_mask": [1, 1], "labels": [1, 2]}] * 5
padded = pad_eval_rows(rows, per_replica_batch=2, world_size=2, width=2, pad_id=0)
assert len(padded) == 8 and padded[5]["labels"] == [-100, -100] and padded[:5] == rows
print("ok")
