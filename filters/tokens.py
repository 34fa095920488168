"""Word tokenization of mixed-language text: jieba words for Han runs, word characters elsewhere.

Character n-grams (filters/shingles.py) are what the default filter fingerprints; words serve the
simhash `features="words"` option and `neardup explain`. jieba uses its bundled dictionary only; the
tokenizer is an instance per `WordTokenizer`, not jieba's process-wide default, and loads lazily.
"""

from __future__ import annotations

import logging
import re
from typing import Any

_RUNS = re.compile(r"[\u3400-\u9fff]+|[^\W_]+")
_HAN = re.compile(r"[\u3400-\u9fff]")


class WordTokenizer:
    def __init__(self) -> None:
        self._jieba: Any = None

    def __call__(self, text: str) -> list[str]:
        out: list[str] = []
        for run in _RUNS.findall(text):
            if _HAN.match(run):
                out.extend(w for w in self._segmenter().lcut(run, HMM=False) if w.strip())
            else:
                out.append(run)
        return out

    def _segmenter(self) -> Any:
        if self._jieba is None:
            import jieba

            logging.getLogger("jieba").setLevel(logging.WARNING)
            self._jieba = jieba.Tokenizer()
        return self._jieba
