"""Write cookbook_chat.jsonl: short, patterned chats for cookbook SFT tests (deterministic).

Run from the repository root: `python tests/data/make_cookbook_chat.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

NAMES = ["red", "blue", "green", "black", "white", "gold"]
THINGS = ["cat", "box", "tree", "ship"]


def conversations() -> list[dict[str, list[dict[str, str]]]]:
    rows = []
    for i in range(48):
        a, b = i % 7 + 1, i // 7 + 2
        if i % 2 == 0:
            user = f"What is {a} plus {b}?"
            answer = f"{a} plus {b} is {a + b}."
        else:
            colour, thing = NAMES[i % len(NAMES)], THINGS[i % len(THINGS)]
            user = f"Name the colour of the {thing}."
            answer = f"The {thing} is {colour}."
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return rows


if __name__ == "__main__":
    out = Path(__file__).with_name("cookbook_chat.jsonl")
    out.write_text("".join(json.dumps(row) + "\n" for row in conversations()))
