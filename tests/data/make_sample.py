"""Writes tests/data/sample.jsonl and its labels sample_truth.jsonl: a small synthetic stream with near-duplicates.

Sources and license: see tests/data/README.md (the first three bases are adapted from the UCI SMS Spam
Collection, CC BY 4.0; the other texts were written for this project; the edits are the generators below).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BASES = [
    "WINNER!! You have been selected to receive a £900 prize reward! To claim call 09061701461. Valid 12 hours only.",
    "Free entry in 2 a wkly comp to win FA Cup final tkts 21st May 2005. Text FA to 87121 to receive entry question",
    "URGENT! Your mobile number has been awarded a 2000 bonus caller prize. Call 09058094455 from a landline now",
    "Hey are we still meeting for lunch tomorrow? Let me know what time works for you.",
    "Congratulations, your account has been upgraded. Log in at http://secure-update.example.com/verify to keep access.",
    "The central bank said on Tuesday it would keep interest rates unchanged, citing steady growth and low inflation.",
    "恭喜您获得本月幸运大奖，请拨打13800138000领取您的奖品，逾期作废。",
    "这家酒店的位置很好，离地铁站很近，房间干净，服务也很热情，下次还会再来。",
    "妈妈喊你回家吃饭啦，今天做了你最爱吃的红烧肉。",
    "Don't forget to bring your laptop to the meeting, we will review the quarterly numbers.",
]
SMS_BASES = 3  # BASES[:3] are adapted from the UCI SMS Spam Collection
EDIT_NAMES = ["space_insertion", "case_change", "zero_width_insertion", "leet", "truncation", "ad_prefix_suffix",
              "width_swap", "number_substitution", "confusables", "emoji_insertion"]
EDITS = [
    lambda t, r: " ".join(t),                                   # spaces between letters
    lambda t, r: t.upper(),
    lambda t, r: "".join(c + ("\u200b" if r.random() < 0.3 else "") for c in t),
    lambda t, r: t.replace("o", "0").replace("e", "3"),          # leetspeak
    lambda t, r: t[: len(t) * 2 // 3] + "...",                   # truncation
    lambda t, r: "FWD: " + t + " Reply STOP to opt out",
    lambda t, r: "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in t),  # full-width
    lambda t, r: "".join(str(r.randint(0, 9)) if c.isdigit() else c for c in t),     # new numbers
    lambda t, r: t.replace("a", "а").replace("o", "о"),          # Cyrillic look-alikes
    lambda t, r: "🔥" + t.replace(" ", " 🎉 ", 3),
]


def main() -> None:
    r = random.Random(7)
    rows = []
    truth = []
    vocab = ("apple river budget green window rocket silent music paper garden orange coffee winter "
             "number travel yellow bridge planet cotton market shadow pencil summer castle forest "
             "engine lemon island camera silver doctor valley rabbit thunder basket mirror ticket").split()
    fillers = [" ".join(r.choice(vocab) for _ in range(r.randint(8, 14))).capitalize() + "."
               for _ in range(300)]
    for i in range(300):
        if r.random() < 0.45:
            k = r.choice(range(len(BASES)))  # the same draw as r.choice(BASES)
            base, cluster, corpus = BASES[k], f"base{k}", "sms_en" if k < SMS_BASES else "written"
            if r.random() < 0.8:
                e = r.choice(range(len(EDITS)))
                text, ptype = EDITS[e](base, r), EDIT_NAMES[e]
            else:
                text, ptype = base, "base"
        else:
            text, cluster, corpus, ptype = fillers[i], f"filler{i}", "filler", "base"
        rows.append({"id": f"m{i:04d}", "text": text, "ts": 1_700_000_000 + i})
        truth.append({"id": f"m{i:04d}", "cluster": cluster, "corpus": corpus, "ptype": ptype, "gray": False})
    rows.insert(150, {"id": "bad-1", "txt": "no text field here"})
    truth.insert(150, {"id": "bad-1", "cluster": "bad-1", "corpus": "invalid", "ptype": "base", "gray": False})
    truth.append({"id": "line-302", "cluster": "line-302", "corpus": "invalid", "ptype": "base", "gray": False})
    out = Path(__file__).with_name("sample.jsonl")
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.write("this line is not JSON\n")
    with out.with_name("sample_truth.jsonl").open("w", encoding="utf-8") as f:
        for row in truth:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
