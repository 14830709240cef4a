"""The local multiple-choice task of benchmarks/lm_eval_serve.sh: a passage with one fact, a question about it, four
numbers to choose from (deterministic: seed 0). Written to ``needle_mc.jsonl`` beside this file."""
from __future__ import annotations

import json
import random
from pathlib import Path

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
THINGS = ["apple", "river", "lantern", "violin", "harbor", "meadow", "comet", "saddle", "pepper", "glacier",
          "orchid", "anchor", "falcon", "marble", "thistle", "canyon", "ember", "quartz", "willow", "beacon"]


def items(n: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        thing = THINGS[i % len(THINGS)]
        numbers = rng.sample(range(1000, 10000), 4)
        gold = rng.randrange(4)
        before, after = rng.randrange(2, 8), rng.randrange(2, 8)
        passage = FILLER * before + f"The special magic number for {thing} is {numbers[gold]}. " + FILLER * after
        out.append({"passage": passage.strip(), "thing": thing, "choices": [str(x) for x in numbers], "gold": gold})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("needle_mc.jsonl")
    path.write_text("".join(json.dumps(x) + "\n" for x in items()))
    print(f"wrote {path}")
