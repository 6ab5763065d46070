"""Greedy 32-token continuations (token ids) of the llama.cpp fixture prompts, as JSON, from
the engine in a given checkout: run it on two builds and compare the outputs to show a kernel
change left greedy decoding unchanged.

    python tests/tools/greedy_ids.py /path/to/checkout-A > a.json
    python tests/tools/greedy_ids.py /path/to/checkout-B > b.json && cmp a.json b.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def main() -> None:
    sys.path.insert(0, sys.argv[1])  # the checkout whose engine (and built kernels) to use
    import numpy as np

    from engine import registry
    from engine.model import Model

    out = {}
    for name in ("smollm2-135m", "gemma3-270m"):
        cases = json.loads((FIXTURES / f"llamacpp_greedy_{name}.json").read_text())["cases"]
        model = Model.load(registry.resolve(name), threads=2, kv_budget="256MiB", max_context=512)
        runs = []
        for case in cases:
            prompt = list(case["prompt_ids"])
            logits = model.forward(prompt, 0)
            ids = []
            for i in range(32):
                tok = int(np.argmax(logits))
                ids.append(tok)
                logits = model.forward([tok], len(prompt) + i)
            runs.append(ids)
        out[name] = runs
    print(json.dumps(out))


if __name__ == "__main__":
    main()
