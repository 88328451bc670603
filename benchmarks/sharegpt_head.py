"""The first N conversations of a ShareGPT JSON file, as a ShareGPT JSON file (what a GPU
session carries instead of the whole 125 MB). Read item by item: the packaged file is cut
short inside its last record.

    python benchmarks/sharegpt_head.py ShareGPT_V3_unfiltered_cleaned_split.json 1000 > head.json
"""

from __future__ import annotations

import json
import sys


def head(text: str, n: int) -> list:
    decoder, out = json.JSONDecoder(), []
    i = text.index("[") + 1
    while len(out) < n:
        while text[i] in " \t\r\n,":
            i += 1
        if text[i] == "]":
            break
        item, i = decoder.raw_decode(text, i)
        out.append(item)
    return out


if __name__ == "__main__":
    path, n = sys.argv[1], int(sys.argv[2])
    with open(path, encoding="utf-8") as f:
        json.dump(head(f.read(), n), sys.stdout, ensure_ascii=False)
