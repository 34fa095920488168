"""Benchmark peer: datasketch MinHashLSH as a whole process over a JSONL stream, for timing against
`neardup filter` process to process (start-up included):

    python bench/alternate.py -n 3 --vs "python bench/datasketch_filter.py --stream STREAM" -- neardup filter -q STREAM

Used as bench/filter_bench.py uses it (128 permutations, threshold 0.5, character 5-grams of NFKC +
lower-case + punctuation-stripped text; query, then insert if no match); prints the unique records'
count. Imports only what datasketch needs, so its start-up is its own.
"""

from __future__ import annotations

import argparse
import re
import sys
import unicodedata
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
_PUNCT = re.compile(r"[\W_]+")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", default=str(ROOT.parent / "shared" / "eval" / "stream.jsonl"),
                   help="JSONL stream (default: the shared dev stream)")
    path = p.parse_args().stream
    sys.path.insert(0, str(ROOT))
    from bench import needs

    needs.files(__file__, path, what="a JSONL stream")
    needs.modules(__file__, "datasketch", install="neardup[bench]")
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=0.5, num_perm=128)
    unique = 0
    with open(path, "rb") as f:
        for line in f:
            record = orjson.loads(line)
            t = _PUNCT.sub("", unicodedata.normalize("NFKC", record["text"]).lower())
            mh = MinHash(num_perm=128)
            mh.update_batch([t[i : i + 5].encode("utf8") for i in range(max(len(t) - 4, 1))])
            if not lsh.query(mh):
                lsh.insert(record["id"], mh)
                unique += 1
    print(unique)
    return 0


if __name__ == "__main__":
    sys.exit(main())
